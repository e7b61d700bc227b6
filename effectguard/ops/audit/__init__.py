"""An independent verifier of the ledger (``effectguard verify``).

It trusts nothing the producer computes. From :mod:`effectguard.rules.events` it
shares only what every reader of the ledger must agree on: how a stored event is
decoded (:class:`~effectguard.rules.events.StoredEvent`) and how its digest is
made (``canonical_json``, ``event_digest``). Everything else is its own: the table
of legal event sequences per call (:mod:`.table`), the writer rules (:mod:`.writers`),
the budget arithmetic (:mod:`.budgets`), the rate windows (:mod:`.rates`), the bodies
stored by reference (:mod:`.bodies`), each call's projection (:mod:`.calls`), the
comparison with what the store keeps (:mod:`.verifier`), and the proof of an archived
range with its own notion of a final call (:mod:`.archived`). A test imports these
modules in a fresh interpreter and refuses any other effectguard module they load, directly
or not, so a bug in the store's fold cannot hide itself by being folded the same way twice.

Modules here are pure: plain values in (stored events and stored rows), a
:class:`~.report.VerifyReport` out. Reading the ledger is :mod:`effectguard.ops.verify`'s job.
"""

from __future__ import annotations

from effectguard.ops.audit.bodies import BodyRow
from effectguard.ops.audit.keys import KeyRow
from effectguard.ops.audit.rates import RateRow
from effectguard.ops.audit.report import VerifyReport
from effectguard.ops.audit.verifier import (
    BudgetRow,
    CallColumns,
    PolicyRow,
    Verifier,
    WorkerRow,
)

__all__ = [
    "BodyRow",
    "BudgetRow",
    "CallColumns",
    "KeyRow",
    "PolicyRow",
    "RateRow",
    "Verifier",
    "VerifyReport",
    "WorkerRow",
]
