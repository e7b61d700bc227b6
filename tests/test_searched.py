"""Whether a lookup's "not found" can prove a call "not applied": the pure rule, without a
ledger (rules/searched). The same rule, through ``reconcile --auto`` and real processes,
is in test_reconcile_auto.py."""

from __future__ import annotations

import pytest

from effectguard.rules.admission import Sending
from effectguard.rules.searched import blind_spot

OP = "json metadata.effectguard_op"
URL = "https://api.example.com"
KEY = "0123456789abcdef"


def asked(attempts: list[Sending], *, by_key: bool = False, url: str = URL) -> str | None:
    return blind_spot(attempts, op_id_in=OP, by_key=by_key, base_url=url, key_digest=KEY)


def test_a_call_every_attempt_of_which_went_where_and_as_the_lookup_asks_can_be_decided() -> None:
    assert asked([Sending(OP, URL, KEY)]) is None
    assert asked([Sending(OP, URL, KEY), Sending(OP, URL, KEY)]) is None


@pytest.mark.parametrize(
    ("attempts", "why"),
    [
        ([], "no attempt of the call is recorded"),
        ([Sending(None, URL, KEY)], "carrying the operation id searched for"),
        ([Sending(OP, URL, KEY), Sending("form other", URL, KEY)], "carrying the operation id"),
        ([Sending(OP)], "sent to: (not recorded)"),  # an attempt of the previous format
        ([Sending(OP, "http://relay", KEY)], f"this lookup asks {URL}"),
        ([Sending(OP, URL, KEY), Sending(OP, "http://relay", KEY)], "sent to: http://relay"),
        ([Sending(OP, URL, None)], "another credential"),  # the call carried none
        ([Sending(OP, URL, "fedcba9876543210")], "another credential"),
    ],
)
def test_a_search_that_may_have_looked_elsewhere_proves_nothing(
    attempts: list[Sending], why: str
) -> None:
    reason = asked(attempts)
    assert reason is not None and why in reason, reason


def test_a_lookup_by_idempotency_key_needs_no_operation_id_but_the_same_place() -> None:
    assert asked([Sending(None, URL, KEY)], by_key=True) is None
    reason = asked([Sending(None, URL, KEY)], by_key=True, url="http://relay")
    assert reason is not None and "this lookup asks http://relay" in reason
