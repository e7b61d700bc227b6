"""Checks of how a SQLite ledger finds a call's events (format 2, migration 10).

A call's events are reached by links, not by an index: the call's row holds its
last event's seq (``calls.last_seq``), each event the seq of the previous event
of its call (``events.call_prev``). The links are not part of any event, so the
hash chain does not cover them; a wrong link would make ``show``, a resend or a
late answer read the wrong events. ``verify`` therefore re-derives every link
from the events' own call ids (:func:`problems`).
"""

from __future__ import annotations

from typing import Any

#: Events whose link is not the previous event of their call. Where an archive deleted
#: that event, the first live event of the call links below the first live seq.
BROKEN_LINKS = """
    SELECT seq, call_prev, want FROM (
        SELECT seq, call_id, call_prev, CASE WHEN call_id IS NOT NULL
            THEN lag(seq) OVER (PARTITION BY call_id ORDER BY seq) END AS want
        FROM events)
    WHERE call_prev IS NOT want AND NOT (
        call_id IS NOT NULL AND want IS NULL
        AND call_prev < (SELECT min(seq) FROM events))
    ORDER BY seq
"""
#: Calls whose row does not name their last event (the call id as events hold it: the
#: 16 bytes of a ``call_`` id, see sqliteevents.call_key).
BROKEN_TAILS = """
    SELECT c.call_id, c.last_seq, m.last FROM calls c LEFT JOIN (
        SELECT CASE WHEN typeof(call_id) = 'blob' THEN 'call_' || lower(hex(call_id))
            ELSE call_id END AS id, max(seq) AS last
        FROM events WHERE call_id IS NOT NULL GROUP BY call_id) m ON m.id = c.call_id
    WHERE c.last_seq IS NOT m.last
    ORDER BY c.call_id
"""


def problems(links: list[Any], tails: list[Any], head: int) -> list[tuple[int, str]]:
    """``(seq, problem)`` for each row of :data:`BROKEN_LINKS` and :data:`BROKEN_TAILS`
    (``head``: the last event's seq, named where a call row points nowhere)."""
    found = [
        (
            int(seq),
            f"event {seq}: links to {prev} as its call's previous event "
            f"(the events say {want}); its call's events would be read wrongly",
        )
        for seq, prev, want in links
    ]
    found += [
        (
            head if want is None else int(want),
            f"call {call_id}: its row names event {got} as its last "
            f"(the events say {want}); its events would be read wrongly",
        )
        for call_id, got, want in tails
    ]
    return found
