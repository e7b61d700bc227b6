"""An application's reconcile hook, as the proxy imports it (``hookapp:answer``).

It recognises its own requests by amount: 1 was sent (it is in the outbox), 2 was not,
3 makes the hook fail, anything else it cannot tell.
"""

from __future__ import annotations

import json
from decimal import Decimal

from effectguard import Applied, NotApplied, ReconcileQuestion, Unknown
from effectguard.callpath.hooks import HookAnswer


async def answer(question: ReconcileQuestion) -> HookAnswer:
    """Applied (with a cost and the stored result), not applied, a failure, or unknown."""
    amount = json.loads(question.request).get("amount")
    if amount == 1:
        return Applied(Decimal("0.02"), {"id": "from-outbox", "op": question.op_id})
    if amount == 2:
        return NotApplied()
    if amount == 3:
        raise RuntimeError("the outbox is down")
    return Unknown()
