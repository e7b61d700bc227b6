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

#: How many orphans are kept at most (a retry comes within seconds). Past it the oldest
#: of the budget root holding the most goes first, so one tenant whose clients leave in
#: bulk cannot push out another's and turn its SDK's retry into a second effect.
LIMIT: Final = 4096


class Orphans:
    """Call ids whose caller left, by :data:`RetryKey`; each is taken once."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._limit = limit
        self._count = 0
        #: By budget root, then request hash, oldest first.
        self._left: dict[str, OrderedDict[str, tuple[str, float]]] = {}

    def left(self, key: RetryKey | None, call_id: str) -> None:
        """The caller of ``call_id`` (a key-less request matched by ``key``) went away."""
        if key is None:
            return
        root, request_hash = key
        calls = self._left.setdefault(root, OrderedDict())
        if calls.pop(request_hash, None) is None:
            self._count += 1
        calls[request_hash] = (call_id, time.monotonic())
        if self._count > self._limit:
            self._evict()

    def _evict(self) -> None:
        # Roots are few (one per proxy key's root), so a scan is cheap; it runs only past
        # the limit.
        root, calls = max(self._left.items(), key=lambda item: len(item[1]))
        calls.popitem(last=False)
        self._count -= 1
        if not calls:
            del self._left[root]

    def take(self, key: RetryKey, window_s: float) -> str | None:
        """The call a retry matched by ``key`` repeats, if its caller left within
        ``window_s``; it is given to one retry only."""
        root, request_hash = key
        calls = self._left.get(root)
        found = None if calls is None else calls.pop(request_hash, None)
        if found is None:
            return None
        self._count -= 1
        if not calls:
            del self._left[root]
        call_id, when = found
        return call_id if time.monotonic() - when <= window_s else None
