"""What an operator's note or a name may hold: printable text that `show`, logs and the
operator page can print as it is (docs/contract.md §8, "Bad input")."""

from __future__ import annotations

import unicodedata

#: Control characters (newlines and terminal escapes among them, which ``show`` would print
#: as they are), line and paragraph separators, and halves of surrogate pairs (a byte that
#: was no UTF-8, as Python reads a command's argument: no ledger can hold one).
_UNPRINTABLE = frozenset({"Cc", "Zl", "Zp", "Cs"})
#: The bidirectional overrides and isolates, which make text read other than it is; and
#: the direction marks (U+200E, U+200F), which reorder the neutral text around them, and
#: the zero-width characters (U+200B-U+200D, U+2060, U+FEFF), which print as nothing: two
#: keys that differ only by one would read alike.
_BIDI = frozenset(
    chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), *range(0x200B, 0x2010), 0x2060)
) | {"\ufeff"}
#: What :func:`terminal_safe` escapes: the above.
_ESCAPED = _UNPRINTABLE


def unprintable(text: str) -> str | None:
    """The first character of ``text`` that a one-line note may not hold, or None."""
    return next((c for c in text if unicodedata.category(c) in _UNPRINTABLE or c in _BIDI), None)


def name_text(raw: str) -> str | None:
    """A name (an operator page key's) as it is kept: trimmed; None if that leaves it
    empty or with a character that is not printable."""
    name = raw.strip()
    return name if name and name.isprintable() else None


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (a textarea's line breaks, tabs) made one space,
    and trimmed: how a note typed into a multi-line box is kept."""
    return " ".join(text.split())


def terminal_safe(text: str, keep: str = "\n\t") -> str:
    """``text`` for a terminal: each character a note may not hold (a control, a
    separator, a direction override or mark, a zero-width character), other than those
    in ``keep``, written as its escape (``\\x9b``, ``\\u202e``). Clients choose much of
    what ``show`` prints (keys, bodies); a terminal acts on some controls, an override or
    a mark reorders what follows, and a zero-width character makes two keys read alike.
    A log line keeps nothing (``keep=""``): one record stays one line."""
    if text.isprintable():
        return text
    return "".join(
        c
        if c in keep or not (unicodedata.category(c) in _ESCAPED or c in _BIDI)
        else c.encode("unicode_escape").decode("ascii")
        for c in text
    )
