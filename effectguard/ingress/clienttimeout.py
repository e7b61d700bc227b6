"""A transport caller's httpx timeout, split between the caller and the upstream leg.

httpx hands a request's timeout to its transport (``extensions["timeout"]``: connect,
read, write and pool, in seconds or None), and a plain transport applies it to the
connection. Passed on as it is, a client's short read timeout would end the upstream
read, making a call that is still being answered ``effect_unknown`` (contract.md §3.4).
So the guard's transports split it:

* the upstream leg keeps the client's ``connect`` and ``pool`` (a timeout there proves
  nothing was sent) and reads and writes with effectguard's own timeout;
* the caller waits for the answer to begin at most the longest of its ``connect``,
  ``write`` and ``read`` timeouts that are set (one number, as the SDKs' ``timeout=``
  sets, is that number; all unset is no limit), then gets ``httpx.ReadTimeout`` while
  the call goes on in the background and is settled (contract.md §3.8): a resend with
  the same key gets its answer;
* a streamed answer's caller waits for each next chunk at most its ``read`` timeout,
  as with a plain transport (:class:`~effectguard.ingress.callerstream.CallerStream`):
  a stream that stalls mid-way ends the caller's wait, not the call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The parts of httpx's timeout that bound waiting for an answer to begin.
_WAIT_PARTS = ("connect", "write", "read")


def caller_wait(timeout: Mapping[str, Any] | None) -> float | None:
    """How long the caller waits for an answer to begin; None: as long as it takes."""
    if not timeout:
        return None
    # A part left unset (None) bounds nothing, but does not unbound the others:
    # httpx.Timeout(None, read=0.3) is a 0.3 s wait.
    parts = [float(p) for part in _WAIT_PARTS if (p := timeout.get(part)) is not None]
    return max(parts) if parts else None


def upstream_timeout(timeout: Mapping[str, Any] | None, read_s: float) -> dict[str, Any]:
    """The timeout the upstream leg gets: the client's connect and pool, and ``read_s``
    for reading and writing."""
    given = dict(timeout or {})
    return {
        "connect": given.get("connect"),
        "pool": given.get("pool"),
        "read": read_s,
        "write": read_s,
    }


def caller_read(timeout: Mapping[str, Any] | None) -> float | None:
    """How long the caller waits for each next chunk of a stream; None: no limit."""
    read = (timeout or {}).get("read")
    return None if read is None else float(read)
