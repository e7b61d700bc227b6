"""The bundled tool declarations read each status as the vendor documents it (issue #14,
deliverable 7; the citations are in effectguard/providers/bundled/{stripe,postmark,github}.toml),
and the fakes in tests/fakes answer as the vendors document.

The Stripe 5xx test runs a real ``effectguard serve`` in front of the Stripe fake: a 503
that Stripe turned away proves nothing, so a keyed resend must reach Stripe (which
deduplicates it), not be answered with the stored 503.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fakes import RunningFake, running_fake
from toolkit import cli_json as _cli

from effectguard.providers import load_providers
from effectguard.testing import Proxy, running_proxy

#: status -> what it means for the effect ("none": not processed; "unknown": held until
#: reconciled; "applied": booked as a failed call and replayed to a keyed resend).
DOCUMENTED = {
    # docs.stripe.com/api/errors, /error-low-level, /idempotency (read 2026-12-01).
    "stripe": {
        **dict.fromkeys((400, 401, 403, 404, 409, 429), "none"),
        **dict.fromkeys((402, 424), "applied"),
        **dict.fromkeys((500, 502, 503, 504), "unknown"),
    },
    # postmarkapp.com/developer/api/overview (read 2026-12-01).
    "postmark": {
        **dict.fromkeys((401, 404, 413, 415, 422, 429, 503), "none"),
        500: "unknown",
    },
    # docs.github.com troubleshooting page and the create-an-issue-comment operation.
    "github": dict.fromkeys((400, 401, 403, 404, 410, 422, 429), "none"),
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_bundled_tool_reads_each_documented_status(name: str) -> None:
    """Each documented status means, for the effect, what the vendor's pages say."""
    provider = load_providers()[name]
    assert {s: provider.answer_effect(s) for s in DOCUMENTED[name]} == DOCUMENTED[name]
    assert provider.retry_statuses <= provider.no_effect_statuses


def test_bundled_tool_auth_headers_are_the_vendors() -> None:
    """Stripe and GitHub take a bearer token; Postmark its own server-token header."""
    providers = load_providers()
    assert (providers["stripe"].key_header, providers["stripe"].key_format) == (
        "authorization",
        "Bearer {key}",
    )
    assert (providers["github"].key_header, providers["github"].key_format) == (
        "authorization",
        "Bearer {key}",
    )
    assert (providers["postmark"].key_header, providers["postmark"].key_format) == (
        "x-postmark-server-token",
        "{key}",
    )


# -- the fakes answer as the vendors document ---------------------------------------------


@pytest.fixture
def stripe(tmp_path: Path) -> Iterator[RunningFake]:
    with running_fake("stripe_like", tmp_path / "stripe.jsonl") as fake:
        yield fake


@pytest.mark.slow
def test_stripe_fake_takes_form_bodies_only(stripe: RunningFake) -> None:
    """Stripe documents form-encoded bodies: a JSON body is refused before any work."""
    auth = {"Authorization": "Bearer sk_test_x"}
    refused = httpx.post(stripe.url + "/v1/payment_intents", json={"amount": 1}, headers=auth)
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
    made = httpx.post(stripe.url + "/v1/payment_intents", data={"amount": "1"}, headers=auth)
    assert made.status_code == 200 and made.json()["object"] == "payment_intent"
    assert len(stripe.effects()) == 1


@pytest.mark.slow
def test_email_and_chat_fakes_refuse_bodies_as_their_vendors_do(tmp_path: Path) -> None:
    """Postmark: a non-JSON body is 415; GitHub: unparsable JSON is 400, a missing field 422."""
    with running_fake("email_like", tmp_path / "email.jsonl") as email:
        token = {"X-Postmark-Server-Token": "pm"}
        answer = httpx.post(email.url + "/email", data={"From": "a@example.com"}, headers=token)
        assert answer.status_code == 415
        assert email.effects() == []
    with running_fake("chat_like", tmp_path / "chat.jsonl") as chat:
        url, auth = chat.url + "/repos/o/r/issues/1/comments", {"Authorization": "Bearer gh"}
        bad_json = httpx.post(url, content=b"{", headers=auth)
        assert (bad_json.status_code, bad_json.json()["message"]) == (400, "Problems parsing JSON")
        no_body = httpx.post(url, json={"title": "x"}, headers=auth)
        assert (no_body.status_code, no_body.json()["message"]) == (422, "Validation Failed")
        assert chat.effects() == []


# -- a Stripe 503 through the proxy ---------------------------------------------------------


@pytest.fixture
def proxy(tmp_path: Path, stripe: RunningFake) -> Iterator[Proxy]:
    env = {"STRIPE_API_KEY": "sk_test_x"}
    with running_proxy(tmp_path / "ledger.db", upstreams={"stripe": stripe.url}, env=env) as p:
        yield p


@pytest.mark.slow
def test_stripe_503_is_unknown_and_a_keyed_resend_reaches_stripe(
    stripe: RunningFake, proxy: Proxy
) -> None:
    """A 503 proves nothing, so it is not booked as a failed call: the client's resend under
    the same Idempotency-Key goes to Stripe, which makes the PaymentIntent once."""
    url = proxy.url + "/stripe/v1/payment_intents"
    headers = {"Idempotency-Key": "order-17"}
    form = {"amount": "500", "currency": "usd"}
    first = httpx.post(url, data=form, headers={**headers, "x-fake-status": "503"}, timeout=30)
    assert first.status_code == 503
    assert stripe.effects() == []
    resent = httpx.post(url, data=form, headers=headers, timeout=30)
    assert resent.status_code == 200, resent.text
    assert resent.headers.get("effectguard-replayed") != "true"
    assert resent.json()["object"] == "payment_intent"
    (effect,) = stripe.effects()
    assert effect["op"] == resent.json()["metadata"]["effectguard_op"]


#: POSTs an agent makes besides the two creates: Stripe deduplicates every POST on its key.
STRIPE_ACTIONS = (
    "/v1/payment_intents/pi_1/confirm",
    "/v1/payment_intents/pi_1/capture",
    "/v1/payment_intents/pi_1/cancel",
    "/v1/customers",
    "/v1/charges",
    "/v1/checkout/sessions",
    "/v1/invoices/in_1/pay",
    "/v1/transfers",
    "/v1/payouts",
)


def test_stripe_posts_are_idempotent_and_its_reads_free() -> None:
    """Every declared Stripe POST is idempotent under Stripe's key for its 24 h; their GETs
    are reads; a DELETE stays at_most_once (a resent delete that did happen answers 404)."""
    stripe = load_providers()["stripe"]
    for path in STRIPE_ACTIONS:
        endpoint = stripe.effect_for("POST", path)
        assert endpoint.effect == "idempotent", path
        assert endpoint.idempotency is not None and endpoint.idempotency.window_seconds == 86400
    for path in ("/v1/customers/cus_1", "/v1/charges", "/v1/invoices/search", "/v1/payouts/po_1"):
        assert stripe.effect_for("GET", path).effect == "read_only", path
    assert stripe.effect_for("DELETE", "/v1/customers/cus_1").effect == "at_most_once"


@pytest.mark.slow
def test_an_unknown_stripe_action_is_resent_under_stripes_key(
    stripe: RunningFake, proxy: Proxy
) -> None:
    """stripe-python's way: a 503 on a confirm, a capture, a payout ... proves nothing; the
    keyed resend goes to Stripe (which deduplicates it) instead of waiting for a person
    (409 effect_unknown, as every undeclared Stripe POST did)."""
    for n, path in enumerate(STRIPE_ACTIONS):
        headers = {"Idempotency-Key": f"action-{n}"}
        url = proxy.url + "/stripe" + path
        first = httpx.post(url, data={"n": str(n)}, headers={**headers, "x-fake-status": "503"})
        assert first.status_code == 503, (path, first.text)
        resent = httpx.post(url, data={"n": str(n)}, headers=headers, timeout=30)
        assert resent.status_code == 200, (path, resent.text)
    assert [e["path"] for e in stripe.effects()] == [p for p in STRIPE_ACTIONS]


# -- a Postmark batch through the proxy -----------------------------------------------------


@pytest.mark.slow
def test_a_postmark_batch_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    """POST /email/batch takes a JSON array of up to 500 messages: effectguard guards only
    JSON objects, so the batch is refused 400 before anything is recorded or sent (never
    passed on as one call priced as one email, as the declaration's comment once said)."""
    with (
        running_fake("email_like", tmp_path / "email.jsonl") as email,
        running_proxy(tmp_path / "ledger.db", upstreams={"postmark": email.url}) as p,
    ):
        batch = [{"From": "a@example.com", "To": f"u{i}@example.com"} for i in range(500)]
        token = {"X-Postmark-Server-Token": "pm"}
        refused = httpx.post(p.url + "/postmark/email/batch", json=batch, headers=token)
        assert refused.status_code == 400, refused.text
        assert refused.json()["effectguard"]["type"] == "invalid_request"  # Postmark's shape
        assert email.effects() == []
        one = httpx.post(p.url + "/postmark/email", json=batch[0], headers=token)
        assert one.status_code == 200, one.text
        assert len(email.effects()) == 1


@pytest.mark.slow
def test_a_postmark_email_is_charged_per_recipient(tmp_path: Path) -> None:
    """Postmark counts each recipient (To, Cc and Bcc) as one email: an email to five is
    reserved and settled at five times the per-email price, and a budget with room for
    three refuses it before anything is sent. (Priced as one email, it was admitted.)"""
    ledger = tmp_path / "ledger.db"
    subprocess.run([sys.executable, "-m", "effectguard", "migrate", "--ledger", str(ledger)],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    _cli("budget", "set", "mail", "--limit", "0.0054", "--ledger", str(ledger))  # three emails
    with (
        running_fake("email_like", tmp_path / "email.jsonl") as email,
        running_proxy(ledger, upstreams={"postmark": email.url}) as p,
    ):
        headers = {"X-Postmark-Server-Token": "pm", "Effectguard-Budget": "mail"}
        five = {
            "From": "a@example.com",
            "To": "b@example.com, c@example.com",
            "Cc": "d@example.com",
            "Bcc": "e@example.com,f@example.com",
        }
        refused = httpx.post(p.url + "/postmark/email", json=five, headers=headers)
        assert refused.status_code == 402, refused.text
        assert email.effects() == []
        two = {"From": "a@example.com", "To": "b@example.com", "Cc": "c@example.com"}
        sent = httpx.post(p.url + "/postmark/email", json=two, headers=headers)
        assert sent.status_code == 200, sent.text
        assert len(email.effects()) == 1
    (call,) = [c for c in _cli("calls", "--ledger", str(ledger)) if c["stage"] == "completed"]
    assert (call["reserved_usd"], call["cost_usd"]) == ("0.003600000", "0.003600000")
    (node,) = [b for b in _cli("budgets", "--ledger", str(ledger)) if b["path"] == "mail"]
    assert node["spent_usd"] == "0.003600000"


@pytest.mark.slow
def test_every_postmark_send_is_charged_per_recipient(tmp_path: Path) -> None:
    """However a Postmark send names its recipients, each is reserved before anything is
    sent: ``to`` in another case, a template send, and a batch of template sends (each
    message's recipients). Each was priced as one email, so a budget with room for three
    emails admitted five, or 500 messages at once."""
    ledger = tmp_path / "ledger.db"
    subprocess.run([sys.executable, "-m", "effectguard", "migrate", "--ledger", str(ledger)],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    _cli("budget", "set", "mail", "--limit", "0.0054", "--ledger", str(ledger))  # three emails
    five = "b@example.com, c@example.com, d@example.com, e@example.com, f@example.com"
    template = {"From": "a@example.com", "TemplateAlias": "welcome", "TemplateModel": {}}
    over = [
        ("/email", {"From": "a@example.com", "to": five}),
        ("/email", {"From": "a@example.com", "To": "b@example.com", "BCC": five}),
        ("/email/withTemplate", {**template, "To": five}),
        (
            "/email/batchWithTemplates",
            {"Messages": [{**template, "To": "b@example.com, c@example.com"}] * 2},
        ),
    ]
    with (
        running_fake("email_like", tmp_path / "email.jsonl") as email,
        running_proxy(ledger, upstreams={"postmark": email.url}) as p,
    ):
        headers = {"X-Postmark-Server-Token": "pm", "Effectguard-Budget": "mail"}
        for path, body in over:
            refused = httpx.post(p.url + "/postmark" + path, json=body, headers=headers)
            assert refused.status_code == 402, (path, body, refused.text)
        odd = {"Messages": {"To": "b@example.com"}}
        bad = httpx.post(p.url + "/postmark/email/batchWithTemplates", json=odd, headers=headers)
        assert bad.status_code == 400, bad.text
        assert email.effects() == []
        two = {**template, "To": "b@example.com", "cc": "c@example.com"}
        sent = httpx.post(p.url + "/postmark/email/withTemplate", json=two, headers=headers)
        assert sent.status_code == 200, sent.text
        assert len(email.effects()) == 1
    (call,) = [c for c in _cli("calls", "--ledger", str(ledger)) if c["stage"] == "completed"]
    assert (call["reserved_usd"], call["cost_usd"]) == ("0.003600000", "0.003600000")
