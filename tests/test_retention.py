"""The retention rules as pure functions: what may be archived, and where an archive cuts."""

from __future__ import annotations

import pytest

from effectguard.ops.audit.archived import SETTLED_STAGES
from effectguard.rules.retention import (
    EventRef,
    RetentionPolicy,
    closes,
    cut,
    decide_archived,
    holder,
    stays_live,
)
from effectguard.rules.workstate import STAGES, WorkState

NOW = 10_000_000.0
DAY = 86_400.0


#: The stages a call may be archived in, written down here rather than read from the code
#: under test (docs/operations.md): every stage but the unresolved ones. The resumable
#: stages (no effect) leave too, keyed or not; an archived key answers 409 archived.
SETTLED = {
    "refused",
    "completed",
    "failed",
    "reconciled_applied",
    "not_sent",
    "not_processed",
    "reconciled_not_applied",
}


def test_every_stage_is_judged() -> None:
    """The stages this file pins are the contract's (a new stage must be judged here)."""
    assert set(STAGES) == SETTLED | {"in_flight", "effect_unknown"}


@pytest.mark.parametrize("key", ["k", None])
@pytest.mark.parametrize("stage", STAGES)
def test_only_unresolved_calls_stay_live(stage: str, key: str | None) -> None:
    """Unresolved calls stay live, with a key or without; every settled call may go
    (a resumable one too: its key answers 409 archived), and the verifier judges an
    archive by the same set."""
    state = WorkState(call_id="c", stage=stage, created_at=NOW - 100, idempotency_key=key)  # type: ignore[arg-type]
    reason = stays_live(state, resolved_at=NOW - 50, before=NOW, now=NOW)
    assert (reason is None) == (stage in SETTLED)
    if stage not in SETTLED:
        assert reason == f"stage {stage} is not final"
    assert (stage in SETTLED) == (stage in SETTLED_STAGES)


def test_a_call_resolved_after_the_cutoff_stays() -> None:
    """The cut-off date is exclusive: a call resolved at or after it stays live."""
    state = WorkState(call_id="c", stage="completed", created_at=NOW - 20)
    assert stays_live(state, resolved_at=NOW - 10, before=NOW - 10, now=NOW) == (
        "resolved after the cut-off"
    )
    assert stays_live(state, resolved_at=NOW - 10, before=NOW - 9, now=NOW) is None


def test_retention_counts_from_the_resolution_not_the_admission() -> None:
    """A call admitted long before the cut-off but resolved after it (unknown for weeks,
    reconciled yesterday) keeps its bodies for the full period after it was decided."""
    state = WorkState(call_id="c", stage="reconciled_applied", created_at=NOW - 60 * DAY)
    keep_30_days = NOW - 30 * DAY
    assert stays_live(state, resolved_at=NOW - DAY, before=keep_30_days, now=NOW) == (
        "resolved after the cut-off"
    )
    assert stays_live(state, resolved_at=NOW - 31 * DAY, before=keep_30_days, now=NOW) is None


def test_a_call_inside_its_provider_idempotency_window_stays() -> None:
    """A call whose provider still deduplicates its key stays until the window passes."""
    state = WorkState(
        call_id="c", stage="completed", created_at=NOW - 100, idempotency_window_s=3600
    )
    assert stays_live(state, resolved_at=NOW - 100, before=NOW, now=NOW) == (
        "inside its provider's idempotency window"
    )
    assert stays_live(state, resolved_at=NOW - 100, before=NOW, now=NOW + 3600) is None


def test_the_cut_stops_before_the_first_call_that_must_stay() -> None:
    """Events of a live call and everything after them stay, even archivable calls."""
    refs = [EventRef(1, None, 1), EventRef(2, "a", 2), EventRef(3, "b", 3), EventRef(4, "c", 4)]
    assert cut(refs, {"a": True, "b": False, "c": True}, before=NOW) == 2


def test_the_cut_never_splits_a_call() -> None:
    """A call whose events straddle a blocker is not archived in part."""
    refs = [
        EventRef(1, "a", 1),
        EventRef(2, "a", 2),
        EventRef(3, "b", 3),
        EventRef(4, "x", 4),
        EventRef(5, "b", 5),
    ]
    # b's last event lies after x, which must stay: only the prefix ending with a may go.
    assert cut(refs, {"a": True, "b": True, "x": False}, before=NOW) == 2
    # a call that begins before another ends holds the cut back to before both.
    tangled = [EventRef(1, "a", 1), EventRef(2, "b", 2), EventRef(3, "a", 3)]
    tangled += [EventRef(4, "x", 4), EventRef(5, "b", 5)]
    assert cut(tangled, {"a": True, "b": True, "x": False}, before=NOW) == 0


def test_the_holder_is_the_first_live_call_after_the_cut() -> None:
    """The operator is told which call holds the cut, and why; nobody, at the cut-off."""
    refs = [EventRef(1, "a", 1), EventRef(2, None, 2), EventRef(3, "b", 3), EventRef(4, "c", 4)]
    reasons = {"a": None, "b": "stage effect_unknown is not final", "c": "later"}
    last = cut(refs, {k: v is None for k, v in reasons.items()}, before=NOW)
    assert holder(refs, reasons, last=last, before=NOW) == ("b", reasons["b"])
    # a held call written at or after the cut-off holds nothing back
    assert holder(refs, reasons, last=last, before=3) is None
    # an archivable call whose events straddle the holder is not the holder
    tangled = [EventRef(1, "a", 1), EventRef(2, "x", 2), EventRef(3, "a", 3)]
    both = {"a": None, "x": "stage in_flight is not final"}
    assert holder(tangled, both, last=0, before=NOW) == ("x", both["x"])
    assert holder(refs, {"a": None, "b": None, "c": None}, last=4, before=NOW) is None


def test_the_cut_stops_at_the_cutoff_and_gives_zero_when_nothing_may_go() -> None:
    """Nothing written at or after the cut-off leaves; an empty cut is 0."""
    refs = [EventRef(1, None, 5), EventRef(2, "a", 50)]
    assert cut(refs, {"a": True}, before=50) == 1
    assert cut(refs, {"a": True}, before=5) == 0


def test_an_archived_key_answers_409_archived_or_422_for_another_request() -> None:
    """A key of an archived call is refused, never admitted as new work."""
    same = decide_archived("call_1", "h", "h")
    assert same.action == "refuse" and same.refusal is not None
    assert (same.refusal.status, same.refusal.type) == (409, "archived")
    assert same.refusal.call_id == "call_1"
    other = decide_archived("call_1", "h", "other")
    assert other.refusal is not None and other.refusal.status == 422


def test_the_policy_gives_a_cutoff_only_when_declared() -> None:
    """``keep_bodies_days`` turns into a cut-off N days back; undeclared keeps everything."""
    assert RetentionPolicy().cutoff(NOW) is None
    assert RetentionPolicy(keep_bodies_days=1).cutoff(NOW) == NOW - 86400


def test_a_window_of_the_chain_is_never_cut_inside_a_call_that_goes_on_past_it() -> None:
    """An archive step reads only a window of the chain: a call whose last event lies
    past the window's end (``ends``) keeps the cut before its first event, and a window
    with no call boundary in it must grow before anything is cut."""
    window = [EventRef(1, "a", 1), EventRef(2, "b", 2), EventRef(3, "a", 3), EventRef(4, "c", 4)]
    every = {"a": True, "b": True, "c": True}
    assert cut(window, every, before=NOW) == 4  # read alone, b ends at 2
    assert cut(window, every, before=NOW, ends={"b": 9}) == 0  # b goes on to event 9
    assert cut(window[:1] + window[2:], every, before=NOW, ends={"c": 9}) == 3
    assert closes(window, {"b": 9}) is False
    assert closes(window, {"b": 3}) is True
    assert closes([EventRef(1, None, 1), *window], {"b": 9}) is True  # a worker event first
