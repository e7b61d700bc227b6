"""An application's reconcile hook, as the proxy imports it (``hookapp:answer``).

It recognises its own requests by amount: 1 was sent (it is in the outbox), 2 was not,
3 makes the hook fail, 4 makes it hang (past any timeout), 5 to 8 make it answer
something that is no answer (``WRONG``), anything else it cannot tell.
"""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

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
    if amount == 4:
        await asyncio.sleep(3600)
    if amount in WRONG:
        return WRONG[amount]  # type: ignore[no-any-return]
    return Unknown()


#: Answers that are no answer: not one of the three, a float cost, a negative cost, a
#: result that is not JSON.
WRONG: dict[int, Any] = {
    5: "yes, it was sent",
    6: Applied(0.02, {"id": "from-outbox"}),  # type: ignore[arg-type]
    7: Applied(Decimal("-1"), {"id": "from-outbox"}),
    8: Applied(Decimal("0.02"), {"id": object()}),
}
