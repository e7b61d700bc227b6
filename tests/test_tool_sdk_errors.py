"""effectguard's refusals on a bundled tool's routes come in that tool's own error shape
(docs/contract.md §9), so the tool's SDK raises its usual exception, not a crash.

Through a real ``effectguard serve`` in front of the tool fakes of tests/fakes. postmarker
read ``data["ErrorCode"]`` from every error answer and crashed with ``KeyError`` on the
``{"error": {...}}`` refusals; stripe-python reads only ``Stripe-Should-Retry`` and
otherwise retries every 409 and 5xx by itself. The real SDKs are exercised where they are
installed (``pip install postmarker stripe``); the wire shapes they read are checked always.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import RunningFake, running_fake

from effectguard.testing import Proxy, free_port, running_proxy

pytestmark = pytest.mark.slow

EMAIL = {"From": "a@example.com", "To": "b@example.com", "Subject": "s", "TextBody": "t"}
PAY = {"amount": "500", "currency": "usd"}
POOR = {"Effectguard-Budget": "poor"}  # a budget with no room for any call


#: Postmark's own listener (``--provider-port``): postmarker drops a root URL's path.
POSTMARK_PORT = free_port()


@pytest.fixture
def tools(tmp_path: Path) -> Iterator[tuple[Proxy, RunningFake, RunningFake, RunningFake]]:
    """The proxy in front of the Postmark-, Stripe- and GitHub-like fakes (Postmark on a
    port of its own too), with a budget ``poor`` too small for any of their calls."""
    ledger = tmp_path / "ledger.db"
    for args in (("migrate",), ("budget", "set", "poor", "--limit", "0.000001")):
        subprocess.run([sys.executable, "-m", "effectguard", *args, "--ledger", str(ledger)],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
    with (
        running_fake("email_like", tmp_path / "email.jsonl") as email,
        running_fake("stripe_like", tmp_path / "stripe.jsonl") as stripe,
        running_fake("chat_like", tmp_path / "chat.jsonl") as chat,
        running_proxy(
            ledger,
            upstreams={"postmark": email.url, "stripe": stripe.url, "github": chat.url},
            env={"STRIPE_API_KEY": "sk_test_x"},
            args=["--provider-port", f"postmark={POSTMARK_PORT}"],
        ) as proxy,
    ):
        yield proxy, email, stripe, chat


def _refused(proxy: Proxy, path: str, status: int = 402, **kwargs: Any) -> httpx.Response:
    answer = httpx.post(proxy.url + path, timeout=30, **kwargs)
    assert answer.status_code == status, answer.text
    assert answer.headers["x-should-retry"] == "false"
    return answer


def test_each_bundled_tool_refuses_in_its_own_shape(
    tools: tuple[Proxy, RunningFake, RunningFake, RunningFake],
) -> None:
    """A refusal (over budget; GitHub's comments are free, so a body that is not a JSON
    object) reads as the tool's own error, and still names effectguard's type and call for
    machines; nothing reaches any tool."""
    proxy, email, stripe, chat = tools
    postmark = _refused(proxy, "/postmark/email", json=EMAIL, headers={
        **POOR, "X-Postmark-Server-Token": "pm"})  # fmt: skip
    body = postmark.json()
    assert body["ErrorCode"] == 9402
    assert body["Message"].startswith("budget_exceeded: ")
    assert body["effectguard"]["type"] == "budget_exceeded"
    assert body["effectguard"]["call_id"] == postmark.headers["effectguard-call-id"]

    paid = _refused(proxy, "/stripe/v1/payment_intents", data=PAY, headers=POOR)
    assert (paid.json()["error"]["type"], paid.json()["error"]["code"]) == (
        "budget_exceeded",
        "budget_exceeded",
    )
    assert paid.headers["stripe-should-retry"] == "false"

    url = "/github/repos/o/r/issues/1/comments"
    github = _refused(proxy, url, 400, content=b"[1]", headers={"Authorization": "Bearer gh"})
    assert github.json()["status"] == "400"
    assert github.json()["message"] == github.json()["effectguard"]["message"]
    assert github.json()["effectguard"]["type"] == "invalid_request"
    assert email.effects() == stripe.effects() == chat.effects() == []


def test_a_stripe_answer_booked_unknown_tells_stripe_python_not_to_retry(
    tools: tuple[Proxy, RunningFake, RunningFake, RunningFake],
) -> None:
    """Stripe's 500 is held as an unknown effect: the answer says so in the header
    stripe-python reads, as well as in ``x-should-retry``."""
    proxy, _, stripe, _ = tools
    headers = {"Idempotency-Key": "order-9", "x-fake-status": "500"}
    answer = httpx.post(proxy.url + "/stripe/v1/payment_intents", data=PAY, headers=headers)
    assert answer.status_code == 500, answer.text
    assert answer.headers["x-should-retry"] == "false"
    assert answer.headers.get_list("stripe-should-retry") == ["false"]
    assert len(stripe.effects()) == 1


def test_a_postmark_email_with_null_metadata_is_sent_with_its_operation_id(
    tools: tuple[Proxy, RunningFake, RunningFake, RunningFake],
) -> None:
    """postmarker sends ``"Metadata": null`` for an email without metadata: effectguard
    writes its operation id there (it refused the email with 400 before)."""
    proxy, email, _, _ = tools
    sent = httpx.post(proxy.url + "/postmark/email", json={**EMAIL, "Metadata": None},
                      headers={"X-Postmark-Server-Token": "pm"})  # fmt: skip
    assert sent.status_code == 200, sent.text
    (effect,) = email.effects()
    assert effect["op"] == sent.headers["effectguard-call-id"]


def test_postmarker_raises_its_client_error_on_a_refusal(
    tools: tuple[Proxy, RunningFake, RunningFake, RunningFake],
) -> None:
    """The real postmarker, pointed at Postmark's own port as docs/contract.md §1 says,
    sends an email and raises ``ClientError`` on a refusal."""
    core = pytest.importorskip("postmarker.core")
    exceptions = pytest.importorskip("postmarker.exceptions")
    _, email, _, _ = tools
    url = f"http://127.0.0.1:{POSTMARK_PORT}"
    client = core.PostmarkClient(server_token="pm", root_api_url=url)
    assert client.emails.send(**EMAIL)["ErrorCode"] == 0
    client.session.headers.update(POOR)
    with pytest.raises(exceptions.ClientError) as refused:
        client.emails.send(**EMAIL)
    assert refused.value.error_code == 9402
    assert "budget_exceeded" in str(refused.value)
    assert len(email.effects()) == 1


def test_stripe_python_raises_its_error_on_a_refusal(
    tools: tuple[Proxy, RunningFake, RunningFake, RunningFake],
) -> None:
    """The real stripe-python raises its error for the status, with effectguard's type as
    its code, and reads the refusal's ``Stripe-Should-Retry``."""
    stripe_sdk = pytest.importorskip("stripe")
    proxy, _, stripe, _ = tools
    client = stripe_sdk.StripeClient(
        "sk_test_x", base_addresses={"api": proxy.url + "/stripe"}, max_network_retries=2
    )
    created = client.v1.payment_intents.create(params={"amount": 5, "currency": "usd"})
    assert created.object == "payment_intent"
    with pytest.raises(stripe_sdk.StripeError) as refused:
        client.v1.payment_intents.create(
            params={"amount": 5, "currency": "usd"}, options={"headers": POOR}
        )
    assert (refused.value.http_status, refused.value.code) == (402, "budget_exceeded")
    assert refused.value.headers["stripe-should-retry"] == "false"
    assert len(stripe.effects()) == 1
