"""Rate limits declared while calls are in flight (docs/contract.md §5.6).

Known defect, not yet fixed (see the xfail below): a settlement corrects every window of
its budget path that counts the minute its attempt started, including a window that never
counted that attempt because the node declared no ``rpm``/``tpm`` when it was admitted.
The store (ledger/rates.fold_rates) and verify (ops/audit/rates) apply the same rule, so
``verify`` stays ok; the window's tokens drop below the estimates of the calls it did
count. Telling the two apart needs the window to know when it started counting (a column
of rate_windows, and the same rule in verify), which is a format change.
"""

from __future__ import annotations

import pytest
from clockkit import LedgerTime
from test_rate_limits import _with_tokens, completion, into_a_minute, refused_429, w1
from test_store_contract import admit_ok, clock, ledger, ledger_url, ns, req, store_kind

from effectguard.ledger import Ledger, Writer

_ = (clock, ledger, ledger_url, ns, store_kind, into_a_minute, w1)  # fixtures


@pytest.mark.xfail(
    strict=True,
    reason="a settlement corrects a window that never counted its attempt (module docstring)",
)
async def test_a_call_admitted_before_a_tpm_limit_never_frees_another_calls_tokens(
    ledger: Ledger, w1: Writer, ns: str, into_a_minute: LedgerTime
) -> None:
    """A call admitted before ``tpm`` was declared was never counted in the window, so its
    settlement in the same minute gives back nothing: the estimate of a call admitted
    under the limit still counts, and a third call that would pass the limit is refused."""
    before = await admit_ok(ledger, w1, req(ns, tokens=800))
    await ledger.change_policy(ns, {"tpm": 1000})
    await admit_ok(ledger, w1, req(ns, tokens=800))
    events = completion(before.call_id, f"{ns}/run", 500)
    events[1] = _with_tokens(events[1], 30)
    await ledger.record(w1, before.call_id, 1, events)
    await refused_429(ledger, w1, ns, tokens=300)
