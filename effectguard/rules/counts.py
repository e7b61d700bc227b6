"""A count written as text (a header, a query parameter, a TOML key), read safely.

``str.isdigit()`` accepts characters ``int()`` refuses (``'²'``) and ``int()`` refuses
strings of more than 4,300 digits: either check alone let hostile text raise far from
where it came in.
"""

from __future__ import annotations


def parse_count(text: str, most: int) -> int | None:
    """``text`` as a count if it is ASCII digits, else None; a count above ``most`` is
    returned as ``most + 1``, so "too many" stays known without reading a huge number."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0")
    if len(digits) > len(str(most)):
        return most + 1
    return min(int(digits or "0"), most + 1)
