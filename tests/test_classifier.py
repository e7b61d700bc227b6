"""Transport-error classification (docs/contract.md §3.4), table-driven and without a network.

Whether an error proves the request never left decides between a safe retry and a held,
effect-unknown call, so every row here is a duplicate effect prevented (or a needless
hold avoided). Errors are built the way the two upstream legs raise them: plain httpx,
and httpx-aiohttp, which maps aiohttp's exception to an httpx one ``from`` the original.
"""

from __future__ import annotations

import aiohttp
import httpx
import pytest
from aiohttp.client_reqrep import ConnectionKey

from effectguard.callpath.wire import classify_transport_error, timed_out

_KEY = ConnectionKey("api.test", 443, True, True, None, None, None)

HTTPX_ERRORS = [
    (httpx.ConnectError("refused"), "not_sent", False),
    (httpx.ConnectTimeout("slow connect"), "not_sent", True),
    (httpx.PoolTimeout("no connection free"), "not_sent", True),
    (httpx.ReadTimeout("slow answer"), "unknown", True),
    (httpx.WriteTimeout("slow upload"), "unknown", True),
    (httpx.ReadError("reset"), "unknown", False),
    (httpx.WriteError("broken pipe"), "unknown", False),
    (httpx.RemoteProtocolError("peer closed"), "unknown", False),
    (httpx.CloseError("close failed"), "unknown", False),
    (httpx.ProxyError("proxy said no"), "unknown", False),
    (httpx.UnsupportedProtocol("gopher"), "unknown", False),
]


@pytest.mark.parametrize(("error", "outcome", "timeout"), HTTPX_ERRORS)
def test_httpx_errors_are_not_sent_only_when_no_connection_opened(
    error: httpx.TransportError, outcome: str, timeout: bool
) -> None:
    """Only connect errors, connect timeouts and pool timeouts prove nothing was sent."""
    assert classify_transport_error(error) == outcome
    assert timed_out(error) is timeout


def _mapped(cause: BaseException, as_: type[httpx.TransportError]) -> httpx.TransportError:
    """``cause`` as httpx-aiohttp raises it: an httpx error raised from the aiohttp one."""
    try:
        raise as_(str(cause)) from cause
    except httpx.TransportError as exc:
        return exc


AIOHTTP_ERRORS = [
    # The upstream read the request, then hung up: mapped to ConnectTimeout, yet sent.
    (aiohttp.ServerDisconnectedError(), httpx.ConnectTimeout, "unknown", False),
    (aiohttp.ClientOSError(104, "reset by peer"), httpx.ConnectTimeout, "unknown", False),
    (aiohttp.ClientPayloadError("cut"), httpx.ReadError, "unknown", False),
    (aiohttp.ServerTimeoutError("read timeout"), httpx.ReadTimeout, "unknown", True),
    (aiohttp.ClientConnectionError("closed"), httpx.ConnectTimeout, "unknown", False),
    # The connection never opened.
    (
        aiohttp.ClientConnectorError(_KEY, ConnectionRefusedError(111, "refused")),
        httpx.ConnectError,
        "not_sent",
        False,
    ),
    (aiohttp.ConnectionTimeoutError("connect timeout"), httpx.ConnectTimeout, "not_sent", True),
]


@pytest.mark.parametrize(("cause", "mapped", "outcome", "timeout"), AIOHTTP_ERRORS)
def test_aiohttp_errors_are_judged_by_the_original_exception(
    cause: BaseException, mapped: type[httpx.TransportError], outcome: str, timeout: bool
) -> None:
    """httpx-aiohttp's mapping is not trusted: aiohttp's own exception decides."""
    error = _mapped(cause, mapped)
    assert classify_transport_error(error) == outcome
    assert timed_out(error) is timeout


def test_a_non_aiohttp_cause_does_not_override_the_httpx_class() -> None:
    """A cause from elsewhere (an OSError) leaves the decision to the httpx error's class."""
    refused = _mapped(ConnectionRefusedError(111, "refused"), httpx.ConnectError)
    assert classify_transport_error(refused) == "not_sent"
    reset = _mapped(ConnectionResetError(104, "reset"), httpx.ReadError)
    assert classify_transport_error(reset) == "unknown"
    slow = _mapped(TimeoutError(), httpx.ReadTimeout)
    assert (classify_transport_error(slow), timed_out(slow)) == ("unknown", True)
    # The httpx class decides whether time ran out, whatever non-aiohttp cause it carries.
    assert timed_out(_mapped(ConnectionResetError(104, "reset"), httpx.ReadTimeout)) is True
    assert timed_out(_mapped(TimeoutError(), httpx.ConnectError)) is False


def test_the_deliberately_broken_build_books_a_disconnect_as_not_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EFFECTGUARD_TEST_BREAK (the simulator's known-wrong build) flips exactly this row."""
    disconnect = _mapped(aiohttp.ServerDisconnectedError(), httpx.ConnectTimeout)
    monkeypatch.setenv("EFFECTGUARD_TEST_BREAK", "classify_disconnect_as_not_sent")
    assert classify_transport_error(disconnect) == "not_sent"
    assert classify_transport_error(httpx.ReadError("reset")) == "unknown"
    monkeypatch.delenv("EFFECTGUARD_TEST_BREAK")
    assert classify_transport_error(disconnect) == "unknown"
