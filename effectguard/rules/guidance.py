"""What an operator runs next for a call, in words the refusals and the CLI share. Pure.

A refusal's message is what an SDK prints (``str(exc)``), so it names the call and the
command to run; ``effectguard show`` ends with the same command.
"""

from __future__ import annotations

#: The stages a person decides with ``effectguard reconcile``.
DECIDED_BY_RECONCILE = frozenset({"effect_unknown", "failed"})


def show_command(call_id: str) -> str:
    """The command that shows a call."""
    return f"effectguard show {call_id}"


def reconcile_command(call_id: str, attempt: int | None = None) -> str:
    """The command that decides an effect-unknown call (both verbs, both need a note).

    With the ``attempt`` the operator is looking at, the command decides only that one:
    copied after a resend began another, it is refused instead of deciding an attempt
    nobody examined."""
    only = "" if attempt is None else f" --attempt {attempt}"
    return (
        f"{applied_command(call_id, attempt)}"
        f" | effectguard reconcile {call_id} --not-applied --note TEXT{only}"
    )


def applied_command(call_id: str, attempt: int | None = None) -> str:
    """The command that decides an effect-unknown call applied (:func:`reconcile_command`)."""
    only = "" if attempt is None else f" --attempt {attempt}"
    return f"effectguard reconcile {call_id} --applied [--cost USD] --note TEXT{only}"


def provider_resend_advice(deadline_iso: str, provider_key: str | None) -> str:
    """What to do first for a keyed effect-unknown call still inside its provider's
    idempotency window (until ``deadline_iso``): a keyed resend goes out under the
    provider key the call's attempts carried, which the provider deduplicates (contract
    §4), so it settles the call without a guess; a decision by hand risks either a second
    effect or none."""
    under = f"under the provider key {provider_key}" if provider_key else "under its provider key"
    return (
        f"resend the request with the same Idempotency-Key before {deadline_iso}: it goes out "
        f"{under}, which the provider deduplicates"
    )


#: The command that asks every effect-unknown call's declared lookup (contract §8).
AUTO_COMMAND = "effectguard reconcile --auto"


def lookup_advice(provider: str, ready_iso: str | None) -> str:
    """What to do before deciding by hand an effect-unknown call whose endpoint declares a
    lookup: ask it. ``reconcile --auto`` records only what the provider's answer proves
    (applied, or not applied), so it cannot guess wrong; ``ready_iso``: when the lookup's
    search lag has passed for the call's last attempt (None: it has), before which a "not
    found" proves nothing. The command asks from its own process, so it needs ``serve``'s
    declarations and upstreams to ask where the call went."""
    after = "" if ready_iso is None else f" after {ready_iso} (its search lags behind)"
    return (
        f"ask {provider}'s lookup whether it applied the call{after}: `{AUTO_COMMAND}` "
        "(it asks every effect-unknown call's lookup and records only what the answer "
        "proves; give it the --providers DIR and --upstream NAME=URL that serve runs with)"
    )


#: What to do first for an effect-unknown call an operator authorized one resend of.
RESEND_AUTHORIZED = (
    "resend the request (same Idempotency-Key, or Effectguard-Retry-Of: the call id): "
    "one resend is authorized"
)


def accept_evidence_command(call_id: str, attempt: int) -> str:
    """The command that decides an effect-unknown call by the late answer to ``attempt``,
    its last: refused, like :func:`reconcile_command`'s, once another attempt began."""
    return f"effectguard reconcile {call_id} --accept-evidence [--note TEXT] --attempt {attempt}"


def taken_over_not_decided(call_id: str, why: str, then: str) -> str:
    """Why a decision about ``call_id`` only took it over (its owner given up for ``why``,
    its lease, may still be running), and what the person does ``then``."""
    return (
        f"call {call_id} was taken over just now ({why}) and nothing was decided: its "
        "worker may still be running (paused, overloaded, or on another host) and receive "
        "the provider's answer, which is then kept as evidence. Check at the provider and "
        f"{then}"
    )


def applied_by_earlier_attempt(call_id: str, attempt: int, implied_usd: str | None) -> str:
    """What a person runs for an effect-unknown call, its last attempt being ``attempt``,
    that a late answer kept for an earlier attempt says the provider applied: the call is
    applied, whichever attempt made the effect, and ``--accept-evidence`` takes only an
    answer to the last attempt. ``implied_usd``: what that answer would have cost."""
    cost = "" if implied_usd is None else f"; that answer implies {implied_usd} USD"
    return (
        f"the provider applied the call, whichever attempt made the effect: "
        f"`effectguard reconcile {call_id} --applied [--cost USD] --note TEXT "
        f"--attempt {attempt}`{cost}; --accept-evidence takes only an answer to attempt "
        f"{attempt}"
    )


def against_applied(late_attempt: int, status: int) -> str:
    """The warning before the offer of "not applied" for a call that a late answer kept
    for ``late_attempt`` (with ``status``) says the provider applied: a person may know
    better, but the decision frees a resend that the evidence says repeats the effect."""
    return (
        f"only if you know the provider did not apply it (the late answer kept for attempt "
        f"{late_attempt} (status {status}) says it did, and a decision not applied frees a "
        "resend that would make the effect again)"
    )


def not_applied_against(call_id: str, attempt: int, late_attempt: int, status: int) -> str:
    """The offer of ``--not-applied`` for such a call (:func:`against_applied`), its last
    attempt being ``attempt``: after its warning, never beside ``--applied`` as an equal."""
    return (
        f"{against_applied(late_attempt, status)}: "
        f"`effectguard reconcile {call_id} --not-applied --note TEXT --attempt {attempt}`"
    )


def decide_unknown(call_id: str) -> str:
    """The advice a refusal of an effect-unknown call ends with."""
    return (
        f"decide with `{show_command(call_id)}` then "
        f"`effectguard reconcile {call_id} --applied|--not-applied --note ...`"
    )


def unknown_effect(call_id: str) -> str:
    """The message of a 409 ``effect_unknown``."""
    return f"call {call_id}: its effect is unknown; {decide_unknown(call_id)}"


def contradicted_not_applied(
    attempt: int,
    status: int,
    kept: bool = True,
    keyed: bool = True,
    stage: str = "reconciled_not_applied",
) -> str:
    """What to do for a call decided not applied whose attempt's late answer, kept after
    the decision, says the provider did apply it: the decision frees the key, and the
    resend it usually calls for would make the effect a second time. ``kept``: the answer
    is in the ledger (False: only its client, answered 502, saw it). ``keyed``: the call
    has an ``Idempotency-Key``; one without is sent again as a new call, or as a declared
    retry (``Effectguard-Retry-Of``, an SDK's retry count), never with a key. ``stage``:
    the call's, one whose next operation is resend (a later attempt ``not_sent`` or
    ``not_processed`` says nothing of what this attempt did), or ``effect_unknown`` with
    a resend authorized, which the answer voids."""
    which = "a late answer kept" if kept else "the late answer (not kept)"
    again = (
        "a resend with the same Idempotency-Key"
        if keyed
        else "sending the request again (it carried no Idempotency-Key)"
    )
    return (
        f"do not resend: {which} for attempt {attempt} (status {status}) says the "
        f"provider applied it {_despite(stage)}; {again} would make the effect again"
    )


def _despite(stage: str) -> str:
    """What the late answer contradicts: the decision, or the later attempt's outcome."""
    if stage == "reconciled_not_applied":
        return "after it was decided not applied"
    if stage == "effect_unknown":
        return "though one resend of it was authorized"
    return f"though its last attempt was {stage.replace('_', ' ')}"


def next_command(
    call_id: str,
    stage: str,
    attempt: int | None = None,
    owner_gone: str | None = None,
    keyed: bool = True,
) -> str | None:
    """The exact command an operator runs next for a call in ``stage``, its last attempt
    being ``attempt`` (None: nothing). A call in flight whose owner is gone (``owner_gone``
    says why) is decided like an unknown one: ``reconcile`` takes it over first. ``keyed``:
    the call has an ``Idempotency-Key`` (a resend without one is a new call)."""
    if stage in DECIDED_BY_RECONCILE or (stage == "in_flight" and owner_gone is not None):
        return reconcile_command(call_id, attempt)
    if stage == "in_flight":
        return f"wait (it is in flight), then `{show_command(call_id)}`"
    if stage in ("not_sent", "not_processed", "reconciled_not_applied"):
        if keyed:
            return "resend the request with the same Idempotency-Key"
        return "resend the request (it carried no Idempotency-Key: the resend is a new call)"
    return None


def next_shown(next_operation: str, owner_gone: str | None) -> str:
    """The next operation as ``calls``' table and ``show``'s stage line print it: the §6
    projection's (what ``--json`` keeps), except that a call in flight whose owner is gone
    (``owner_gone`` says why) waits for nothing: ``reconcile`` takes it over."""
    if owner_gone is None or next_operation != "wait":
        return next_operation
    return f"reconcile (owner gone: {owner_gone})"


#: The stages in which nothing a call sent took effect: a resend is safe.
NOTHING_TOOK_EFFECT = {
    "not_sent": "nothing was sent",
    "not_processed": "the provider did not process it",
}


def after_cut_off(call_id: str, stage: str, keyed: bool) -> tuple[str, bool]:
    """What the caller of a call a shutdown cut off (not in flight, not effect unknown)
    is told to do, and whether a resend is safe (``x-should-retry``). A call without an
    ``Idempotency-Key`` cannot be resent for its recorded result: that resend is a new call."""
    if stage in NOTHING_TOOK_EFFECT:
        return f"{NOTHING_TOOK_EFFECT[stage]}: {next_command(call_id, stage, keyed=keyed)}", True
    if keyed:
        return "resend it with the same Idempotency-Key to receive its result", False
    return (
        "it carried no Idempotency-Key, so a resend would be a new call; "
        f"`{show_command(call_id)}` shows its result",
        False,
    )


def ended_period_way_out(path: str, label: str) -> str:
    """Why a later attempt's 402 will not pass on its own, and the ways out: the call was
    admitted in ``label``, which has ended, and its later attempts are charged there
    (contract §5.5), so no later period brings room back to it."""
    return (
        f"; the call was admitted in period {label}, which has ended, and its later attempts "
        "are charged there: new work needs a new Idempotency-Key (a new call, charged to the "
        f"current period), or an operator can raise the limit (effectguard budget set {path} "
        "--limit USD)"
    )
