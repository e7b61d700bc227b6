"""The fold a replica's key refresh makes (rules/keys.folded, regrouped), without a store.

A replica reads every key row once, then only the key events written after the last one
it folded. The rows it read may already hold some of those events (they were written
while it read), so folding again from an earlier seq must leave them as the ledger
has them; and regrouping only the changed rows by digest must give what grouping every
row would.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from effectguard.rules import keys
from effectguard.rules.events import StoredEvent

NAMES = ["a", "b", "c"]
DIGESTS = ["1" * 64, "2" * 64]


def _history(steps: list[tuple[str, int, int]]) -> list[StoredEvent]:
    """Valid key events from ``steps`` (op, name index, digest index): a create of a name
    with no live key, a revocation of a live one; the other steps are skipped, as the
    ledger refuses them."""
    live: set[str] = set()
    out: list[StoredEvent] = []
    for op, n, d in steps:
        name = NAMES[n]
        if op == "create" and name not in live:
            kind, data = "key.created", {"name": name, "sha256": DIGESTS[d], "budget_root": "t"}
            live.add(name)
        elif op == "revoke" and name in live:
            kind, data = "key.revoked", {"name": name}
            live.discard(name)
        else:
            continue
        seq = len(out) + 1
        out.append(StoredEvent(seq, kind, None, data, "w", 1, 1000.0 + seq, "", ""))
    return out


STEPS = st.lists(
    st.tuples(st.sampled_from(["create", "revoke"]), st.integers(0, 2), st.integers(0, 1)),
    max_size=30,
)


def _grouped(grouped: dict[str, tuple[keys.LedgerKey, ...]]) -> dict[str, frozenset[object]]:
    return {digest: frozenset(rows) for digest, rows in grouped.items()}


@given(STEPS, st.data())
def test_folding_again_from_an_earlier_seq_gives_the_ledgers_rows(
    steps: list[tuple[str, int, int]], data: st.DataObject
) -> None:
    """Rows read at any point, with every event from any earlier seq folded in again,
    are the fold of the whole history; the regrouped copy is every row grouped anew."""
    events = _history(steps)
    whole = keys.folded({}, events)
    read_at = data.draw(st.integers(0, len(events)), label="rows read after event")
    since = data.draw(st.integers(0, read_at), label="events folded from")
    held = keys.folded({}, events[:read_at])
    assert keys.folded(held, events[since:]) == whole
    older = keys.folded({}, events[:since])
    again = keys.folded(older, events[since:])
    changed = (again[n] for n in {e.data["name"] for e in events[since:]} if n in again)
    regrouped = keys.regrouped(keys.by_digest(older.values()), older, changed)
    assert _grouped(regrouped) == _grouped(keys.by_digest(whole.values()))


def test_a_name_moved_to_another_digest_leaves_its_old_one() -> None:
    """A revoked name made again with another secret: the old digest no longer finds it,
    and a digest left with no row is gone, not an empty entry."""
    events = _history([("create", 0, 0), ("revoke", 0, 0), ("create", 0, 1)])
    before = keys.folded({}, events[:2])
    after = keys.folded(before, events[2:])
    regrouped = keys.regrouped(keys.by_digest(before.values()), before, [after["a"]])
    assert list(regrouped) == [DIGESTS[1]]
    assert regrouped[DIGESTS[1]] == (after["a"],)
