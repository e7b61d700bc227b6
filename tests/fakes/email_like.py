"""A Postmark-like fake: ``POST /email`` (and ``/email/withTemplate``, sent alike) and
``GET /messages/outbound``, as
https://postmarkapp.com/developer/api/email-api and the custom metadata FAQ describe them
(read 2026-12-01).

* No idempotency: every accepted ``/email`` sends (one receipt each), whatever it repeats.
* ``Metadata`` is kept; ``GET /messages/outbound?count&offset&metadata_KEY=VALUE``
  finds a message only ``LAG_S`` after it was sent (a lagging index).
* The server token travels in ``X-Postmark-Server-Token``; errors have Postmark's shape
  ``{"ErrorCode": n, "Message": "..."}`` (401 code 10; 422 code 402 for invalid JSON and
  300 for an invalid email request). A body that is not ``application/json`` is 415, as
  Postmark announced for its email API (status.postmarkapp.com, "Changes to Email API
  validation", 2023-11-28, read 2026-12-01 via a stored copy on isdown.app).

Usage: ``python email_like.py RECEIPTS PORT LAG_S``.
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web
from common import delay, serve, tool_from_argv

TOOL = tool_from_argv()


def error(status: int, code: int, message: str) -> web.Response:
    return web.json_response({"ErrorCode": code, "Message": message}, status=status)


async def send(request: web.Request) -> web.Response:
    """Send one email: no dedup, a receipt per accepted request."""
    await delay(request)
    if not request.headers.get("X-Postmark-Server-Token"):
        return error(401, 10, "No Account or Server API tokens were supplied in the HTTP headers.")
    if request.content_type != "application/json":
        return web.json_response({"Message": "Unsupported Media Type"}, status=415)
    body = await request.read()
    try:
        message = json.loads(body)
    except ValueError:
        return error(422, 402, "Received invalid JSON input.")
    if not isinstance(message, dict) or not message.get("From") or not message.get("To"):
        return error(422, 300, "Invalid email request: From and To are required.")
    metadata = message.get("Metadata") or {}
    op = metadata.get("effectguard_op") if isinstance(metadata, dict) else None
    message_id = str(uuid.uuid4())
    at = await TOOL.effect(request.path, op, body, message_id)
    submitted = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    TOOL.index.add(op, {"MessageID": message_id, "To": message["To"], "Metadata": metadata,
                        "Status": "Sent", "ReceivedAt": submitted}, at)  # fmt: skip
    return web.json_response(
        {
            "To": message["To"],
            "SubmittedAt": submitted,
            "MessageID": message_id,
            "ErrorCode": 0,
            "Message": "OK",
        }
    )


async def outbound(request: web.Request) -> web.Response:
    """Search sent messages by one metadata field (count and offset are required)."""
    if not request.headers.get("X-Postmark-Server-Token"):
        return error(401, 10, "No Account or Server API tokens were supplied in the HTTP headers.")
    if "count" not in request.query or "offset" not in request.query:
        return error(422, 1, "count and offset are required.")
    wanted = request.query.get("metadata_effectguard_op")
    found = TOOL.index.find(wanted) if wanted else []
    return web.json_response({"TotalCount": len(found), "Messages": found})


def main() -> None:
    app = web.Application()
    app.router.add_post("/email", send)
    # One message from a template: sent as /email is (the template is not rendered here).
    app.router.add_post("/email/withTemplate", send)
    app.router.add_get("/messages/outbound", outbound)
    serve(app)


if __name__ == "__main__":
    main()
