"""The hash chain's digest of one event: SHA-256 over its header, its data's canonical
JSON and its predecessor's digest. Pure. Part of the ledger format: every stored digest
was made by :func:`event_digest`, and ``verify`` remakes them with it."""

from __future__ import annotations

import hashlib

__all__ = ["credential_digest", "event_digest"]


def event_digest(
    *,
    seq: int,
    kind: str,
    call_id: str | None,
    data_json: str,
    worker: str,
    generation: int,
    at: float,
    prev_digest: str,
) -> str:
    """SHA-256 over an event's content and its predecessor's digest."""
    # One update of the same bytes. An operation's events share their ``at`` object,
    # whose repr (the costliest part of the header) is then made once.
    global _at_repr
    last_at, at_text = _at_repr
    if last_at is not at:
        at_text = repr(at)
        if type(at) is float:  # immutable, and held here, so its id is not reused
            _at_repr = (at, at_text)
    text = f"{seq}\x1f{kind}\x1f{call_id or ''}\x1f{worker}\x1f{generation}\x1f{at_text}\x1f"
    if len(data_json) < _LARGE:
        return hashlib.sha256(
            prev_digest.encode("ascii") + (text + data_json).encode("utf-8")
        ).hexdigest()
    # The same bytes in three updates: a large answer's JSON is then encoded once, not
    # also concatenated as text and as bytes (two more copies of it at once).
    digest = hashlib.sha256(prev_digest.encode("ascii") + text.encode("utf-8"))
    digest.update(data_json.encode("utf-8"))
    return digest.hexdigest()


#: Data JSON this long is digested without concatenating it (1 MiB: far above any usual event).
_LARGE = 1 << 20


#: The last ``at`` digested and its repr (by identity: 0.0 and -0.0 are equal, not alike).
_at_repr: tuple[object, str] = (object(), "")


def credential_digest(credential: str) -> str:
    """What an attempt records of the credential header it carried (``attempt.started``'s
    ``key_digest``): 16 hex digits of its SHA-256, enough to tell two keys apart, and
    nothing to sign a request with."""
    return hashlib.sha256(credential.encode()).hexdigest()[:16]
