"""Deciding unknown effects from evidence: provider lookups and the application's hook.

A call whose effect is unknown is decided, without a person, only by evidence:

* the endpoint's declared **lookup** (:mod:`effectguard.rules.lookups` reads its answer),
  sent with the provider's own credentials, bounded by the lookup's timeout;
* else, or if the lookup cannot tell, the application's **reconcile hook**
  (:mod:`effectguard.callpath.hooks`), bounded by its timeout.

Every decision is recorded as ``call.reconciled`` by ``lookup:<provider>`` or ``hook``,
its note naming the evidence and its digest. "Unknown" records nothing: the call stays
``effect_unknown``. The :class:`Resolver` runs when a keyed resend meets such a call
(the guard), on every sweep for calls older than the lookup's freshness, and in
``effectguard reconcile --auto``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import httpx

from effectguard.callpath.exchange import Outbound, Send, header_value
from effectguard.callpath.hooks import Applied, NotApplied, ReconcileHook, ReconcileQuestion
from effectguard.callpath.prepare import ledger_unavailable
from effectguard.errors import (
    BodyMismatch,
    EffectguardError,
    FencedError,
    LedgerUnavailable,
    ReconcileError,
)
from effectguard.ledger import Ledger
from effectguard.providers import Endpoint, Lookup, Provider
from effectguard.providers.templates import url_segment
from effectguard.rules import lookups
from effectguard.rules.admission import Sending
from effectguard.rules.bodyref import REF_ENCODING
from effectguard.rules.bodytext import decode_body
from effectguard.rules.digest import credential_digest
from effectguard.rules.events import CallManifest
from effectguard.rules.money import MAX_CALL_NANOS, check_amount, usd_to_nanos
from effectguard.rules.searched import blind_spot
from effectguard.rules.workstate import Stage, WorkState, work_state

log = logging.getLogger("effectguard.callpath.resolve")


#: The most of a lookup answer that is read (an answer is one object, or a page of them),
#: and of a recovered result that is kept in the ledger with its decision.
MAX_ANSWER_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Facts:
    """What the ledger knows about an unknown call that a lookup or hook needs."""

    call_id: str
    provider: str
    endpoint: str
    method: str
    #: The manifest's request body: bytes, or a by-reference upload's SHA-256 (hex) whose
    #: bytes :func:`request_body` reads from the ledger only when the hook asks.
    body: bytes | str
    idempotency_key: str | None
    provider_key: str | None
    #: When the call's last attempt started (ledger clock, seconds since the epoch).
    last_attempt_at: float
    #: That attempt's number: evidence gathered now speaks of it, and of no later one.
    attempt: int = 0
    #: The call's stage when these facts were read: evidence speaks only of an attempt
    #: that has ended (``effect_unknown``), never of one still on the wire.
    stage: Stage = "effect_unknown"
    #: The request's headers that scope it to an account (the lookup's scope_headers).
    headers: Mapping[str, str] = field(default_factory=dict)
    #: How the call's attempts went out, each distinct record once (rules/admission):
    #: where each wrote its operation id, and where and with which credential it was sent.
    sending: frozenset[Sending] = frozenset()


@dataclass(frozen=True, slots=True)
class Evidence:
    """A decision (or "unknown"), who gave it, and what it rests on."""

    verdict: lookups.Verdict
    by: str
    note: str
    cost: int | None = None
    #: What the client gets as a recovered 200, where the evidence returned it.
    result: bytes | None = None


async def facts_of(ledger: Ledger, call_id: str) -> Facts | None:
    """The call's facts from its events (None if it has no manifest)."""
    events = await ledger.events(call_id)
    manifest = next((e.event for e in events if e.kind == CallManifest.kind), None)
    if not isinstance(manifest, CallManifest):
        return None
    started = [e for e in events if e.kind == "attempt.started"]
    by_reference = manifest.body_encoding == REF_ENCODING
    key = started[-1].data.get("provider_idempotency_key") if started else None
    at = float(started[-1].data.get("at") or started[-1].at) if started else manifest.at
    # Every attempt, not only the last: a resend the provider deduplicated into an
    # earlier attempt's effect (or turned away) says nothing of what that attempt carried.
    sending = frozenset(
        Sending(e.data.get("op_id_in"), e.data.get("sent_to"), e.data.get("key_digest"))
        for e in started
    )
    return Facts(
        call_id=call_id,
        provider=manifest.provider,
        endpoint=manifest.endpoint,
        method=manifest.method,
        body=manifest.body if by_reference else decode_body(manifest.body, manifest.body_encoding),
        idempotency_key=manifest.idempotency_key,
        provider_key=str(key) if key else None,
        last_attempt_at=at,
        attempt=int(started[-1].data.get("attempt") or len(started)) if started else 0,
        stage=work_state(e.event for e in events).stage,
        headers=dict(manifest.headers),
        sending=sending,
    )


async def request_body(ledger: Ledger, facts: Facts) -> bytes:
    """The request's bytes as admitted; a body stored by reference (an upload, at most
    ``max_body_bytes``) is read back whole from the ledger, for the reconcile hook to
    see, and must hash to its manifest's digest (:class:`BodyMismatch` otherwise)."""
    if isinstance(facts.body, bytes):
        return facts.body
    out = io.BytesIO()
    await ledger.copy_body(facts.call_id, out)
    body = out.getvalue()
    if hashlib.sha256(body).hexdigest() != facts.body:
        raise BodyMismatch(
            f"call {facts.call_id}: its stored body does not hash to its manifest's "
            f"sha256 {facts.body}",
            call_id=facts.call_id,
        )
    return body


def lookup_request(
    provider: Provider,
    lookup: Lookup,
    op: str,
    credential: str | None,
    scope: Mapping[str, str] | None = None,
) -> Outbound:
    """The lookup as it goes to the provider, with the provider's credential (and its
    declared form fields, form-encoded, as the body), in the account the call acted in:
    ``scope``, the call's recorded ``scope_headers`` (Stripe's ``Stripe-Account``)."""
    params = {name: value.format(op=op) for name, value in lookup.query}
    # Merged into any query the declared URL has, as httpx.Request(params=...) does.
    # The op in the URL is one encoded segment (templates.url_segment); the query's
    # params are encoded by httpx.
    url = httpx.URL(lookup.url.format(base_url=provider.base_url, op=url_segment(op)))
    url = url.copy_merge_params(params)
    headers = [(b"accept", b"application/json"), (b"accept-encoding", b"identity")]
    if credential is not None:
        headers.append((provider.key_header.lower().encode(), credential.encode()))
    # Searched in another account, an object the call made there is never found: "not
    # found" would read as "not applied", and the call be sent a second time.
    for name in lookup.scope_headers:
        if scope and name in scope:
            headers.append((name.encode("latin-1"), scope[name].encode("utf-8")))
    body = b""
    if lookup.form:
        fields = [(name, value.format(op=op)) for name, value in lookup.form]
        body = urlencode(fields).encode("ascii")
        headers.append((b"content-type", b"application/x-www-form-urlencoded"))
    target = url.raw_path.decode("ascii", "replace")
    return Outbound(lookup.method, str(url), url.path, target, headers, body)


class Resolver:
    """Asks lookups and the hook about unknown calls, and records their decisions."""

    def __init__(
        self,
        ledger: Ledger,
        providers: Mapping[str, Provider],
        *,
        credentials: Mapping[str, str] | None = None,
        hook: ReconcileHook | None = None,
        hook_timeout_s: float = 5.0,
        send: Send | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.ledger = ledger
        self.providers = providers
        #: Each provider's API key (from its ``api_key_env``), for lookups with no request.
        self.credentials = dict(credentials or {})
        self.hook = hook
        self.hook_timeout_s = hook_timeout_s
        #: How lookups of the sweeper go out (the proxy and transports set their inner one).
        self.send = send
        #: How old a call is, and whether its provider's window is open, is read on the
        #: ledger's clock, the one that timed its attempts (on PostgreSQL the database's:
        #: a host running ahead read a fresh call as past its provider's search lag, and
        #: its "not found" decided it not applied). A test may set a clock of its own.
        self.clock = clock
        #: The last unknown call the sweeper looked at, as ``(created_at, call_id)``: the
        #: next sweep reads the page after it (None: start from the oldest).
        self._cursor: tuple[float, str] | None = None

    async def now(self) -> float:
        """The ledger's clock (or the test's, if it set one)."""
        if self.clock is not None:
            return self.clock()
        return await self.ledger.store.clock_now()

    def endpoint(self, facts: Facts) -> Endpoint | None:
        """The declared endpoint of a call (None: its provider is no longer declared)."""
        provider = self.providers.get(facts.provider)
        return None if provider is None else provider.effect_for(facts.method, facts.endpoint)

    def can_decide(self, facts: Facts) -> bool:
        """Whether any evidence could decide this call: a declared lookup, or the hook."""
        endpoint = self.endpoint(facts)
        return self.hook is not None or (endpoint is not None and endpoint.lookup is not None)

    async def at_resend(self, call_id: str, request: Outbound, send: Send) -> Evidence:
        """A keyed resend met effect-unknown ``call_id``: decide it, with the resend's
        credential (the one its call would go out with) for the lookup. A ledger that
        fails meanwhile is 503 ``ledger_unavailable``: the resend sent nothing."""
        try:
            facts = await facts_of(self.ledger, call_id)
            if facts is None or not self.can_decide(facts):
                return Evidence("unknown", "", "nothing can decide this call")
            provider = self.providers[facts.provider]
            return await self.decide(facts, send, request.header(provider.key_header))
        except (LedgerUnavailable, FencedError) as exc:
            what = f"the ledger failed while this resend looked for call {call_id}'s outcome"
            raise ledger_unavailable(exc, call_id, f"{what}; nothing was sent") from exc

    async def decide(
        self, facts: Facts, send: Send | None = None, credential: str | None = None
    ) -> Evidence:
        """Ask the lookup, then (if it cannot tell) the hook; record a decision, if any.

        Only about a call whose effect is unknown now: a call read from a page or a list
        a while ago may have been resent meanwhile, and "not applied" said while that
        attempt is on the wire would be recorded once it is lost, whatever it then did.
        """
        if facts.stage != "effect_unknown":
            return Evidence("unknown", "", f"call {facts.call_id} is {facts.stage} now")
        evidence = Evidence("unknown", "", "no lookup declared and no hook")
        endpoint = self.endpoint(facts)
        send = send or self.send
        if endpoint is not None and endpoint.lookup is not None and send is not None:
            provider = self.providers[facts.provider]
            credential = credential or self._credential(provider)
            blind = blind_spot_of(facts, endpoint, provider.base_url, credential)
            evidence = await self._look_up(
                provider, endpoint.lookup, facts, send, credential, blind
            )
        if evidence.verdict == "unknown" and self.hook is not None:
            evidence = await self._ask_hook(facts)
        if evidence.result is not None and len(evidence.result) > MAX_ANSWER_BYTES:
            # Kept in the ledger, replayed to every later resend: bounded like an answer.
            note = f"{evidence.note}; its result ({len(evidence.result)} bytes) is not kept"
            evidence = dataclasses.replace(evidence, note=note, result=None)
        if evidence.verdict != "unknown":
            evidence = await self._record(facts, evidence)
        return evidence

    def _credential(self, provider: Provider) -> str | None:
        key = self.credentials.get(provider.name)
        return None if key is None else provider.key_format.format(key=key)

    async def _look_up(
        self,
        provider: Provider,
        lookup: Lookup,
        facts: Facts,
        send: Send,
        credential: str | None,
        blind: str | None,
    ) -> Evidence:
        by = f"lookup:{provider.name}"
        op = facts.call_id if lookup.op == "call_id" else facts.provider_key
        if op is None:
            return Evidence("unknown", by, "no provider idempotency key was recorded")
        request = lookup_request(provider, lookup, op, credential, facts.headers)
        shown = f"{request.method} {request.url.partition('?')[0]}"
        try:
            status, content_type, body = await asyncio.wait_for(
                _fetch(send, request), lookup.timeout_s
            )
        except (httpx.HTTPError, TimeoutError) as exc:
            # Where the lookup asked elsewhere than the call went (a `reconcile --auto`
            # without serve's --upstream), that is most likely why it reached nothing.
            aside = "" if blind is None else f"; {blind}"
            return Evidence("unknown", by, f"lookup {shown} failed: {type(exc).__name__}{aside}")
        reading = lookups.read_answer(
            status,
            body,
            content_type=content_type,
            op=op,
            match=lookup.match,
            applied=lookup.applied,
            not_found=lookup.not_found,
            freshness_s=lookup.freshness_s,
            age_s=await self.now() - facts.last_attempt_at,
            retention_s=lookup.retention_s,
            results=lookup.results,
            blind=blind,
        )
        note = f"lookup {shown} answered {status}: {reading.why}; evidence {lookups.digest(body)}"
        result = None if reading.found is None else json.dumps(reading.found).encode()
        return Evidence(reading.verdict, by, note, result=result)

    async def _ask_hook(self, facts: Facts) -> Evidence:
        assert self.hook is not None
        try:
            request = await request_body(self.ledger, facts)
        except BodyMismatch as exc:  # nothing true to show the hook: no evidence
            return Evidence("unknown", "hook", str(exc))
        question = ReconcileQuestion(
            provider=facts.provider,
            endpoint=facts.endpoint,
            method=facts.method,
            request=request,
            op_id=facts.call_id,
            idempotency_key=facts.idempotency_key,
        )
        try:
            answer = await asyncio.wait_for(self.hook(question), self.hook_timeout_s)
        except Exception as exc:  # a failing hook is no evidence, whatever it raised
            return Evidence("unknown", "hook", f"hook failed: {type(exc).__name__}: {exc}")
        return hook_evidence(answer)

    async def _record(self, facts: Facts, evidence: Evidence) -> Evidence:
        """Record ``evidence``'s decision; what stands (unknown where the ledger refused)."""
        try:
            await self.ledger.reconcile(
                facts.call_id,
                applied=evidence.verdict == "applied",
                cost=evidence.cost,
                note=evidence.note,
                by=evidence.by,
                result=evidence.result,
                attempt=facts.attempt,
                automated=True,
            )
        except ReconcileError as exc:
            # Another replica (or a person) decided it first: their decision stands. Or
            # another resend sent it again meanwhile: this evidence predates that attempt.
            # Or a late answer kept says otherwise (the attempt's, or an applied one to
            # any attempt against "not applied"): a person decides, as the note says.
            log.info("call %s: evidence not recorded: %s", facts.call_id, exc)
            return Evidence("unknown", evidence.by, f"{evidence.note}; not recorded: {exc}")
        return evidence

    def can_sweep(self) -> bool:
        """Whether a sweep could decide anything: a hook, or a provider with a lookup."""
        if self.hook is not None:
            return True
        return any(
            e.lookup is not None or p.lookup is not None
            for p in self.providers.values()
            for e in p.endpoints
        )

    async def sweep(self, limit: int = 20) -> list[str]:
        """Decide unknown calls old enough for their lookup's freshness; the ones decided.

        Each sweep looks at the next ``limit`` ``effect_unknown`` calls in order of
        creation, after the last one the previous sweep looked at, starting over at the
        oldest once past the newest: a round robin, so calls no evidence decides yet never
        starve those it can (with N unknown calls, every one is looked at within
        ceil(N / limit) sweeps), and a sweep reads one page of calls, never all of them.
        """
        if not self.can_sweep():
            return []
        decided: list[str] = []
        now = await self.now()
        for state in await self._next_page(limit):
            self._cursor = (state.created_at, state.call_id)
            if _left_to_its_client(state, now):
                continue
            if await self._sweep_one(state.call_id, now):
                decided.append(state.call_id)
        return decided

    async def _next_page(self, limit: int) -> list[WorkState]:
        """The ``limit`` unknown calls after the cursor, wrapping round to the oldest."""
        page = await self.ledger.unknown_after(self._cursor, limit)
        if len(page) < limit and self._cursor is not None:
            seen = {state.call_id for state in page}
            wrapped = await self.ledger.unknown_after(None, limit - len(page))
            page += [state for state in wrapped if state.call_id not in seen]
        return page

    async def _sweep_one(self, call_id: str, now: float) -> bool:
        """Ask about one unknown call if evidence could decide it now; whether it did."""
        facts = await facts_of(self.ledger, call_id)
        if facts is None or not self.can_decide(facts):
            return False
        endpoint = self.endpoint(facts)
        lookup = endpoint.lookup if endpoint is not None else None
        if lookup is not None and now - facts.last_attempt_at < lookup.freshness_s:
            return False  # its "not found" would prove nothing yet
        try:
            evidence = await self.decide(facts)
        except EffectguardError as exc:
            log.warning("could not decide call %s: %s", facts.call_id, exc)
            return False
        return evidence.verdict != "unknown"


def blind_spot_of(
    facts: Facts, endpoint: Endpoint, base_url: str, credential: str | None
) -> str | None:
    """Why the endpoint's lookup, asked at ``base_url`` with ``credential``, cannot prove
    the call "not applied" by "not found" (None: it can; rules/searched).

    A lookup by operation id needs each attempt to have recorded writing the id where the
    endpoint declares it now (a call an older release sent, before the endpoint had an
    ``op_id`` or before attempts recorded it, carries no such record). A lookup by the
    provider's idempotency key searches for the key every attempt recorded sending. Both
    need every attempt sent where, and with the credential, the lookup asks.
    """
    lookup = endpoint.lookup
    return blind_spot(
        facts.sending,
        op_id_in=endpoint.op_id.label if endpoint.op_id is not None else None,
        by_key=lookup is not None and lookup.op == "idempotency_key",
        base_url=base_url,
        key_digest=credential_digest(credential) if credential is not None else None,
    )


def _left_to_its_client(state: WorkState, now: float) -> bool:
    """A keyed call inside its provider's idempotency window: its client's resend goes to
    the provider, which deduplicates it and answers it as it answered the first time. A
    decision now would answer that resend 409 instead (a lookup keeps no result for most
    tools), so the sweeper leaves it until the window closes."""
    window = state.idempotency_window_s
    return (
        state.idempotency_key is not None
        and window is not None
        and now - state.created_at <= window
    )


def hook_evidence(answer: object) -> Evidence:
    """What the hook's answer proves. An answer that is not one of the three, or an
    ``Applied`` whose cost is no USD amount in bounds or whose result is neither bytes
    nor a JSON value, proves nothing: unknown, as a hook that fails."""
    if isinstance(answer, NotApplied):
        return Evidence("not_applied", "hook", "the reconcile hook answered not applied")
    if not isinstance(answer, Applied):
        return Evidence("unknown", "hook", f"the reconcile hook answered {answer!r:.200}")
    try:
        result: Any = answer.result
        if isinstance(result, Mapping):
            result = dict(result)
        if result is not None and not isinstance(result, bytes):
            result = json.dumps(result, allow_nan=False).encode()
        cost = None
        if answer.cost_usd is not None:
            cost = check_amount(usd_to_nanos(answer.cost_usd), MAX_CALL_NANOS, "a cost")
    except (TypeError, ValueError) as exc:
        return Evidence("unknown", "hook", f"the reconcile hook answered applied, but {exc}")
    note = "the reconcile hook answered applied"
    if result is not None:
        note += f"; evidence {lookups.digest(result)}"
    return Evidence("applied", "hook", note, cost=cost, result=result)


async def _fetch(send: Send, request: Outbound) -> tuple[int, str | None, bytes]:
    """The answer's status, ``Content-Type`` and body (at most :data:`MAX_ANSWER_BYTES`)."""
    response = await send(request)
    try:
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise httpx.DecodingError("lookup answer too large")
            chunks.append(chunk)
        return response.status, header_value(response.headers, "content-type"), b"".join(chunks)
    finally:
        await response.aclose()


def describe(evidence: Evidence) -> dict[str, Any]:
    """The evidence as a JSON-ready summary (for ``reconcile --auto``)."""
    return {"result": evidence.verdict, "by": evidence.by, "note": evidence.note}
