"""A provider's redirect as the proxy passes it on (docs/contract.md §1.4).

The proxy follows no redirect. A ``3xx`` whose ``Location`` is on the provider's origin,
below its base URL, gets the proxy's own path for that provider instead
(:func:`~effectguard.rules.redirects.proxy_location`): an SDK that follows redirects by
itself then sends its repeat through the guard, a call of its own. A ``Location``
anywhere else is passed on as it came, and a warning names it, since a client that
follows it leaves the guard. Only a ``3xx`` answer is looked at: no cost on any other.
"""

from __future__ import annotations

import logging

from effectguard.callpath.exchange import Reply
from effectguard.callpath.wire import CALL_ID_HEADER
from effectguard.rules.redirects import proxy_location, shown_location

log = logging.getLogger("effectguard.ingress.server")

_LOCATION = b"location"


def guarded_redirect(reply: Reply, sent_to: str, base_url: str, mount: str) -> None:
    """Rewrite ``reply``'s ``Location`` (a ``3xx`` from the provider at ``base_url``, for a
    request sent to ``sent_to``) to the proxy's path under ``mount``, or log it."""
    kept = []
    for name, value in reply.headers:
        if name.lower() == _LOCATION:
            location = value.decode("latin-1")
            proxied = proxy_location(location, sent_to, base_url, mount)
            if proxied is None:
                _passed_on(reply, location)
            else:
                value = proxied.encode("latin-1")
        kept.append((name, value))
    reply.headers = kept


def _passed_on(reply: Reply, location: str) -> None:
    call_id = reply.header(CALL_ID_HEADER)
    shown = shown_location(location)
    log.warning(
        "a %d redirect to %s was passed on as it came: a client that follows it "
        "leaves the proxy (call %s)",
        reply.status,
        shown,
        call_id or "-",
        extra={"event": "redirect_passed_on", "call_id": call_id, "location": shown},
    )
