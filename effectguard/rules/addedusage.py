"""The usage chunk effectguard asked a stream for, kept from a client that did not. Pure.

To settle a streamed OpenAI completion from the provider's own usage, effectguard asks for
it (``stream_options.include_usage``, :func:`effectguard.rules.usage.with_stream_usage`)
when the client did not. The provider then sends one more event before ``data: [DONE]``,
whose ``choices`` is empty (null from some OpenAI-compatible servers) and whose ``usage``
is set. The SDKs yield it as one more chunk,
and a client that did not ask for it reads ``chunk.choices[0]`` of every chunk (the loop
the SDKs' own examples write) and fails with ``IndexError`` at the end of a call that was
answered and paid for; one that retries on that error pays again. So the client's stream,
and a replay of it, leave that event out. The ledger keeps the provider's bytes whole.

Only whole events are forwarded: a stream's bytes after its last event boundary wait for
the rest of their event, which is how an SSE reader takes them anyway. Each byte is
joined once and searched a bounded number of times, so a hostile upstream's endless event
costs linear time (and the stream's ``max_answer_bytes`` bounds it).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

__all__ = ["AddedUsage", "without_added_usage"]

#: An event boundary: a blank line, after any of the line ends SSE allows, in any mix
#: (``\n\r\n`` is an LF-ended line, then a CRLF blank line). A CR followed by LF is one
#: line end, never two, so a blank line ended by a CR is known only from the byte after it:
#: the event before it is shown with the next chunk (or at the stream's end).
_BOUNDARY: Final = re.compile(rb"((?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?=[^\n])|\n))")
#: What an added usage event carries (checked before anything is parsed): ``choices``
#: empty, or null as some OpenAI-compatible servers send it. The same single search of
#: each chunk as for empty choices alone: both begin with the literal ``"choices"``.
_EMPTY_CHOICES: Final = re.compile(rb'"choices"\s*:\s*(?:\[\s*\]|null)')
_LINE_END: Final = re.compile(rb"\r\n|\n|\r")
#: The longest boundary, less one: how much of a chunk's end may begin one.
_TAIL: Final = 3


class AddedUsage:
    """Fed a stream's chunks in order, gives back what the client is shown of them."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []  # bytes after the last boundary, not yet shown
        self._tail = b""  # the last bytes fed, where a boundary cut in two may begin

    def feed(self, chunk: bytes) -> bytes:
        """The whole events ``chunk`` completes, the added usage event left out (may be
        empty: the chunk ends inside an event)."""
        if not self._pending and chunk.endswith(b"\n\n"):
            # The usual chunk: whole events, nothing held before it.
            self._tail = chunk[-_TAIL:]
            return without_added_usage(chunk)
        window = self._tail + chunk
        self._tail = window[-_TAIL:]
        held = len(window) - len(chunk)
        # The last boundary that ends in this chunk. One that ended in the tail was cut at,
        # unless its last byte was a CR that ended what was fed: only this chunk's first
        # byte says whether that CR ended a blank line or began a CRLF (see _BOUNDARY).
        cut = max(
            (
                m.end() - held
                for m in _BOUNDARY.finditer(window)
                if m.end() > held or (m.end() == held and window.endswith(b"\r", 0, held))
            ),
            default=-1,
        )
        if cut < 0:
            self._pending.append(chunk)
            return b""
        shown = b"".join((*self._pending, chunk[:cut]))
        self._pending = [chunk[cut:]] if cut < len(chunk) else []
        return without_added_usage(shown)

    def flush(self) -> bytes:
        """What is left at the end of the stream (an event without its blank line)."""
        rest, self._pending = b"".join(self._pending), []
        return without_added_usage(rest)


def without_added_usage(stream: bytes) -> bytes:
    """``stream`` (whole events) without its usage-only events."""
    if not _EMPTY_CHOICES.search(stream):
        return stream  # every chunk but the last: nothing to look at
    parts = _BOUNDARY.split(stream)  # event, boundary, event, boundary, ..., rest
    kept = [
        part
        for event, boundary in zip(parts[0::2], [*parts[1::2], b""], strict=True)
        if not _usage_only(event)
        for part in (event, boundary)
    ]
    return b"".join(kept)


def _usage_only(event: bytes) -> bool:
    """Whether ``event`` is the usage chunk: a JSON object, ``choices`` empty (or null),
    ``usage`` an object (even an empty one: a usage event misshapen, the client's loop
    fails on it all the same)."""
    if not _EMPTY_CHOICES.search(event):
        return False
    data = [
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in _LINE_END.split(event)
        if line.startswith(b"data:")
    ]
    try:
        parsed: Any = json.loads(b"\n".join(data))
    except (ValueError, RecursionError):
        return False
    return (
        isinstance(parsed, dict)
        and parsed.get("choices", 0) in ([], None)
        and isinstance(parsed.get("usage"), dict)
    )
