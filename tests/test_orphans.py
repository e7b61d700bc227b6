"""The per-process memory of calls whose caller left (callpath/orphans), without I/O:
each is taken once, within the retry window, and one budget root leaving calls in bulk
cannot push out another root's."""

from __future__ import annotations

import pytest

from effectguard.callpath.orphans import Orphans


def test_an_orphan_is_taken_once_by_the_retry_that_matches_it() -> None:
    orphans = Orphans()
    orphans.left(("team", "h1"), "call_1")
    assert orphans.take(("team", "h2"), 60) is None
    assert orphans.take(("other", "h1"), 60) is None
    assert orphans.take(("team", "h1"), 60) == "call_1"
    assert orphans.take(("team", "h1"), 60) is None


def test_an_orphan_older_than_the_window_is_not_a_match(monkeypatch: pytest.MonkeyPatch) -> None:
    orphans = Orphans()
    now = [1000.0]
    monkeypatch.setattr("effectguard.callpath.orphans.time.monotonic", lambda: now[0])
    orphans.left(("team", "h1"), "call_1")
    now[0] += 61
    assert orphans.take(("team", "h1"), 60) is None


def test_a_key_less_request_is_never_remembered() -> None:
    orphans = Orphans(limit=1)
    orphans.left(None, "call_1")
    orphans.left(("team", "h1"), "call_2")
    assert orphans.take(("team", "h1"), 60) == "call_2"


def test_one_root_leaving_calls_in_bulk_does_not_push_out_another_roots() -> None:
    """Past the limit the oldest of the root holding the most goes: a tenant whose
    clients leave by the thousand (or on purpose) evicts its own, not a quiet tenant's
    one orphan, whose SDK retry would otherwise be sent again as new work."""
    orphans = Orphans(limit=100)
    orphans.left(("quiet", "q"), "call_quiet")
    for n in range(1000):
        orphans.left(("noisy", f"h{n}"), f"call_{n}")
    assert orphans.take(("quiet", "q"), 60) == "call_quiet"
    assert orphans.take(("noisy", "h999"), 60) == "call_999"
    assert orphans.take(("noisy", "h0"), 60) is None  # its own oldest went first
    kept = sum(orphans.take(("noisy", f"h{n}"), 60) is not None for n in range(1000))
    assert kept == 98  # 100 held at most: quiet's one, noisy's 99 newest, one taken above
