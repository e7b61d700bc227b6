"""A GitHub-like fake: ``POST /repos/{owner}/{repo}/issues/{n}/comments``, as
https://docs.github.com/en/rest/issues/comments describes it (read 2026-12-01).

* No idempotency and nothing to search: every accepted request posts a comment (one
  receipt each), whatever it repeats.
* ``Authorization: Bearer ...`` is required; errors have GitHub's shape ``{"message",
  "documentation_url"}``: 401 "Bad credentials"; 400 "Problems parsing JSON" or "Body
  should be a JSON object"; 422 "Validation Failed" with ``errors`` for a missing ``body``
  (https://docs.github.com/rest/using-the-rest-api/troubleshooting-the-rest-api, read
  2026-12-01 from github/docs in the stored index).

Usage: ``python chat_like.py RECEIPTS PORT LAG_S`` (LAG_S is unused: there is no search).
"""

from __future__ import annotations

import json
import time

from aiohttp import web
from common import delay, serve, tool_from_argv

TOOL = tool_from_argv()
DOCS = "https://docs.github.com/rest/issues/comments#create-an-issue-comment"
NEXT_ID = [1000]


async def comment(request: web.Request) -> web.Response:
    """Post one comment: a receipt per accepted request."""
    await delay(request)
    if not request.headers.get("Authorization", "").startswith("Bearer "):
        return web.json_response(
            {"message": "Bad credentials", "documentation_url": DOCS}, status=401
        )
    body = await request.read()
    try:
        fields = json.loads(body)
    except ValueError:
        return web.json_response(
            {"message": "Problems parsing JSON", "documentation_url": DOCS}, status=400
        )
    if not isinstance(fields, dict):
        return web.json_response(
            {"message": "Body should be a JSON object", "documentation_url": DOCS}, status=400
        )
    if not isinstance(fields.get("body"), str):
        return web.json_response(
            {"message": "Validation Failed", "documentation_url": DOCS,
             "errors": [{"resource": "IssueComment", "code": "missing_field", "field": "body"}]},
            status=422,
        )  # fmt: skip
    NEXT_ID[0] += 1
    await TOOL.effect(request.path, None, body, str(NEXT_ID[0]))
    m = request.match_info
    return web.json_response(
        {"id": NEXT_ID[0], "body": fields["body"],
         "html_url": f"https://github.com/{m['owner']}/{m['repo']}/issues/{m['n']}"
                     f"#issuecomment-{NEXT_ID[0]}",
         "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        status=201,
    )  # fmt: skip


def main() -> None:
    app = web.Application()
    app.router.add_post("/repos/{owner}/{repo}/issues/{n}/comments", comment)
    serve(app)


if __name__ == "__main__":
    main()
