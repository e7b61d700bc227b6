"""Rate limits (issue #15): the minute window (pure) and rpm, tpm and concurrency on every
store (memory, SQLite, PostgreSQL), checked inside the admission transaction.

Tests that need a minute to stay put move the ledger's clock to a second into one
(:class:`clockkit.LedgerTime`: the manual clock, or the database's on PostgreSQL, each
test in a schema of its own), which leaves them 59 seconds before the next. Every
ledger is verified by the independent verifier when its test ends.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from clockkit import LedgerTime
from hypothesis import given
from hypothesis import strategies as st
from test_store_contract import (
    R,
    admit_ok,
    clock,
    completion,
    ledger,
    ledger_url,
    ns,
    register,
    req,
    store_kind,
)

from effectguard import AsyncGuardTransport, GuardTransport
from effectguard.ledger import Ledger, Writer
from effectguard.ops.cli import main as cli_main
from effectguard.rules import ratelimit
from effectguard.rules.budget import BudgetPolicy
from effectguard.rules.ratelimit import RateWindow, check, minute_of
from effectguard.testing.clock import ManualClock

_ = (clock, ledger, ledger_url, ns, store_kind)  # fixtures


@pytest.fixture
async def w1(ledger: Ledger, ns: str) -> Writer:
    """A live worker whose lease outlasts the clock moves in these tests."""
    return await register(ledger, f"{ns}-w1", lease_s=10**6)


@pytest.fixture
def into_a_minute(clock: ManualClock | None, ledger_url: str) -> LedgerTime:
    """The ledger's clock moved to one second into the next minute (the manual clock, or
    the database's), so that 59 seconds pass before the test's minute turns."""
    moves = LedgerTime(clock) if clock is not None else LedgerTime(None, ledger_url)
    now = clock() if clock is not None else _database_now(ledger_url)
    moves.set(now - now % 60 + 60 + 1)
    return moves


def _database_now(url: str) -> float:
    from effectguard.testing.pgclock import ledger_clock

    return ledger_clock(url)


# -- the window (pure) -------------------------------------------------------------------


def never_in_flight(path: str) -> int:
    """No call is in flight."""
    return 0


def _first() -> int:
    """A reservation's ledger position: the first event (asked only of a window started
    mid-minute)."""
    return 1


def test_the_window_is_the_calendar_minute() -> None:
    """12:00:59.999 and 12:01:00 are in different windows; a new minute starts empty."""
    assert minute_of(3600 * 12 + 59.999) + 1 == minute_of(3600 * 12 + 60)
    full = RateWindow("a", minute_of(60.0), requests=5, tokens=9)
    assert full.at(minute_of(119.9)) == full
    assert full.at(minute_of(120.0)) == RateWindow("a", 2)


def test_rpm_refuses_the_next_request_until_the_next_minute() -> None:
    """With rpm 2 and two admitted this minute, a third is refused with the seconds left."""
    policies = {"a": BudgetPolicy("a", rpm=2)}
    window = RateWindow("a")
    for now in (600.0, 600.5):
        assert check(policies, {"a": window}, never_in_flight, "a", now, 0) is None
        window = ratelimit.admitted(window, now, 0, 1)
    refused = check(policies, {"a": window}, never_in_flight, "a", 615.2, 0)
    assert refused == ratelimit.RateExceeded("a", "rpm", 2, 45)
    assert check(policies, {"a": window}, never_in_flight, "a", 660.0, 0) is None


def test_tpm_counts_the_estimate_and_corrects_it_at_settlement() -> None:
    """An estimate of 800 tokens fills a tpm of 1000 for a 300-token request; settling at
    100 tokens frees the difference in the same minute, not in a later one."""
    policies = {"a": BudgetPolicy("a", tpm=1000)}
    window = ratelimit.admitted(RateWindow("a"), 600.0, 800, 1)
    assert check(policies, {"a": window}, never_in_flight, "a", 601.0, 300) is not None
    settled = ratelimit.corrected(window, 600.0, 800, 100, _first)
    assert settled.tokens == 100
    assert check(policies, {"a": settled}, never_in_flight, "a", 601.0, 300) is None
    later = ratelimit.admitted(window, 660.0, 10, 2)
    assert ratelimit.corrected(later, 600.0, 800, 100, _first) == later


def test_concurrency_counts_calls_in_flight_and_ancestors_are_checked() -> None:
    """A parent's concurrency limit refuses a child's call; retry-after is one second."""
    policies = {"a": BudgetPolicy("a", concurrency=2), "a/b": BudgetPolicy("a/b", rpm=100)}
    in_flight = {"a": 2, "a/b": 0}
    refused = check(policies, {}, in_flight.__getitem__, "a/b", 0.0, 0)
    assert refused == ratelimit.RateExceeded("a", "concurrency", 2, 1)


@pytest.mark.parametrize(
    ("policy", "tokens", "limit", "allowed"),
    [
        (BudgetPolicy("a", rpm=0), 0, "rpm", 0),
        (BudgetPolicy("a", tpm=100), 101, "tpm", 100),
        (BudgetPolicy("a", concurrency=0), 0, "concurrency", 0),
    ],
)
def test_an_attempt_no_wait_lets_fit_waits_a_minute_for_an_operator(
    policy: BudgetPolicy, tokens: int, limit: ratelimit.Limit, allowed: int
) -> None:
    """A limit of 0, or a tpm below the attempt's own tokens: the attempt does not fit until
    an operator raises the limit; retry-after is a minute, wherever in the minute it is."""
    refused = check({"a": policy}, {}, never_in_flight, "a", 615.2, tokens)
    assert refused == ratelimit.RateExceeded("a", limit, allowed, 60, fits=False)


@given(
    times=st.lists(st.floats(0, 600, allow_nan=False), min_size=1, max_size=80),
    rpm=st.integers(0, 10),
)
def test_no_minute_admits_more_than_rpm(times: list[float], rpm: int) -> None:
    """Whatever the arrival times, each calendar minute admits exactly min(rpm, arrivals)."""
    policies = {"a": BudgetPolicy("a", rpm=rpm)}
    window = RateWindow("a")
    admitted: Counter[int] = Counter()
    arrivals: Counter[int] = Counter()
    for now in sorted(times):
        arrivals[minute_of(now)] += 1
        if check(policies, {"a": window}, never_in_flight, "a", now, 0) is None:
            window = ratelimit.admitted(window, now, 0, 1)
            admitted[minute_of(now)] += 1
    assert all(admitted[m] == min(rpm, arrivals[m]) for m in arrivals)


# -- on every store ---------------------------------------------------------------------------


async def refused_429(ledger: Ledger, writer: Writer, ns: str, **kw: object) -> int:
    """Admit one request that must be refused 429 ``rate_limited``; its retry-after."""
    result = await ledger.admit(writer, req(ns, **kw))  # type: ignore[arg-type]
    assert result.action == "refuse" and result.refusal is not None
    assert (result.refusal.status, result.refusal.type) == (429, "rate_limited")
    assert result.refusal.retryable and result.refusal.retry_after is not None
    return result.refusal.retry_after


async def test_rpm_refuses_without_reserving_and_frees_the_key(
    ledger: Ledger, w1: Writer, ns: str, into_a_minute: LedgerTime
) -> None:
    """The fourth request of a minute under rpm 3 is refused 429 with retry-after; nothing is
    reserved; its idempotency key stays free and is admitted in the next minute."""
    await ledger.set_policy(BudgetPolicy(ns, rpm=3))
    for _ in range(3):
        await admit_ok(ledger, w1, req(ns))
    fourth = await ledger.admit(w1, req(ns, key="k1"))
    assert fourth.refusal is not None
    assert (fourth.refusal.status, fourth.refusal.type) == (429, "rate_limited")
    assert fourth.refusal.retryable and fourth.refusal.retry_after is not None
    assert 1 <= fourth.refusal.retry_after <= 60
    nodes = {n.path: n for n in await ledger.budgets()}
    assert nodes[ns].reserved == 3 * R
    into_a_minute.advance(fourth.refusal.retry_after)
    await admit_ok(ledger, w1, req(ns, key="k1"))


async def test_tpm_counts_the_estimate_until_settlement_corrects_it(
    ledger: Ledger, w1: Writer, ns: str, into_a_minute: LedgerTime
) -> None:
    """tpm 1000: a call estimated at 800 tokens leaves no room for 300 more until it
    settles at its reported 30 tokens (the fake usage), in the same minute."""
    await ledger.set_policy(BudgetPolicy(ns, tpm=1000))
    big = await admit_ok(ledger, w1, req(ns, tokens=800))
    await refused_429(ledger, w1, ns, tokens=300)
    events = completion(big.call_id, f"{ns}/run", 500)
    events[1] = _with_tokens(events[1], 30)
    await ledger.record(w1, big.call_id, 1, events)
    await admit_ok(ledger, w1, req(ns, tokens=300))


async def test_concurrency_counts_calls_in_flight(ledger: Ledger, w1: Writer, ns: str) -> None:
    """Concurrency 2: a third call is refused while two are in flight, admitted when one ends."""
    await ledger.set_policy(BudgetPolicy(ns, concurrency=2))
    first = await admit_ok(ledger, w1, req(ns))
    await admit_ok(ledger, w1, req(ns, budget=f"{ns}/other"))
    retry_after = await refused_429(ledger, w1, ns)
    assert retry_after == 1
    await ledger.record(w1, first.call_id, 1, completion(first.call_id, f"{ns}/run", 500))
    await admit_ok(ledger, w1, req(ns))


async def test_concurrent_admissions_admit_exactly_rpm_per_minute(
    ledger: Ledger, w1: Writer, ns: str
) -> None:
    """200 concurrent admissions against rpm 37: in each minute the ledger's clock saw,
    exactly min(37, arrivals) were admitted and the rest refused 429 (no timing assumed)."""
    await ledger.set_policy(BudgetPolicy(ns, rpm=37))
    results = await asyncio.gather(*(ledger.admit(w1, req(ns)) for _ in range(200)))
    assert {r.action for r in results} <= {"admit", "refuse"}
    assert all(r.refusal.status == 429 for r in results if r.refusal is not None)
    admitted: Counter[int] = Counter()
    arrivals: Counter[int] = Counter()
    for r in results:
        (manifest,) = [e for e in await ledger.events(r.call_id) if e.kind == "call.manifest"]
        arrivals[minute_of(manifest.at)] += 1
        admitted[minute_of(manifest.at)] += r.action == "admit"
    assert all(admitted[m] == min(37, arrivals[m]) for m in arrivals), (admitted, arrivals)


async def _reserved_at(ledger: Ledger, call_id: str) -> float:
    events = await ledger.events(call_id)
    return next(e.at for e in events if e.kind == "budget.reserved")


def _with_tokens(event: object, tokens: int) -> object:
    import dataclasses

    return dataclasses.replace(event, tokens=tokens)  # type: ignore[type-var]


CHAT_URL = "https://api.openai.com/v1/chat/completions"


def _responses(
    tmp_path: Path, limits: list[str], calls: int, *, sync: bool = False
) -> list[httpx.Response]:
    """``calls`` requests through the in-process transport (the async one, or the sync one)
    to budget ``team`` after ``budget set team LIMITS`` (the upstream answers 200; nothing
    past a refusal matters)."""
    ledger = str(tmp_path / "l.db")
    assert cli_main(["migrate", "--ledger", ledger]) == 0
    assert cli_main(["budget", "set", "team", *limits, "--ledger", ledger]) == 0
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    answer = b'{"id": "c", "object": "chat.completion", "model": "gpt-4o-mini", "choices": []}'

    def reply(request: httpx.Request) -> httpx.Response:
        # A stream, as a network answer is (a Response built from bytes reads as consumed).
        return httpx.Response(
            200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(answer)
        )

    async def send() -> list[httpx.Response]:
        upstream = httpx.MockTransport(reply)
        transport = AsyncGuardTransport(upstream, ledger=ledger)
        async with httpx.AsyncClient(transport=transport) as client:
            return [
                await client.post(CHAT_URL, json=body, headers={"Effectguard-Budget": "team"})
                for _ in range(calls)
            ]

    if sync:
        with httpx.Client(
            transport=GuardTransport(httpx.MockTransport(reply), ledger=ledger)
        ) as client:
            return [
                client.post(CHAT_URL, json=body, headers={"Effectguard-Budget": "team"})
                for _ in range(calls)
            ]
    return asyncio.run(send())


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize(
    "limits", [["--rpm", "0"], ["--tpm", "0"], ["--tpm", "5"], ["--concurrency", "0"]]
)
def test_a_limit_the_request_does_not_fit_is_refused_as_any_rate_limit(
    tmp_path: Path, limits: list[str], sync: bool
) -> None:
    """rpm or concurrency 0, or a tpm below the request's own tokens, admits it only once
    an operator raises the limit (``budget set``, read at every admission): SPEC's 429
    ``rate_limited`` with ``retry-after`` (60, a minute for the operator) and
    ``x-should-retry: true``, the message saying the limit must be raised. The SDKs retry a
    bounded number of times (``max_retries``), so they do not retry forever."""
    (refused,) = _responses(tmp_path, limits, 1, sync=sync)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "rate_limited"
    assert refused.headers["x-should-retry"] == "true"
    assert refused.headers["retry-after"] == "60"
    message = refused.json()["error"]["message"]
    assert "does not fit" in message and "an operator must raise" in message, message


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_a_full_minute_is_worth_retrying(tmp_path: Path, sync: bool) -> None:
    """rpm 1, second request: 429 with x-should-retry true and retry-after (the window
    turns)."""
    _, refused = _responses(tmp_path, ["--rpm", "1"], 2, sync=sync)
    assert refused.status_code == 429, refused.text
    assert refused.headers["x-should-retry"] == "true"
    assert 1 <= int(refused.headers["retry-after"]) <= 60


@pytest.mark.slow
def test_an_automatic_retry_past_rpm_is_refused_rate_limited(tmp_path: Path) -> None:
    """rpm 2 and a provider answering 429 (a retry status): two attempts reach it, the
    third automatic attempt is refused 429 ``rate_limited`` with the call id and
    ``retry-after``; the call is ``not_processed``, so a resend of its key is sent once the
    limit allows (contract §3.5, §9)."""
    from effectguard.testing import fake_provider, running_proxy

    ledger = str(tmp_path / "l.db")
    assert cli_main(["migrate", "--ledger", ledger]) == 0
    assert cli_main(["budget", "set", "team", "--rpm", "2", "--ledger", ledger]) == 0
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Effectguard-Budget": "team", "Idempotency-Key": "retried"}
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        with running_proxy(ledger, upstreams={"openai": provider.url}) as proxy:
            url = proxy.url + "/openai/v1/chat/completions"
            while time.time() % 60 > 50:  # the attempts must fall in one minute
                time.sleep(0.5)
            refused = httpx.post(url, json=body, headers={**headers, "x-fake-status": "429"})
            assert cli_main(["budget", "set", "team", "--rpm", "none", "--ledger", ledger]) == 0
            resent = httpx.post(url, json=body, headers=headers)
        statuses = [r["status"] for r in provider.receipts()]
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "rate_limited"
    assert refused.headers["x-should-retry"] == "true"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert resent.status_code == 200, resent.text
    assert resent.headers["effectguard-call-id"] == refused.headers["effectguard-call-id"]
    assert statuses == [429, 429, 200]
