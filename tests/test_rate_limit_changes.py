"""Rate limits declared while calls are in flight (docs/contract.md §5.6).

A window counts the attempts admitted while its node declares ``rpm`` or ``tpm``. When a
node gains them, its window starts afresh at that declaration and records where
(``since``), so a settlement corrects a window only if the window counted its attempt: a
call admitted before the declaration, in flight across it, gives back nothing when it
settles, in that minute or the next. (Releases before writer format 2 corrected such a
window anyway, taking the call's estimate off tokens the window had counted for others.)

Every test runs on each store, and its ledger is verified when it ends; each also checks
that verify judges the window it left: the window the earlier rule would have left is
named as not the events' fold.
"""

from __future__ import annotations

import dataclasses

from clockkit import LedgerTime
from test_rate_limits import _with_tokens, completion, into_a_minute, refused_429, w1
from test_store_contract import admit_ok, clock, ledger, ledger_url, ns, req, store_kind

from effectguard.ledger import OPERATOR, Ledger, Writer
from effectguard.ops.verify import verify_ledger
from effectguard.rules.ratelimit import RateWindow, minute_of

_ = (clock, ledger, ledger_url, ns, store_kind, into_a_minute, w1)  # fixtures


async def _settle(ledger: Ledger, w1: Writer, ns: str, call_id: str, tokens: int) -> None:
    """Complete ``call_id``'s first attempt; its settlement reports ``tokens``."""
    events = completion(call_id, f"{ns}/run", 500)
    events[1] = _with_tokens(events[1], tokens)
    await ledger.record(w1, call_id, 1, events)


async def _window(ledger: Ledger, path: str) -> RateWindow:
    """The stored rate window of ``path``."""
    found = [w for w in await ledger.store.rate_windows() if w.path == path]
    assert len(found) == 1, found
    return found[0]


async def _verify_judges(ledger: Ledger, earlier: RateWindow) -> None:
    """Verify agrees with the stored window, and names ``earlier`` (what the rule before
    writer format 2 left) as not the events' fold; the stored window is then put back."""
    report = await verify_ledger(ledger)
    assert report.ok, report.problems
    kept = await _window(ledger, earlier.path)
    assert earlier != kept
    await ledger.store.write(OPERATOR, lambda tx: tx.put_window(earlier))
    report = await verify_ledger(ledger)
    assert [p.split(": stored")[0] for p in report.problems] == [f"rate window {earlier.path!r}"], (
        report.problems
    )
    await ledger.store.write(OPERATOR, lambda tx: tx.put_window(kept))


async def test_a_call_admitted_before_a_tpm_limit_never_frees_another_calls_tokens(
    ledger: Ledger, w1: Writer, ns: str, into_a_minute: LedgerTime
) -> None:
    """A call admitted before ``tpm`` was declared was never counted in the window, so its
    settlement in the same minute gives back nothing: the estimate of a call admitted
    under the limit still counts, and a third call that would pass the limit is refused."""
    before = await admit_ok(ledger, w1, req(ns, tokens=800))
    await ledger.change_policy(ns, {"tpm": 1000})
    await admit_ok(ledger, w1, req(ns, tokens=800))
    await _settle(ledger, w1, ns, before.call_id, 30)
    await refused_429(ledger, w1, ns, tokens=300)
    window = await _window(ledger, ns)
    assert (window.requests, window.tokens) == (1, 800) and window.since
    await _verify_judges(ledger, dataclasses.replace(window, tokens=30, since=0))


async def test_rpm_declared_mid_minute_counts_requests_from_the_declaration_and_keeps_tokens(
    ledger: Ledger, w1: Writer, ns: str, into_a_minute: LedgerTime
) -> None:
    """``rpm`` declared mid-minute counts the attempts admitted after it (a call already in
    flight is not one of them, and its settlement changes no count), and the window keeps
    their tokens exactly: a ``tpm`` added later in the minute sees the estimate of the
    call counted under ``rpm``, not that estimate less the earlier call's."""
    before = await admit_ok(ledger, w1, req(ns, tokens=800))
    await ledger.change_policy(ns, {"rpm": 2})
    await admit_ok(ledger, w1, req(ns, tokens=800))
    await _settle(ledger, w1, ns, before.call_id, 30)
    window = await _window(ledger, ns)
    assert (window.requests, window.tokens) == (1, 800)
    await ledger.change_policy(ns, {"tpm": 1000})  # not a start: the node had rpm
    await refused_429(ledger, w1, ns, tokens=300)
    await admit_ok(ledger, w1, req(ns, tokens=200))
    await refused_429(ledger, w1, ns, tokens=1)  # rpm 2: the call in flight never counted
    assert await _window(ledger, ns) == dataclasses.replace(window, requests=2, tokens=1000)
    await _verify_judges(ledger, dataclasses.replace(window, requests=2, tokens=230, since=0))


async def test_a_limit_removed_and_declared_again_in_a_minute_starts_a_new_window(
    ledger: Ledger, w1: Writer, ns: str, into_a_minute: LedgerTime
) -> None:
    """Removing a node's rate limits ends its window; declaring them again in the same
    minute starts a new one that counts from there: neither the call counted before the
    removal nor the one admitted while the node had no limit counts in it, nor does
    either settlement take anything off it."""
    await ledger.change_policy(ns, {"tpm": 1000})
    counted = await admit_ok(ledger, w1, req(ns, tokens=800))
    await ledger.change_policy(ns, {"tpm": None})
    unlimited = await admit_ok(ledger, w1, req(ns, tokens=800))
    await ledger.change_policy(ns, {"tpm": 1000})
    await admit_ok(ledger, w1, req(ns, tokens=700))
    await _settle(ledger, w1, ns, counted.call_id, 30)
    await _settle(ledger, w1, ns, unlimited.call_id, 30)
    await refused_429(ledger, w1, ns, tokens=400)
    window = await _window(ledger, ns)
    assert (window.requests, window.tokens) == (1, 700) and window.since
    # The earlier rule kept counting the old window: 800 + 700, less both corrections.
    await _verify_judges(ledger, dataclasses.replace(window, requests=2, tokens=0, since=0))


async def test_a_settlement_in_the_next_minute_corrects_only_the_calls_the_window_counted(
    ledger: Ledger, w1: Writer, ns: str, into_a_minute: LedgerTime
) -> None:
    """In the next minute, before any admission moves the window on, the window still
    holds the declaration's minute: the call it counted corrects its estimate when it
    settles, the call admitted before the declaration corrects nothing; the next minute's
    first admission then starts a window of its own, from the minute's start."""
    before = await admit_ok(ledger, w1, req(ns, tokens=800))
    await ledger.change_policy(ns, {"tpm": 1000})
    counted = await admit_ok(ledger, w1, req(ns, tokens=600))
    into_a_minute.advance(60)
    await _settle(ledger, w1, ns, before.call_id, 30)
    await _settle(ledger, w1, ns, counted.call_id, 100)
    window = await _window(ledger, ns)
    assert (window.requests, window.tokens) == (1, 100) and window.since
    await _verify_judges(ledger, dataclasses.replace(window, tokens=0, since=0))
    await admit_ok(ledger, w1, req(ns, tokens=900))
    fresh = await _window(ledger, ns)
    assert (fresh.minute, fresh.requests, fresh.tokens, fresh.since) == (
        window.minute + 1,
        1,
        900,
        0,
    )
    assert fresh.minute == minute_of(into_a_minute.target)
    report = await verify_ledger(ledger)
    assert report.ok, report.problems


async def test_a_limit_declared_with_nothing_in_flight_starts_a_window_that_reads_nothing(
    ledger: Ledger, w1: Writer, ns: str, into_a_minute: LedgerTime
) -> None:
    """Declared while no call under the node is in flight, ``tpm`` starts an empty window
    that records no position: no attempt reserved before it can settle after it, so its
    settlements correct it without reading when their attempts were reserved."""
    done = await admit_ok(ledger, w1, req(ns, tokens=800))
    await _settle(ledger, w1, ns, done.call_id, 30)
    await ledger.change_policy(ns, {"tpm": 1000})
    started = await _window(ledger, ns)
    assert (started.requests, started.tokens, started.since) == (0, 0, 0)
    counted = await admit_ok(ledger, w1, req(ns, tokens=800))
    await _settle(ledger, w1, ns, counted.call_id, 100)
    await admit_ok(ledger, w1, req(ns, tokens=900))
    await refused_429(ledger, w1, ns, tokens=1)
    assert await _window(ledger, ns) == dataclasses.replace(started, requests=2, tokens=1000)
