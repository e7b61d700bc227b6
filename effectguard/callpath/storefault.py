"""What a client is told when the ledger fails, and what the proxy's log keeps of it.

A store's error text is for the operator: PostgreSQL's quotes the statement that failed
(``LINE 1: ...``, over several lines), which a client has no use for and should not see.
A refusal (503 ``ledger_unavailable``, 502 ``observe_failed``) carries only the text's
first line; the whole text goes to the log (docs/logs-and-traces.md, ``ledger_failed``).
"""

from __future__ import annotations

import logging

log = logging.getLogger("effectguard.ledger")

#: The most of a ledger error's text a client is told.
MAX_TOLD = 200


def told(exc: BaseException, call_id: str | None = None) -> str:
    """The text of ``exc`` a client may read: its first line, at most :data:`MAX_TOLD`
    characters. What that leaves out is logged, whole, naming ``call_id`` if given."""
    text = str(exc) or type(exc).__name__
    first = text.splitlines()[0].strip() if text.strip() else type(exc).__name__
    short = first if len(first) <= MAX_TOLD else first[: MAX_TOLD - 1] + "…"
    if short != text:
        fields = {"event": "ledger_failed"} | ({"call_id": call_id} if call_id else {})
        log.warning("ledger failed: %s", text, extra=fields)
    return short


def brief(exc: BaseException) -> str:
    """``exc`` in one line for an incident (the log's): its type and message, at most
    300 characters."""
    return f"{type(exc).__name__}: {exc}"[:300]
