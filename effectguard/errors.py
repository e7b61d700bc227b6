"""The effectguard exception tree.

::

    EffectguardError
    ├── ConfigError                 a provider declaration, flag or config file is wrong
    ├── LedgerError
    │   ├── LedgerUnavailable       a transaction could not commit (503, nothing sent)
    │   ├── FencedError             this worker was taken over; the store refused its write
    │   ├── LedgerCorrupt           the ledger's own checks failed (verify, pragmas)
    │   ├── CallNotFound            no call with that id
    │   ├── BodyMismatch            a spooled request body is not the bytes its manifest names
    │   └── KeyChangeRefused        a proxy key change the ledger refuses (name taken, unknown)
    ├── Refusal                     the guard answers a request without dispatching it
    │                                (status, type, call_id, stage, next_operation)
    └── ReconcileError              a reconcile that the call's stage does not allow

An upstream failure after dispatch is a ``Refusal`` too (502/504, type
``effect_unknown``): the client sees it on the wire like any other answer.

Driver and httpx exceptions are translated at the boundary and raised ``from``
the original. Every error about a call carries its ``call_id``.
"""

from __future__ import annotations


class EffectguardError(Exception):
    """Root of every error effectguard raises."""

    call_id: str | None = None


class ConfigError(EffectguardError):
    """A provider declaration, command-line flag or config file is invalid."""


class LedgerError(EffectguardError):
    """The ledger store failed or refused an operation."""


class LedgerUnavailable(LedgerError):
    """A ledger transaction could not commit; nothing was dispatched."""


class FencedError(LedgerError):
    """The writing worker was fenced: another worker took over its lease."""


class LedgerCorrupt(LedgerError):
    """The ledger failed one of its own integrity checks."""


class CallNotFound(LedgerError):
    """No call with the given id exists in the ledger."""

    def __init__(self, call_id: str) -> None:
        # An archived call is a real call no longer here: say where such calls go, since
        # a 409 `archived` answer names its id.
        super().__init__(
            f"no call {call_id!r} in the ledger (a call `effectguard archive` moved out is "
            "in its archive, not here)"
        )
        self.call_id = call_id


class BodyMismatch(LedgerError):
    """A request body stored by reference is not what its manifest commits to.

    Raised while an admission copies the spooled file into the ledger (the file's bytes
    do not hash to, or are not the size of, the declared SHA-256: nothing is stored), or
    while reading a stored body back whose chunks are not contiguous.
    """

    def __init__(self, message: str, *, call_id: str) -> None:
        super().__init__(message)
        self.call_id = call_id


class KeyChangeRefused(LedgerError):
    """A proxy key change the ledger refuses: a name already in use, an unknown key."""


class Refusal(EffectguardError):
    """The guard refuses a request before (or instead of) dispatching it.

    ``status`` is the HTTP status on the wire and ``type`` the docs/contract.md §9 error type
    (``budget_exceeded``, ``effect_unknown``, ``in_progress`` …).
    """

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        *,
        call_id: str | None = None,
        stage: str | None = None,
        next_operation: str | None = None,
        retryable: bool = False,
        param: str | None = None,
        retry_after: int | None = None,
        model: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.call_id = call_id
        self.stage = stage
        self.next_operation = next_operation
        self.retryable = retryable
        #: The request field a 400 is about (OpenAI's ``param``), if one is.
        self.param = param
        #: Seconds until a retry may succeed (the ``retry-after`` header), if known.
        self.retry_after = retry_after
        #: The model the request named, for the access line of a refusal made before the
        #: request was admitted (``model_not_priced``); never sent on the wire.
        self.model = model


class ReconcileError(EffectguardError):
    """A reconcile that the call's stage does not allow."""

    def __init__(self, message: str, *, call_id: str) -> None:
        super().__init__(message)
        self.call_id = call_id
