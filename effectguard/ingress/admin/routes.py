"""The operator page as an ASGI app mounted under ``/_effectguard/`` by the proxy.

Every request needs the admin key: a browser logs in once with it (the form POSTs
it; the answer sets a signed session cookie, never the key), and a script may send
it as ``Authorization: Bearer KEY`` instead. Without either the answer is 401 and
the login form. State changes only by POST: a cookie session's POST must also
come from this server's own page (``Origin``/``Referer``) and carry the session's
CSRF token, or it is refused with 403 before the ledger is touched.

Logging out ends the session on every replica: the ledger records it as ended (by the
token's SHA-256), and every request a session cookie authenticates reads that record
after the signature check, so a copy of the cookie is refused with 401 from then on. A
ledger that cannot answer that read makes the request a 503, never a pass.

The page reads and writes only through :class:`~effectguard.ledger.Ledger`, the
API the CLI uses, and keeps no state of its own: any replica answers any request. As for
the CLI, a call in flight whose worker is gone is judged on this host (a free liveness
lock is seen only here, a lapsed lease anywhere), and a decision about it takes the worker
over first (:mod:`effectguard.callpath.takeover`, which ``effectguard reconcile`` runs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import quote, unquote

from effectguard.callpath.recovery import lock_dir_for
from effectguard.callpath.takeover import gone_in_flight, gone_owners_here, take_over_gone
from effectguard.config.settings import AdminSettings
from effectguard.errors import CallNotFound, LedgerError, ReconcileError
from effectguard.ingress.admin import budgetpage, callpage, spendpage, worklist
from effectguard.ingress.admin.exchange import (
    Exchange,
    FormNotUtf8,
    FormTooLarge,
    Receive,
    Scope,
    Send,
)
from effectguard.ingress.admin.markup import PREFIX, esc, flash, login_page, page
from effectguard.ingress.admin.session import Session, Sessions, same_origin, token_sha256
from effectguard.ingress.admin.spend import DAY_S, spend_table, top_series
from effectguard.ingress.keyring import bearer_token
from effectguard.ledger import Ledger
from effectguard.providers import Provider, lookup_lag
from effectguard.rules import budget as budgets
from effectguard.rules import notes
from effectguard.rules.counts import parse_count
from effectguard.rules.guidance import taken_over_not_decided
from effectguard.rules.liveness import may_still_answer
from effectguard.rules.money import MAX_CALL_NANOS, typed_usd
from effectguard.rules.workstate import STAGES

log = logging.getLogger("effectguard.admin")

#: Most effect-unknown calls listed (the oldest); most calls read for the spend chart.
UNKNOWN_SHOWN = 500
#: Most calls in flight with a gone worker listed.
GONE_SHOWN = 50
SPEND_CALLS = 50_000


class Refused(Exception):
    """A request the page answers with a status and a message, changing nothing."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AdminPage:
    """The operator page: login, unknown calls, a call, budgets, spend, reconcile."""

    def __init__(
        self,
        admin: AdminSettings,
        ledger: Ledger,
        *,
        lock_dir: Path | None = None,
        clock: Callable[[], float] = time.time,
        providers: Mapping[str, Provider] | None = None,
    ) -> None:
        self._admin = admin
        self._ledger = ledger
        #: The declarations ``serve`` runs with: a call whose endpoint declares a lookup
        #: is offered ``reconcile --auto`` before the decisions by hand.
        self._providers: Mapping[str, Provider] = providers or {}
        #: The ledger's workers' liveness locks (``lock_dir_for``; None: none to look at):
        #: a call in flight whose owner is gone is judged as ``effectguard show`` judges it.
        self._lock_dir = lock_dir
        self._clock = clock
        self.sessions = Sessions(admin)

    @staticmethod
    def owns(path: str) -> bool:
        """Whether ``path`` belongs to the page (everything under its prefix)."""
        return path.startswith(PREFIX) or path == PREFIX.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ex = Exchange(scope, receive, send)
        if ex.path == PREFIX.rstrip("/"):
            await ex.redirect(PREFIX)
            return
        try:
            await self._route(ex, ex.path.removeprefix(PREFIX))
        except Refused as refused:
            await self._refused(ex, refused)
        except FormTooLarge:
            await self._refused(ex, Refused(413, "that form is too large"))
        except FormNotUtf8:
            await self._refused(ex, Refused(400, "that form is not UTF-8; nothing was recorded"))
        except LedgerError as exc:
            log.warning("operator page: the ledger failed: %s", exc)
            await self._refused(ex, Refused(503, "the ledger is unavailable; try again"))

    async def _route(self, ex: Exchange, sub: str) -> None:
        if sub == "login" and ex.method == "POST":
            await self._login(ex)
            return
        session = await self._authenticate(ex)
        if session is None:
            login = login_page(None, _local(_back_to(ex, sub)))
            await ex.html(401, login, ((b"www-authenticate", b"Bearer"),))
            return
        if ex.method == "POST":
            await self._post(ex, sub, session)
        elif ex.method in ("GET", "HEAD"):
            await self._get(ex, sub, session)
        else:
            raise Refused(405, f"{ex.method} is not allowed here")

    async def _authenticate(self, ex: Exchange) -> Session | None:
        """The session a request proves: a bearer admin key, else the session cookie of a
        session no logout has ended (a LedgerError if the ledger cannot say: a 503)."""
        authorization = ex.header("authorization")
        if authorization is not None:
            key = self._admin.key_for(bearer_token(authorization))
            if key is None:  # logged as a wrong login is: a guess leaves a trace either way
                log.warning("operator page: a request with a wrong key (bearer) was refused")
                return None
            # A bearer request is no browser's ambient credential: it needs no CSRF token.
            return Session(key.name, "", 0.0)
        token = ex.cookie()
        session = self.sessions.check(token, self._clock()) if token else None
        # Read per request, from the ledger every replica shares: a logout on any of them
        # ends the session here at once. Only a validly signed token costs a read.
        if session is not None and await self._ledger.session_ended(token_sha256(session.token)):
            return None
        return session

    async def _get(self, ex: Exchange, sub: str, session: Session) -> None:
        csrf = self.sessions.csrf_token(session) if session.token else ""
        if sub == "":
            body = await self._unknown_calls()
        elif sub.startswith("calls/") and sub.count("/") == 1:
            stage, body = await self._call(sub.removeprefix("calls/"), csrf)
            # The link's word only where the ledger agrees: a link sent to the operator,
            # or a tab reloaded after another decided otherwise, claims nothing else.
            done = ex.param("done")
            notice = flash(f"Recorded: {done}.") if done in STAGES and done == stage else ""
            await ex.html(200, page("Call", body, who=session.name, csrf=csrf, notice=notice))
            return
        elif sub == "budgets":
            body = await self._budgets(ex.param("under") or None)
        elif sub == "spend":
            body = await self._spend(ex.param("days"))
        elif sub == "login":
            await ex.redirect(PREFIX)
            return
        else:
            raise Refused(404, "there is no such page")
        await ex.html(200, page("Operator", body, who=session.name, csrf=csrf))

    async def _budgets(self, under: str | None) -> str:
        # A few levels below the node opened, not the whole tree: per-run nodes
        # (team/alice/run-42) add a node with every run, and a page must not read them all.
        # Nor every node a level holds: clients without proxy keys make a root with every
        # budget they name, and the page reads the 500 it lists.
        if under is not None:
            try:  # refused as the CLI's --budget is: a path no budget can have shows nothing
                budgets.validate_path(under)
            except ValueError as exc:
                raise Refused(400, f"under: {exc}") from exc
        depth = budgetpage.BUDGET_LEVELS + (0 if under is None else under.count("/") + 1)
        nodes, count = await self._ledger.budget_tree(under, depth, budgetpage.BUDGET_ROWS)
        return budgetpage.budget_tree(
            nodes, await self._ledger.policies(), under=under, count=count
        )

    async def _unknown_calls(self) -> str:
        # The totals are one aggregate and the list the oldest few, never every call; each
        # still looks at every unknown call (no index gives either): the page's cost grows
        # with them (operations.md, "What it shows").
        stages = await self._ledger.stage_counts()
        total = sum(n for _, stage, n, _, _ in stages if stage == "effect_unknown")
        held = sum(h for _, stage, _, h, _ in stages if stage == "effect_unknown")
        calls = await self._ledger.calls(
            stage="effect_unknown", limit=UNKNOWN_SHOWN, oldest_first=True
        )
        now = self._clock()
        unknown = worklist.unknown_calls(calls, now=now, total=max(total, len(calls)), held=held)
        # The calls in flight of workers not alive only (the live workers, then the others'
        # calls in one read), and only when the counts say a call is in flight at all.
        if not any(stage == "in_flight" for _, stage, n, _, _ in stages if n):
            return unknown
        gone, more = await gone_in_flight(self._ledger, self._lock_dir, GONE_SHOWN)
        return unknown + worklist.gone_owner_calls(gone, now=now, more=more)

    async def _call(self, call_id: str, csrf: str) -> tuple[str, str]:
        """The call's stage as read, and its page."""
        ledger = self._ledger
        try:
            state = await ledger.call(call_id)
        except CallNotFound:
            raise Refused(404, f"there is no call {call_id!r}") from None
        events = await ledger.events(call_id)
        gone = None
        if state.stage == "in_flight":  # only then are the owners read
            gone = (await gone_owners_here(ledger, self._lock_dir, [state])).get(call_id)
        manifest = next((e.data for e in events if e.kind == "call.manifest"), {})
        method, path = str(manifest.get("method", "POST")), str(manifest.get("endpoint", ""))
        lag = lookup_lag(self._providers, state.provider, method, path)
        page = callpage.call_page(
            state, events, now=self._clock(), csrf=csrf, owner_gone=gone, lookup_s=lag
        )
        return state.stage, page

    async def _spend(self, days_text: str | None) -> str:
        asked = parse_count(days_text or "", 366)
        days = 14 if asked is None else min(max(asked, 1), 366)
        now = self._clock()
        since = now - days * DAY_S
        # The database sums the newest calls' money per day, provider and model: the loop
        # lays out a few hundred sums, never 50,000 calls (it served no traffic meanwhile).
        sums = await self._ledger.spend_sums(since, SPEND_CALLS)
        partial = None
        if sums.calls >= SPEND_CALLS and sums.oldest is not None and sums.oldest > since:
            partial = sums.oldest  # the window reaches past the calls read
        table = top_series(spend_table(sums.days, now=now, days=days))
        return spendpage.spend(table, days=days, partial_from=partial)

    # -- state changes ----------------------------------------------------------
    async def _login(self, ex: Exchange) -> None:
        """The login form's POST: the admin key in, a session cookie out."""
        self._check_origin(ex)
        form = await ex.form()
        key = self._admin.key_for(form.get("key", ""))
        target = _local(form.get("next", PREFIX))
        if key is None:
            log.warning("operator page: a login with a wrong key was refused")
            await ex.html(401, login_page("That is not an admin key.", target))
            return
        session = self.sessions.issue(key, self._clock())
        cookie = ex.set_cookie(session.token, int(self.sessions.lifetime_s))
        await ex.redirect(target, (cookie,))

    async def _post(self, ex: Exchange, sub: str, session: Session) -> None:
        form = await ex.form()
        if session.token:  # a cookie: prove the POST comes from this page of this session
            self._check_origin(ex)
            if not self.sessions.csrf_ok(session, form.get("csrf", "")):
                raise Refused(403, "this form is stale or forged (CSRF token); reload the page")
        if sub == "logout":
            if session.token:  # recorded before the cookie is cleared: a failure is a 503
                await self._ledger.end_session(token_sha256(session.token), session.expires)
                log.info("operator %s logged out", session.name)
            await ex.redirect(PREFIX, (ex.set_cookie("", 0),))
        elif sub.startswith("calls/") and sub.endswith("/reconcile") and sub.count("/") == 2:
            call_id = sub.split("/")[1]
            await self._reconcile(ex, call_id, form, session)
        else:
            raise Refused(404, "there is no such action")

    def _check_origin(self, ex: Exchange) -> None:
        if not same_origin(ex.header("origin"), ex.header("referer"), ex.header("host")):
            raise Refused(403, "a state change must come from this page (Origin/Referer)")

    async def _reconcile(
        self, ex: Exchange, call_id: str, form: dict[str, str], session: Session
    ) -> None:
        """Record an operator's decision as ``call.reconciled`` by the admin key's name."""
        decision = form.get("decision", "")
        note = notes.one_line(form.get("note", ""))
        problem, cost, attempt = _read_decision(decision, note, form)
        if problem is None:
            try:
                shown = form.get("owner_gone")
                if (problem := await self._take_over(call_id, session, shown)) is not None:
                    raise ReconcileError(problem, call_id=call_id)
                # The attempt the page showed (none from a script that sends no such field):
                # a decision about it is refused once another attempt has been sent.
                state = await self._ledger.reconcile(
                    call_id,
                    applied=decision == "applied",
                    note=note,
                    by=session.name,
                    cost=cost,
                    attempt=attempt,
                )
            except CallNotFound:
                raise Refused(404, f"there is no call {call_id!r}") from None
            except ReconcileError as exc:
                problem, status = str(exc), 409
            else:
                log.info("operator %s reconciled %s: %s", session.name, call_id, state.stage)
                await ex.redirect(f"{PREFIX}calls/{quote(call_id)}?done={state.stage}")
                return
        else:
            status = 400
        csrf = self.sessions.csrf_token(session) if session.token else ""
        _, body = await self._call(call_id, csrf)
        notice = flash(problem, "error")
        await ex.html(status, page("Call", body, who=session.name, csrf=csrf, notice=notice))

    async def _take_over(self, call_id: str, session: Session, shown: str | None) -> str | None:
        """A call in flight whose owner is gone is taken over first, as ``effectguard
        reconcile`` takes it (the same sweep, the same rule for "gone"); returns why
        nothing may be decided yet: an owner gone by its lease alone may still answer.
        ``shown``: why the page that posted said the owner was gone (None: it did not)."""
        state = await self._ledger.call(call_id)
        why = None
        if state.stage == "in_flight":
            why = (await take_over_gone(self._ledger, self._lock_dir, [state])).get(call_id)
            if why is not None:
                log.info("operator %s took call %s over (%s)", session.name, call_id, why)
        elif state.stage == "effect_unknown":
            # Taken over since the page was shown (another decision, the sweeper): its form
            # said a decision would only take the call over, so it decides nothing either.
            why = shown
        if not may_still_answer(why):
            return None
        then = "look for a late answer on this page (reload it), then decide again"
        return taken_over_not_decided(call_id, str(why), then)

    async def _refused(self, ex: Exchange, refused: Refused) -> None:
        body = f"<h1>{refused.status}</h1><p>{esc(str(refused))}</p>"
        await ex.html(refused.status, page("Refused", body, who=None))


def operator_page(
    admin: AdminSettings,
    ledger: Ledger,
    ledger_url: str,
    providers: Mapping[str, Provider] | None = None,
) -> AdminPage | None:
    """The operator page of a ``serve`` on the ledger at ``ledger_url`` (None without an
    admin key: not mounted at all). It judges the owners of calls in flight by that
    ledger's liveness locks, as ``effectguard show`` and ``reconcile`` do, and the calls'
    lookups by ``serve``'s ``providers``."""
    if not admin.enabled:
        return None
    return AdminPage(admin, ledger, lock_dir=lock_dir_for(ledger_url), providers=providers)


def _read_decision(
    decision: str, note: str, form: dict[str, str]
) -> tuple[str | None, int | None, int | None]:
    """What is wrong with a decision form (None: nothing), its cost, and the attempt the
    page showed (None from a script that sends no ``attempt``)."""
    cost_text = form.get("cost", "").strip()
    attempt_text = form.get("attempt", "")
    if decision not in callpage.DECISIONS:
        return "choose a decision: applied or not applied", None, None
    if not note:
        return "a note is required: say how you know", None, None
    if (bad := notes.unprintable(note)) is not None:
        return f"a note is printable text; it holds {bad!r}", None, None
    number = attempt_text.isascii() and attempt_text.isdigit() and len(attempt_text) <= 9
    if attempt_text and not number:
        return "this form is damaged (its attempt is no number); reload the page", None, None
    attempt = int(attempt_text) if attempt_text else None
    if cost_text and decision != "applied":
        return "a cost goes with applied", None, None
    if not cost_text:
        return None, None, attempt
    try:  # exactly as `effectguard reconcile --cost` reads it
        return None, typed_usd(cost_text, MAX_CALL_NANOS, "a cost"), attempt
    except ValueError as exc:
        return str(exc), None, None


def _back_to(ex: Exchange, sub: str) -> str:
    """Where logging in from a 401's form leads: the page asked for, with its query; for a
    form's POST (its session ended while the operator was deciding), the page that showed
    the form, since the POST's own path is no page."""
    if ex.method in ("GET", "HEAD"):
        query = ex.scope.get("query_string", b"").decode("latin-1")
        path = quote(ex.path)  # decoded by the server: written as a URL again
        return f"{path}?{query}" if query else path
    parts = sub.split("/")
    if len(parts) == 3 and parts[0] == "calls" and parts[2] == "reconcile":
        return f"{PREFIX}calls/{quote(parts[1])}"
    return PREFIX


def _local(target: str) -> str:
    """``target`` if it is a plain path of the page, else the page's root.

    Not an open redirect either way (a path on this host), but a browser resolves the
    ``Location`` before it asks: a dot segment (``..``, ``.%2e``: WHATWG URLs decode
    ``%2e`` there) would lead to the proxy's own paths, a second slash or a backslash (as
    such or percent-encoded) to another host, a control character is stripped by the
    browser or breaks the header. Such a ``next`` is refused whole, not repaired."""
    path = target.partition("?")[0].partition("#")[0]
    decoded = unquote(path)
    plain = (
        target.isascii()
        and target.isprintable()  # also no tab, line break, NUL or DEL
        and target.startswith(PREFIX)
        and "//" not in target
        and "//" not in decoded
        and "\\" not in decoded
        and not {".", ".."} & set(decoded.split("/"))
    )
    return target if plain else PREFIX
