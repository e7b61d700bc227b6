"""An attempt's request as it leaves (docs/contract.md §3.3, §7).

Built from what admission recorded: the call id as the operation id, the provider
idempotency key the attempt was started with. And never sent past the lease it was
admitted under: a worker that stood still since (a pause, a suspended machine) may have
been taken over, its call decided not applied by a lookup and sent by another worker.
"""

from __future__ import annotations

import time

from effectguard.callpath.exchange import Outbound
from effectguard.callpath.prepare import Prepared
from effectguard.callpath.wire import upstream_request
from effectguard.ledger import Admitted


def outgoing_request(prepared: Prepared, admitted: Admitted) -> Outbound:
    """The attempt's request as it goes upstream, carrying the call id as its operation id."""
    key, body = admitted.provider_idempotency_key, prepared.body
    return upstream_request(prepared.request, body, prepared.endpoint, key, admitted.call_id)


def past_lease(admitted: Admitted) -> bool:
    """Whether the lease ``admitted`` was recorded under has lapsed by now (wall clock,
    which counts a suspended machine's sleep, as a monotonic clock does not)."""
    return admitted.send_by is not None and time.time() >= admitted.send_by
