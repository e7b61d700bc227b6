"""The proxy keys a replica accepts: the config file's, and the ledger's through a cache.

Keys made with ``effectguard key new`` live in the ledger (as SHA-256 digests). Each
replica keeps a copy of the ledger's key rows and reads them again every
``key_refresh_s`` seconds (default 2 s), so a key created or revoked on any replica
(or by the CLI) is honoured by every replica within about that long, with no
restart. The first read takes every key row; each interval after it reads only the key
events written since the last one it folded (through an index of key events), and folds
them into the copy: a ledger keeps a row for every key name ever made, and reading them
all every interval cost a replica 16% of a core at 100,000 names, and half a second of
stalled requests at each change. An archive step may move out key events the copy has
not read (their rows hold them): once its mark (``meta.archived_through``) has moved, the
next refresh reads every row again. Expiry is judged at each request, so an expiring
key needs no read. The request path is a dict lookup.

A copy that could not be read again is not trusted for long: the ledger's writes may
go on while its reads fail or hang (the reader is a connection of its own on
PostgreSQL), and a replica serving an old copy would accept a revoked key for as long
as that lasts. So a read is given up after ``KEY_READ_WAIT_S``, and once the copy is
older than ``key_refresh_s + KEY_READ_WAIT_S`` a ledger key is refused 503
``ledger_unavailable`` (nothing is sent; the client may retry) until a read succeeds.

Keys in the config file (``[[keys]]``) keep working beside them. Once any key exists,
in the config or ever in the ledger (a revoked one included), every request needs
one: revoking the last key never opens the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from effectguard.callpath import bodies
from effectguard.config.defaults import KEY_READ_WAIT_S
from effectguard.config.settings import ProxyKey, hash_key
from effectguard.errors import LedgerUnavailable, Refusal
from effectguard.ingress.spool import Body
from effectguard.ledger import Ledger
from effectguard.rules import keys, nesting
from effectguard.rules.events import StoredEvent
from effectguard.rules.keys import LedgerKey

log = logging.getLogger("effectguard.ingress.keyring")

_UNKNOWN = "missing or unknown effectguard key"


@dataclass(frozen=True, slots=True)
class Grant:
    """What a presented key may do: its budget root and its restrictions."""

    name: str
    budget_root: str
    metrics: bool = False
    models: tuple[str, ...] | None = None
    providers: tuple[str, ...] | None = None

    def check(self, provider: str, body: Body, content_type: str | None) -> None:
        """Refuse (403) a provider or a body's model outside this key's restrictions."""
        if self.providers is not None and provider not in self.providers:
            raise Refusal(
                403,
                "provider_forbidden",
                f"this key may not call provider {provider!r} "
                f"(allowed: {', '.join(self.providers)})",
            )
        spool_path = body.spool.path if body.spool is not None else None
        if self.models is None or not (body.data or spool_path):
            return  # a bodiless request (e.g. a GET) chooses no model
        allowed = ", ".join(self.models)
        try:
            model = _model_of(body.data, content_type, spool_path)
        except bodies.Malformed as exc:  # say why, rather than "names no model"
            raise Refusal(
                403,
                "model_forbidden",
                f"this key may only call {allowed}, and this request names no model "
                f"it could read: {exc}",
            ) from exc
        if model not in self.models:
            named = "names no model" if model is None else f"asks for model {model!r}"
            raise Refusal(
                403,
                "model_forbidden",
                f"this request {named}; this key may only call {allowed}",
            )


def _model_of(body: bytes, content_type: str | None, spool_path: str | None) -> str | None:
    """The ``model`` the body names as the guard reads it to price the call (a JSON
    field, or a form or multipart field: an upload is priced by its ``model`` part, so a
    key allowed that model must be able to send it); None when it names none, names it
    twice (the guard refuses that anyway) or is not JSON; :class:`bodies.Malformed` when
    a form or multipart body does not parse as one."""
    kind = bodies.kind_of(content_type)
    if kind == "json":
        return _json_model(body)
    named: list[str | None]
    if kind == "form":
        named = [value for name, value in bodies.parse_form(body) if name == "model"]
    else:
        ctype = content_type or ""
        parts = (
            bodies.parse_multipart(body, ctype)
            if spool_path is None
            else bodies.parse_multipart_file(spool_path, ctype)
        )
        named = [part.value for part in parts if part.name == "model"]
    return named[0] if len(named) == 1 and isinstance(named[0], str) else None


def _json_model(body: bytes) -> str | None:
    """The ``model`` a JSON request body names (None when it names none or is not JSON)."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or deeper than the parser's stack
        return None
    # A body nested past the limit names no model either, whatever this interpreter's
    # parser can read (3.13's reads 5,000 levels where 3.11's gives up): the answer to
    # such a body is one 403, the same on every Python.
    if nesting.depth_exceeds(parsed):
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


def _from_config(key: ProxyKey) -> Grant:
    return Grant(key.name, key.budget_root, key.metrics)


def _from_ledger(row: LedgerKey) -> Grant:
    return Grant(row.name, row.budget_root, False, row.models, row.providers)


@dataclass(frozen=True, slots=True)
class _Read:
    """What one refresh read: the rows the events fold into (every row, when ``whole``),
    the key events after ``seq``, and the archive's mark as it read them."""

    rows: dict[str, LedgerKey]
    seq: int
    through: int
    events: list[StoredEvent]
    whole: bool


class KeyRing:
    """Answers "which key is this?" from the config's keys and a cached copy of the ledger's."""

    def __init__(
        self,
        config_keys: tuple[ProxyKey, ...],
        refresh_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = {k.sha256: _from_config(k) for k in config_keys}
        #: Each digest's rows (a secret made twice under two names has two).
        self._ledger: dict[str, tuple[LedgerKey, ...]] = {}
        self._rows: dict[str, LedgerKey] = {}  # the same rows, by name
        self._seq: int | None = None  # the last key event folded in (None: none read yet)
        self._through = 0  # the archive's mark (meta.archived_through) when they were read
        self._ledger_ever = False
        self._refresh_s = refresh_s
        self._clock = clock
        self._read_at = time.monotonic()  # of the copy held: set again by each refresh
        self._task: asyncio.Task[None] | None = None

    @property
    def required(self) -> bool:
        """Whether requests need a key (some key exists, or ever existed in the ledger)."""
        return bool(self._config) or self._ledger_ever

    async def refresh(self, ledger: Ledger) -> None:
        """Read the ledger's key rows again (replacing the copy in one step).

        Raises :class:`LedgerUnavailable` when the read fails or takes longer than
        ``KEY_READ_WAIT_S``: giving it up cancels it, and a PostgreSQL connection whose
        read is cancelled unanswered is closed, so the next read gets a new one.
        """
        started = time.monotonic()
        try:
            async with asyncio.timeout(KEY_READ_WAIT_S):  # every read of one refresh
                read = await self._read(ledger)
        except TimeoutError as exc:
            raise LedgerUnavailable(
                f"reading the proxy keys took longer than {KEY_READ_WAIT_S:g} s"
            ) from exc
        if read.events or read.whole:
            changed = keys.folded(read.rows, read.events)
            if read.whole:
                self._ledger = keys.by_digest(changed.values())
            else:
                names = {e.data.get("name") for e in read.events}
                fresh = (changed[n] for n in names if n in changed)
                self._ledger = keys.regrouped(self._ledger, read.rows, fresh)
            self._rows, self._through = changed, read.through
            self._seq = read.events[-1].seq if read.events else read.seq
            self._ledger_ever = self._ledger_ever or bool(changed)
        self._read_at = started  # the copy holds what the ledger held when the read began

    async def _read(self, ledger: Ledger) -> _Read:
        """The key events since the copy's last, or every row when there is no copy yet or
        an archive has moved events out since the last read (it may have taken key events
        this copy never read: their rows hold them)."""
        if self._seq is not None:
            events = await ledger.key_events_since(self._seq)
            # Read after the events: an archive that moved any out before has moved it.
            if await ledger.archived_through() == self._through:
                return _Read(self._rows, self._seq, self._through, events, whole=False)
        # The mark as it was before the rows: an archive step that commits during this read
        # moves it, so the next refresh reads every row again. This read is not retried for
        # it: the rows hold every key event written before they were read (and the events
        # after ``seq`` fold in again, rules/keys.folded), so the copy lacks at most events
        # written after the read began, as any copy does until the next refresh. Retried,
        # a read of 100,000 rows never finished between the steps of an archive in small
        # steps, and the replica refused its ledger keys 503 for as long as it ran.
        through = await ledger.archived_through()
        seq = await ledger.key_events_high()
        rows = {row.name: row for row in await ledger.keys()}
        events = await ledger.key_events_since(seq)
        return _Read(rows, seq, through, events, whole=True)

    async def start(self, ledger: Ledger) -> None:
        """Load the keys (before the first request is served), then refresh them periodically."""
        await self.refresh(ledger)
        self._task = asyncio.create_task(self._run(ledger), name="effectguard-key-refresh")

    async def stop(self) -> None:
        """Stop refreshing."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self, ledger: Ledger) -> None:
        failing = False
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh(ledger)
            except Exception as exc:
                if not failing:  # once per outage; never names a key
                    log.warning(
                        "proxy keys not refreshed (ledger keys are refused 503 from %g s "
                        "after the last read until one succeeds): %s",
                        self._refresh_s + KEY_READ_WAIT_S,
                        exc,
                    )
                failing = True
            else:
                if failing:
                    log.warning("proxy keys read again; ledger keys are accepted again")
                failing = False

    def authenticate(self, presented: str | None) -> Grant:
        """The grant of ``presented``; 401 ``unknown_key`` if unknown, revoked or expired."""
        if not presented:
            raise Refusal(401, "unknown_key", _UNKNOWN)
        digest = hash_key(presented)
        grant = self._config.get(digest)
        rows = self._ledger.get(digest)
        if rows is None and grant is not None:
            return grant
        # A config key that is also a ledger key (one secret in both) keeps the config's
        # grant, but the ledger's revocation or expiry ends it: a revocation never opens.
        self._check_fresh()
        if rows is None:
            raise Refusal(401, "unknown_key", _UNKNOWN)
        now = self._clock()
        row = next((r for r in rows if not r.ended(now)), rows[0])
        ended = row.ended(now)
        if ended == "expired":
            raise Refusal(401, "unknown_key", "this effectguard key has expired")
        if ended == "revoked":
            raise Refusal(401, "unknown_key", "this effectguard key was revoked")
        return _from_ledger(row) if grant is None else grant

    def _check_fresh(self) -> None:
        """Refuse (503) to judge a ledger key by a copy too old to show a revocation in
        time: the key may have been revoked (or made) since, and nothing says which."""
        age = time.monotonic() - self._read_at
        if age > self._refresh_s + KEY_READ_WAIT_S:
            raise Refusal(
                503,
                "ledger_unavailable",
                f"this replica has not been able to read the proxy keys from the ledger "
                f"for {age:.0f} s, so it cannot tell whether this key is still valid; "
                "nothing was sent, retry later",
                retryable=True,
            )


#: Headers every current browser adds to a request a web page makes, and that agents,
#: SDKs and command-line clients do not send.
_BROWSER_HEADERS = (b"origin", b"sec-fetch-site", b"sec-fetch-mode")


def bearer_token(value: str) -> str:
    """The credential in an ``Authorization`` value: after a ``Bearer`` scheme, in any case
    (auth schemes are case-insensitive, RFC 9110 §11.1), or the value itself."""
    value = value.strip()
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else value


def refuse_browsers(headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse (403 ``browser_forbidden``) a request a web browser made, where no key is
    needed: any web page the operator visits could otherwise spend through the proxy,
    with the provider keys it holds (a form or ``fetch`` to 127.0.0.1 needs no CORS
    permission to be sent), and after a DNS rebinding read the answers too."""
    for name, _ in headers:
        if name.lower() in _BROWSER_HEADERS:
            raise Refusal(
                403,
                "browser_forbidden",
                "a request from a web browser (it sent "
                f"{name.decode('latin-1')!r}) is refused while no proxy keys are configured",
            )
