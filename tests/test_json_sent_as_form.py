"""A JSON body sent with ``curl -d`` (which labels it ``application/x-www-form-urlencoded``)
through the proxy, with a ledger key, restricted to a model or not.

Walked from the outside: the unrestricted key got 400 ``request body is not a valid form:
bad query field: '{"model": ...}'``, the whole body quoted back (a 200 KB prompt made a
200 KB error message), and the key restricted to ``gpt-4o-mini`` got 403 ``this request
names no model`` for a body that plainly names ``gpt-4o-mini``. Both now say the body
does not parse as a form, without quoting it, and how to send JSON. Nothing is sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_key_replicas import cli, new_key, replica

from effectguard.testing import FakeProvider, fake_provider

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
#: What ``curl -d`` sends when no ``-H 'content-type: ...'`` is given.
CURL_DEFAULT = "application/x-www-form-urlencoded"


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    """The fake provider process."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def test_a_json_body_labelled_as_a_form_is_refused_saying_so(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """Both keys are refused with a message that names the mix-up and quotes no body."""
    ledger = str(tmp_path / "ledger.db")
    assert cli(ledger, "migrate").returncode == 0
    anything = new_key(ledger, "--root", "team-a")
    mini_only = new_key(ledger, "--root", "team-a", "--models", "gpt-4o-mini")
    prompt = "x" * 200_000
    body = json.dumps(
        {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": prompt}]}
    ).encode()
    with replica(ledger, provider, tmp_path, "r") as proxy:

        def send(key: str) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}", "content-type": CURL_DEFAULT}
            return httpx.post(proxy.url + CHAT, content=body, headers=headers, timeout=15)

        plain = send(anything)
        assert plain.status_code == 400, plain.text[:300]
        message = plain.json()["error"]["message"]
        assert len(message) < 400, f"the error quotes the body: {message[:300]}..."
        assert "application/json" in message, message

        restricted = send(mini_only)
        assert restricted.status_code == 403, restricted.text[:300]
        error = restricted.json()["error"]
        assert error["type"] == "model_forbidden"
        assert "not a valid form" in error["message"], error["message"][:300]
        assert "application/json" in error["message"], error["message"][:300]
        assert len(error["message"]) < 400, error["message"][:300]
    assert provider.receipts() == []
