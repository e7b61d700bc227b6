"""A provider's own listener (``serve --provider-port NAME=PORT``, ``[server]
provider_ports``): every path on that port goes to that provider, with no ``/NAME/``
prefix, for an SDK that drops a base URL's path.

postmarker joins its root URL and ``"/email"`` with ``urljoin``, which drops the root's
path: pointed at ``/postmark/`` it reached ``/email`` and was refused 404, and the docs
told its users to override a private method. Through real processes: the proxy, the
Postmark-like fake (its receipts count the emails) and the real postmarker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fakes import RunningFake, running_fake
from stagedkit import serve_refusing

from effectguard.testing import Proxy, free_port, running_proxy

pytestmark = pytest.mark.slow

EMAIL = {"From": "a@example.com", "To": "b@example.com", "Subject": "s", "TextBody": "t"}
TOKEN = {"X-Postmark-Server-Token": "pm"}


@pytest.fixture
def routed(tmp_path: Path) -> Iterator[tuple[Proxy, str, RunningFake]]:
    """The proxy with postmark on a port of its own, that port's URL, and the fake."""
    port = free_port()
    with (
        running_fake("email_like", tmp_path / "email.jsonl") as email,
        running_proxy(
            tmp_path / "ledger.db",
            upstreams={"postmark": email.url},
            args=["--provider-port", f"postmark={port}"],
        ) as proxy,
    ):
        yield proxy, f"http://127.0.0.1:{port}", email


def test_postmarker_sends_through_the_providers_own_port(
    routed: tuple[Proxy, str, RunningFake],
) -> None:
    """The real postmarker, given the port's URL as ``root_api_url`` and nothing else,
    sends an email through the guard: one receipt carrying the call's operation id."""
    core = pytest.importorskip("postmarker.core")
    proxy, url, email = routed
    sent = core.PostmarkClient(server_token="pm", root_api_url=url).emails.send(**EMAIL)
    assert sent["ErrorCode"] == 0, sent
    (effect,) = email.effects()
    assert effect["op"].startswith("call_")
    assert f"postmark at {url}" in proxy.log()


def test_the_port_takes_every_path_and_the_prefixed_route_still_works(
    routed: tuple[Proxy, str, RunningFake],
) -> None:
    """On the provider's port, ``/healthz`` and the operator page's path are the
    provider's too; a path that climbs out of its base is refused there as anywhere,
    nothing sent; the proxy's own port still routes ``/postmark/email``."""
    proxy, url, email = routed
    direct = httpx.post(url + "/email", json=EMAIL, headers=TOKEN, timeout=30)
    assert direct.status_code == 200, direct.text
    assert direct.headers["effectguard-call-id"].startswith("call_")
    climbing = httpx.post(url + "/%2e%2e/email", json=EMAIL, headers=TOKEN, timeout=30)
    assert climbing.status_code == 400, climbing.text
    assert "ErrorCode" in climbing.json()  # postmark's error shape: the provider is known
    health = httpx.get(url + "/healthz", headers=TOKEN, timeout=30)
    assert "effectguard-call-id" in health.headers  # the provider's, not the proxy's
    assert health.json() != {"ledger": "writable"}
    prefixed = httpx.post(proxy.url + "/postmark/email", json=EMAIL, headers=TOKEN, timeout=30)
    assert prefixed.status_code == 200, prefixed.text
    assert httpx.get(proxy.url + "/healthz", timeout=30).json() == {"ledger": "writable"}
    assert len(email.effects()) == 2


@pytest.mark.parametrize(
    ("flag", "said"),
    [
        ("nosuch=0", "no provider named 'nosuch'"),
        ("postmark=99999", "--provider-port takes NAME=PORT"),
        ("postmark", "--provider-port takes NAME=PORT"),
        ("postmark=PROXY", "is the proxy's port"),
    ],
)
def test_a_provider_port_that_cannot_work_is_refused_before_anything_starts(
    tmp_path: Path, flag: str, said: str
) -> None:
    """An undeclared provider, a port that is no port, or the proxy's own port: exit 2,
    one line, no ledger made."""
    port = free_port()
    done = serve_refusing(
        "--ledger",
        str(tmp_path / "ledger.db"),
        "--port",
        str(port),
        "--provider-port",
        flag.replace("PROXY", str(port)),
    )
    assert done.code == 2, done
    assert said in done.err, done.err
    assert not (tmp_path / "ledger.db").exists()
