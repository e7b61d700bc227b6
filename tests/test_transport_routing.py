"""The in-process transport guards a request for a declared provider however its URL
spells the provider's host: with credentials in the URL (``https://sk_test_...:@host``,
Stripe's key as the HTTP Basic user name) or with the host's trailing root dot
(``api.stripe.com.``, the same host to DNS). Either way the URL did not begin with the
declared base URL, and the transport passed the request on untouched: a payment made
with no manifest, no reservation and no deduplication."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fakes import running_fake

from effectguard import GuardTransport


class ToTheFake(httpx.BaseTransport):
    """The network, as far as this test goes: every request reaches the fake Stripe,
    whatever host its URL names (``api.stripe.com.`` resolves nowhere here)."""

    def __init__(self, url: str) -> None:
        self.fake = httpx.URL(url)
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(
            scheme=self.fake.scheme, userinfo=b"", host=self.fake.host, port=self.fake.port
        )
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "base",
    [
        "https://sk_test_1:@api.stripe.com",  # the key as the Basic user name
        "https://api.stripe.com.",  # a fully qualified host: the root's dot at the end
        "https://sk_test_1:@API.Stripe.com.:443",
    ],
)
def test_a_provider_url_spelled_otherwise_is_still_guarded(tmp_path: Path, base: str) -> None:
    with running_fake("stripe_like", tmp_path / "stripe.jsonl") as stripe:
        transport = GuardTransport(ToTheFake(stripe.url), ledger=str(tmp_path / "ledger.db"))
        with httpx.Client(transport=transport) as client:
            headers = {"Idempotency-Key": "order-1"}
            if "@" not in base:
                headers["Authorization"] = "Bearer sk_test_1"
            answers = [
                client.post(base + "/v1/payment_intents", data={"amount": "100"}, headers=headers)
                for _ in range(2)
            ]
        assert [a.status_code for a in answers] == [200, 200], answers[0].text
        assert all("effectguard-call-id" in a.headers for a in answers), answers[0].headers
        assert answers[1].headers.get("effectguard-replayed") == "true"
        assert len(stripe.effects()) == 1  # the repeat was answered from the ledger
