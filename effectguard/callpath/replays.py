"""A call's stored answer, replayed to a request that repeats it (a keyed resend, a
joined retry): as the call's first client was shown it."""

from __future__ import annotations

import dataclasses

from effectguard.callpath.exchange import Reply
from effectguard.callpath.prepare import Prepared
from effectguard.callpath.wire import replay_response
from effectguard.rules.addedusage import without_added_usage
from effectguard.rules.events import AttemptObserved


def replay(call_id: str, observed: AttemptObserved | None, prepared: Prepared) -> Reply:
    """The stored answer of ``call_id`` for ``prepared``'s request, marked as a replay.

    The ledger keeps the provider's bytes whole; a stream effectguard asked for its usage
    is replayed without the usage event, as it was first forwarded (rules/addedusage):
    ``prepared`` repeats the call's request, so it was amended as the call's was.
    """
    reply = replay_response(call_id, observed, prepared.provider.error_shape)
    if prepared.usage_added and reply.body is not None:
        reply = dataclasses.replace(reply, body=without_added_usage(reply.body))
    return reply
