"""Shared fixtures: guarded transports on a SQLite ledger in ``tmp_path``."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio

from effectguard import AsyncGuardTransport, GuardSettings
from effectguard.ops.verify import verify_ledger

#: Retries without waiting, so tenacity paths stay fast.
FAST = GuardSettings(retry_wait_s=0, retry_wait_max_s=0)


@pytest.fixture
def ledger_path(tmp_path: Any) -> str:
    """A fresh SQLite ledger file for one test."""
    return str(tmp_path / "l.db")


@pytest.fixture
def fast_settings() -> GuardSettings:
    """Guard settings whose automatic retries do not sleep."""
    return FAST


@pytest_asyncio.fixture
async def make_transport(
    ledger_path: str,
) -> AsyncIterator[Callable[..., AsyncGuardTransport]]:
    """Build ``AsyncGuardTransport``s on the test's ledger; any left open are closed after."""
    made: list[AsyncGuardTransport] = []

    def make(**kwargs: Any) -> AsyncGuardTransport:
        kwargs.setdefault("ledger", ledger_path)
        kwargs.setdefault("settings", FAST)
        transport = AsyncGuardTransport(**kwargs)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        await transport.aclose()  # idempotent: a no-op for a transport the test closed


@pytest.fixture
def finish() -> Callable[[AsyncGuardTransport], Awaitable[None]]:
    """Check the ledger verifies (hash chain, counters, projections), then close."""

    async def done(transport: AsyncGuardTransport) -> None:
        report = await verify_ledger(transport.ledger)
        assert report.ok, report.problems
        await transport.aclose()

    return done


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt during the test, whatever handler an earlier test
    left behind: the Ctrl-C tests failed in a full CI run (a SIGINT that raised nothing)
    and never alone."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
