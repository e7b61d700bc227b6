"""The usage chunk effectguard asked a stream for, kept from a client that did not. Pure.

To settle a streamed OpenAI completion from the provider's own usage, effectguard asks for
it (``stream_options.include_usage``, :func:`effectguard.rules.usage.with_stream_usage`)
when the client did not. The provider then sends one more event before ``data: [DONE]``,
whose ``choices`` is empty (null, or no key at all, from some OpenAI-compatible servers)
and whose ``usage`` is set. The SDKs yield it as one more chunk, and a client that did not
ask for it reads ``chunk.choices[0]`` of every chunk (the loop the SDKs' own examples
write) and fails at the end of a call that was answered and paid for; one that retries on
that error pays again. So the client's stream, and a replay of it, leave that event out,
and with it the last event before ``[DONE]`` when its data is not JSON: the usage event
cut short or garbled (the SDK would raise its JSON error on it). Whether an event that is
not JSON is that last one is known at the next event only, so it waits for it; every
other event is shown as soon as it is whole. The ledger keeps the provider's bytes whole.

An event whose bytes hold a choice (``"choices":[{``, every content event) is shown
without being parsed: only the few others are decoded.

Only whole events are forwarded: a stream's bytes after its last event boundary wait for
the rest of their event, which is how an SSE reader takes them anyway. Each byte is
joined once and searched a bounded number of times, so a hostile upstream's endless event
costs linear time (and the stream's ``max_answer_bytes`` bounds it).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final, Literal

__all__ = ["AddedUsage", "without_added_usage"]

#: An event boundary: a blank line, after any of the line ends SSE allows, in any mix
#: (``\n\r\n`` is an LF-ended line, then a CRLF blank line). A CR followed by LF is one
#: line end, never two, so a blank line ended by a CR is known only from the byte after it:
#: the event before it is shown with the next chunk (or at the stream's end).
_BOUNDARY: Final = re.compile(rb"((?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?=[^\n])|\n))")
#: A choice in an event's bytes: the client's loop has its ``choices[0]``, so the event is
#: shown unread. Inside a JSON string a quote is escaped, so this is a key (at some depth).
#: OpenAI's compact spelling is looked for first, as bytes: a regular expression costs
#: several times more on every chunk.
_CHOICE: Final = re.compile(rb'"choices"\s*:\s*\[\s*\{')
_COMPACT_CHOICE: Final = b'"choices":[{'
_LINE_END: Final = re.compile(rb"\r\n|\n|\r")
#: The longest boundary, less one: how much of a chunk's end may begin one.
_TAIL: Final = 3

#: What an event is to the filter: the usage event; ``[DONE]``; data that is not JSON;
#: no data at all (a comment, a lone ``event:``); anything else (shown).
_Kind = Literal["usage", "done", "not-json", "no-data", "other"]


class AddedUsage:
    """Fed a stream's chunks in order, gives back what the client is shown of them."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []  # bytes after the last boundary, not yet shown
        self._tail = b""  # the last bytes fed, where a boundary cut in two may begin
        #: An event that is not JSON (with its boundary), and the events without data
        #: after it: shown at the next event with data, unless that one is ``[DONE]``.
        self._held: list[bytes] = []

    def feed(self, chunk: bytes) -> bytes:
        """The whole events ``chunk`` completes, the added usage event left out (may be
        empty: the chunk ends inside an event, or an event waits for the next one)."""
        if (
            not self._pending
            and not self._held
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk[-1] == 0x0A
            and chunk.find(b"\r") < 0
            and (chunk.find(_COMPACT_CHOICE) >= 0 or _CHOICE.search(chunk))
        ):
            # The usual chunk (one event of one line, ended by LFs, nothing before it)
            # holding a choice. Each test is one scan in C: a regular expression's scan
            # costs far more on a large event.
            self._tail = chunk[-_TAIL:]
            return chunk
        window = self._tail + chunk
        self._tail = window[-_TAIL:]
        held = len(window) - len(chunk)
        cut = _last_boundary(window, held)
        if cut < 0:
            self._pending.append(chunk)
            return b""
        whole = b"".join((*self._pending, chunk[:cut]))
        self._pending = [chunk[cut:]] if cut < len(chunk) else []
        return self._shown(whole)

    def flush(self) -> bytes:
        """What is left at the end of the stream (an event without its blank line, and an
        event that waited for a next one that never came)."""
        rest, self._pending = b"".join(self._pending), []
        shown = self._shown(rest)
        held, self._held = self._held, []
        return shown + b"".join(held)

    def _shown(self, stream: bytes) -> bytes:
        """What the client is shown of ``stream``'s events (the last may lack its blank
        line), each judged in order."""
        out: list[bytes] = []
        for event, boundary in _events(stream):
            if not event and not boundary:
                continue  # the empty rest after the last boundary
            if event.find(_COMPACT_CHOICE) >= 0 or _CHOICE.search(event):
                kind: _Kind = "other"
            else:
                kind = _kind(event)
            if kind == "no-data" and self._held:
                self._held += (event, boundary)
                continue
            held, self._held = self._held, []
            if kind == "done":
                held = held[2:]  # the last event before [DONE] was not JSON: left out
            out += held
            if kind == "not-json":
                self._held = [event, boundary]
            elif kind != "usage":
                out += (event, boundary)
        return b"".join(out)


def _events(stream: bytes) -> zip[tuple[bytes, bytes]]:
    """``stream``'s events, each with the boundary after it (the last: ``b""``, after the
    rest). Of LF-ended lines the boundaries are LF pairs from the left, as _BOUNDARY reads
    them: one split in C, where the regular expression's scan costs far more."""
    if stream.find(b"\r") < 0:
        events = stream.split(b"\n\n")
        boundaries = [b"\n\n"] * (len(events) - 1)
    else:
        parts = _BOUNDARY.split(stream)  # event, boundary, event, boundary, ..., rest
        events, boundaries = parts[0::2], parts[1::2]
    boundaries.append(b"")
    return zip(events, boundaries, strict=True)


def _last_boundary(window: bytes, held: int) -> int:
    """Where in the chunk (``window`` less its first ``held`` bytes, the tail before it)
    the last boundary that ends in it ends; -1 if none does.

    One that ended in the tail was cut at, unless its last byte was a CR that ended what
    was fed: only this chunk's first byte says whether that CR ended a blank line or began a
    CRLF (see _BOUNDARY). Of LF-ended lines, the last LF pair is that boundary when no LF
    comes right before it (a longer run is paired from its start), found in one scan.
    """
    if window.find(b"\r") < 0:
        at = window.rfind(b"\n\n")
        if at < 0:
            return -1
        if at == 0 or window[at - 1] != 0x0A:
            return at + 2 - held if at + 2 > held else -1
    return max(
        (
            m.end() - held
            for m in _BOUNDARY.finditer(window)
            if m.end() > held or (m.end() == held and window.endswith(b"\r", 0, held))
        ),
        default=-1,
    )


def without_added_usage(stream: bytes) -> bytes:
    """``stream`` (whole events) without the usage event, as :class:`AddedUsage` shows it."""
    shown = AddedUsage()
    return shown.feed(stream) + shown.flush()


def _kind(event: bytes) -> _Kind:
    """What ``event`` is (see :data:`_Kind`). The usage event: a JSON object whose
    ``choices`` is empty, null or absent and whose ``usage`` is an object (even an empty
    one: a usage event misshapen, the client's loop fails on it all the same)."""
    lines = [
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in _LINE_END.split(event)
        if line.startswith(b"data:")
    ]
    if not lines:
        return "no-data"
    data = b"\n".join(lines)
    if data == b"[DONE]":
        return "done"
    try:
        parsed: Any = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return "not-json"
    if (
        isinstance(parsed, dict)
        and parsed.get("choices") in ([], None)
        and isinstance(parsed.get("usage"), dict)
    ):
        return "usage"
    return "other"
