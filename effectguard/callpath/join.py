"""Joining: a declared retry of a call still in flight waits for that call and shares
its result, instead of sending it again (docs/contract.md §4)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from effectguard.callpath.exchange import Reply
from effectguard.callpath.prepare import Prepared, ledger_unavailable, refuse
from effectguard.callpath.recorder import Recorder
from effectguard.callpath.replays import replay
from effectguard.callpath.reports import from_state
from effectguard.config.settings import GuardSettings
from effectguard.errors import FencedError, LedgerUnavailable, Refusal
from effectguard.rules import workstate
from effectguard.rules.events import AttemptObserved
from effectguard.rules.guidance import decide_unknown
from effectguard.rules.workstate import WorkState
from effectguard.telemetry.report import CallReport


class StoppedWaiting(Exception):
    """A shutdown stopped sending while this retry waited for ``call_id`` (last seen at
    ``stage``): what it is answered depends on how the call ends in this process
    (:meth:`~effectguard.callpath.dispatches.Dispatches.joined_end`)."""

    def __init__(self, call_id: str, stage: str, reason: str) -> None:
        super().__init__(f"stopped waiting for call {call_id} ({reason})")
        self.call_id, self.stage, self.reason = call_id, stage, reason


async def join_call(
    recorder: Recorder,
    settings: GuardSettings,
    call_id: str,
    prepared: Prepared,
    report: CallReport,
) -> Reply:
    """Wait for ``call_id`` to leave ``in_flight`` (at most ``join_timeout_s``); its
    recorded answer, or 409 if it ended without one. A ledger that cannot be read
    meanwhile is 503 ``ledger_unavailable``: the retry itself sent nothing, and the SDK's
    next retry joins the call again."""
    try:
        return await _join(recorder, settings, call_id, prepared, report)
    except (LedgerUnavailable, FencedError) as exc:
        what = f"the ledger failed while this retry waited for call {call_id}"
        raise ledger_unavailable(exc, call_id, f"{what}; it sent nothing") from exc


async def _join(
    recorder: Recorder,
    settings: GuardSettings,
    call_id: str,
    prepared: Prepared,
    report: CallReport,
) -> Reply:
    ledger = recorder.ledger
    deadline = time.monotonic() + settings.join_timeout_s
    resting_since: float | None = None
    while True:
        state = await ledger.store.get_call(call_id)
        now = time.monotonic()
        if state is None or now > deadline:
            break
        if recorder.stopped is not None:  # however the call stands: as its caller is told
            raise StoppedWaiting(call_id, state.stage, recorder.stopped)
        if state.stage != "in_flight":
            # A resting stage an automatic retry may follow (not_sent, not_processed) may
            # be a pause between the owner's retries (contract.md §3.5), not the call's
            # result: wait out one back-off.
            if not (workstate.may_retry(state) and state.attempts <= settings.max_retries):
                break
            resting_since = resting_since or now
            if now - resting_since > settings.retry_wait_max_s + 1.0:
                break
        else:
            resting_since = None
        local = recorder.waiter(call_id)
        if local is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(local.wait(), timeout=settings.join_poll_s * 20)
        else:
            await asyncio.sleep(settings.join_poll_s)
    return await joined_result(recorder, call_id, state, prepared, report)


async def joined_result(
    recorder: Recorder,
    call_id: str,
    state: WorkState | None,
    prepared: Prepared,
    report: CallReport | None,
) -> Reply:
    """What a retry that joined ``call_id`` gets once it stops waiting, the call at
    ``state``: its recorded answer, or 409 if it ended without one."""
    stage = state.stage if state else "missing"
    observer = recorder.observer
    if stage in ("completed", "failed", "not_processed"):
        observer.request_done(prepared.provider.name, prepared.model or "", "joined")
        if report is not None:
            from_state(report, state, "joined")
        return replay(call_id, await last_observed(recorder, call_id), prepared)
    reason = "effect_unknown" if stage in ("effect_unknown", "in_flight") else "retry_failed"
    observer.refused(prepared.provider.name, reason)
    raise refuse(
        409,
        reason,
        f"this request retries call {call_id}, which is {stage}"
        + (f"; {decide_unknown(call_id)}" if reason == "effect_unknown" else ""),
        call_id=call_id,
        stage=stage,
        next_operation="reconcile" if reason == "effect_unknown" else "resend",
    )


async def last_observed(recorder: Recorder, call_id: str) -> AttemptObserved | None:
    """The provider's answer to the call's last observed attempt (None: none answered)."""
    events = await recorder.ledger.events(call_id)
    observed = [e.event for e in events if e.kind == AttemptObserved.kind]
    last = observed[-1] if observed else None
    assert last is None or isinstance(last, AttemptObserved)
    return last


def stopped_waiting(call_id: str, stage: str, reason: str) -> Refusal:
    """The 503 for a retry still waiting for ``call_id`` once a shutdown stopped waiting
    for the calls under way, the call not ended in this process (another worker's, or
    one still settling here, its own caller gone): its own caller is told now, while the
    ledger is open (it waited on until the ledger closed under it, then was told the
    ledger had failed)."""
    return refuse(
        503,
        "shutting_down",
        f"this retry stopped waiting for call {call_id}, which is {stage}, as this process "
        f"stopped ({reason}); it sent nothing: retry it once the call has ended",
        call_id=call_id,
        stage=stage,
        retryable=True,
    )
