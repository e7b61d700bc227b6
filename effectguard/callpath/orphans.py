"""Calls whose caller left before their answer, kept for that caller's own retry.

A client that goes away does not cancel a dispatched call: it is read and settled in the
background (contract.md §3.8). Its caller, an SDK that timed out or lost its connection,
then retries it with ``x-stainless-retry-count`` of 1 or more and no key. While the call
is in flight the retry joins it (§4); once it has settled, the retry used to be new work,
sent again: a second effect and a second charge for one SDK call. So a call whose caller
left is remembered here, in this process, by its budget root and request hash, and the
first key-less declared retry of the same request within the retry window takes it and
is answered with its stored result (a replay).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Final

#: A request as a key-less retry is matched: (budget root, request hash).
RetryKey = tuple[str, str]

#: How many orphans are kept at most: the oldest go first (a retry comes within seconds).
LIMIT: Final = 4096


class Orphans:
    """Call ids whose caller left, by :data:`RetryKey`; each is taken once."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._limit = limit
        self._left: OrderedDict[RetryKey, tuple[str, float]] = OrderedDict()

    def left(self, key: RetryKey | None, call_id: str) -> None:
        """The caller of ``call_id`` (a key-less request matched by ``key``) went away."""
        if key is None:
            return
        self._left.pop(key, None)
        self._left[key] = (call_id, time.monotonic())
        while len(self._left) > self._limit:
            self._left.popitem(last=False)

    def take(self, key: RetryKey, window_s: float) -> str | None:
        """The call a retry matched by ``key`` repeats, if its caller left within
        ``window_s``; it is given to one retry only."""
        found = self._left.pop(key, None)
        if found is None:
            return None
        call_id, when = found
        return call_id if time.monotonic() - when <= window_s else None
