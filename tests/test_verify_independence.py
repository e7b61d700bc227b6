"""The verifier shares only event decoding and the digest with the store, each pinned to vectors.

``effectguard.ops.audit`` may import from effectguard nothing but its own modules and, from
``effectguard.rules.events``, ``StoredEvent``, ``canonical_json`` and ``event_digest``. Nor may
it load anything else indirectly: imported in a fresh interpreter, the verifier's modules
bring in only themselves, the shared modules (and what those need) and the standard library.
The two shared functions are checked here against bytes and digests computed once and pinned,
so a change to either shows up as a broken vector, not as a verifier that agrees with a broken
store.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from effectguard.ledger.rows import event_from_row
from effectguard.ops import archivefile, pgarchive
from effectguard.ops.audit.chain import GENESIS, Chain
from effectguard.ops.audit.report import VerifyReport
from effectguard.rules.events import GENESIS_DIGEST, AttemptStarted, canonical_json, event_digest

AUDIT = Path(__file__).resolve().parent.parent / "effectguard" / "ops" / "audit"
SHARED = {"effectguard.rules.events": {"StoredEvent", "canonical_json", "event_digest"}}
#: The shared decoding and digest, as modules: what importing them loads is allowed too.
SHARED_MODULE = "effectguard.rules.events"
#: Every module of the verifier, by name.
AUDIT_MODULES = sorted(
    f"effectguard.ops.audit.{p.stem}" for p in AUDIT.glob("*.py") if p.stem != "__init__"
)


def effectguard_imports(path: Path) -> set[tuple[str, str]]:
    """Every ``(module, name)`` a file imports from effectguard (``import x`` gives name "*")."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {(a.name, "*") for a in node.names if a.name.startswith("effectguard")}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            module = node.module or ""
            if module.startswith("effectguard"):
                found |= {(module, a.name) for a in node.names}
    return found


def test_verifier_imports_only_the_shared_decoding_and_digest() -> None:
    """The verifier imports nothing from effectguard but itself and the three shared names."""
    modules = sorted(AUDIT.glob("*.py"))
    assert len(modules) >= 5
    for path in modules:
        for module, name in effectguard_imports(path):
            if module.startswith("effectguard.ops.audit"):
                continue
            assert name in SHARED.get(module, set()), f"{path.name} imports {module}.{name}"


def loaded_by(*modules: str) -> set[str]:
    """Every module a fresh interpreter loads to import ``modules`` (the ones it starts
    with left out)."""
    script = (
        "import sys, json\n"
        "before = set(sys.modules)\n"
        f"for name in {list(modules)!r}:\n"
        "    __import__(name)\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(done.stdout))


def _stdlib(name: str) -> bool:
    top = name.split(".")[0]
    # sysconfig's generated data module is the standard library's, under a platform name.
    return top in sys.stdlib_module_names or top.startswith("_sysconfigdata")


def not_allowed(loaded: set[str], shared: set[str]) -> set[str]:
    """What the verifier loaded beyond itself, the shared modules' own load and the
    standard library (package ``__init__`` modules above it hold nothing)."""
    own = {"effectguard", "effectguard.ops", "effectguard.ops.audit"}
    return {
        name
        for name in loaded - shared
        if name not in own and not name.startswith("effectguard.ops.audit.") and not _stdlib(name)
    }


def test_the_verifier_loads_nothing_of_the_store_even_indirectly() -> None:
    """Imported in a fresh interpreter, every verifier module loads only the verifier, the
    shared event decoding and digest (with what they need) and the standard library."""
    shared = loaded_by(SHARED_MODULE)
    # The shared modules themselves load nothing of the store or the rest of the rules.
    assert {m for m in shared if m.startswith("effectguard")} == {
        "effectguard",
        "effectguard.rules",
        "effectguard.rules.canonical",
        "effectguard.rules.digest",
        "effectguard.rules.events",
        # The event kinds events.py registers, by concept, on their common base.
        "effectguard.rules.eventbase",
        "effectguard.rules.budgetevents",
        "effectguard.rules.callevents",
        "effectguard.rules.ledgerevents",
        # How StoredEvent is built (a twin class, then its class set): holds no rule.
        "effectguard.rules.quickinit",
    }
    loaded = loaded_by("effectguard.ops.audit", *AUDIT_MODULES)
    assert set(AUDIT_MODULES) <= loaded
    assert not_allowed(loaded, shared) == set()


def test_the_transitive_check_sees_what_a_module_loads_indirectly() -> None:
    """The check itself works: the archive file's reader loads the store, and through it the
    store's projection, which it never imports by name."""
    shared = loaded_by(SHARED_MODULE)
    bad = not_allowed(loaded_by("effectguard.ops.archivefile"), shared)
    assert "effectguard.ledger" in bad
    assert "effectguard.rules.workstate" in bad
    direct = {m for m, _ in effectguard_imports(Path(archivefile.__file__))}
    assert "effectguard.rules.workstate" not in direct  # only the transitive check sees it


def test_archives_are_proved_by_the_verifier_not_the_archiver() -> None:
    """``verify --archive`` (a file, or PostgreSQL's archive table) proves a range with the
    verifier's own code, so "archived calls are final" is not judged by the archiver's
    retention constant."""
    for reader in (archivefile, pgarchive):
        assert reader.verify_range.__module__ == "effectguard.ops.audit.archived"
    assert "effectguard.rules.retention" not in loaded_by("effectguard.ops.audit.archived")


def test_the_import_check_sees_a_violation(tmp_path: Path) -> None:
    """The check itself works: a verifier module reaching the store's fold is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from effectguard.rules import workstate\nfrom effectguard.ledger import x\n")
    found = effectguard_imports(bad)
    assert ("effectguard.rules", "workstate") in found
    assert not all(name in SHARED.get(module, set()) for module, name in found)


def test_canonical_json_matches_its_pinned_bytes() -> None:
    """canonical_json sorts keys, drops spaces and keeps non-ASCII as UTF-8 (pinned bytes)."""
    value = {"b": [1, 2.5, None, True], "a": "é\u2028x", "c": {"z": 1, "y": ""}}
    pinned = bytes.fromhex(
        "7b2261223a22c3a9e280a878222c2262223a5b312c322e352c6e756c6c2c747275655d2c"
        "2263223a7b2279223a22222c227a223a317d7d"
    )
    assert canonical_json(value).encode("utf-8") == pinned


def test_event_digest_matches_its_pinned_vectors() -> None:
    """event_digest over a call event and a ledger event gives the pinned SHA-256 digests."""
    assert GENESIS == GENESIS_DIGEST == "0" * 64
    call = event_digest(
        seq=7,
        kind="attempt.started",
        call_id="call_x",
        data_json='{"a":1}',
        worker="w1",
        generation=3,
        at=1700000000.25,
        prev_digest="0" * 64,
    )
    assert call == "c86a9ff17c0ec11a39a173840eb54d922defa95f4e99288a8bd9a716a683e336"
    ledger = event_digest(
        seq=1,
        kind="budget.limit_set",
        call_id=None,
        data_json='{"limit":null,"path":"team"}',
        worker="operator",
        generation=0,
        at=0.1,
        prev_digest="ab" * 32,
    )
    assert ledger == "ee7bc77c67c496ab0f4ff9f207eec3bb59b7d8e5c8bff924db7a6fbdbc563893"


def test_a_large_events_digest_matches_its_pinned_vector() -> None:
    """Data JSON over 1 MiB (a large answer's) is digested in parts to save memory: the
    digest is the one pinned from digesting it whole (non-ASCII text included)."""
    data_json = '{"body":"' + "x\u00fc\u20ac" * (1 << 19) + '"}'
    digest = event_digest(
        seq=9,
        kind="attempt.observed",
        call_id="call_big",
        data_json=data_json,
        worker="w1",
        generation=2,
        at=1700000001.5,
        prev_digest="cd" * 32,
    )
    assert digest == "ee80ff86f5f6632e28f60d4b5712ab8caa6cbaa1acd6919481c3780bc5e08885"


#: One stored row exactly as the events table holds it (columns of rows.EVENT_COLUMNS).
ROW = (
    1,
    "attempt.started",
    "call_x",
    '{"at":2.5,"attempt":1,"call":"call_x","generation":3,'
    '"provider_idempotency_key":null,"worker":"w1"}',
    "w1",
    3,
    2.5,
    "0" * 64,
    "8893ea42a9aaa160d5c447dea641c9695ab286595cbbd7997a6a5c952cc45dd6",
)


def test_stored_event_decoding_matches_its_pinned_row() -> None:
    """A pinned stored row decodes to the pinned fields, its typed event, and its pinned digest."""
    stored = event_from_row(ROW)
    assert (stored.seq, stored.kind, stored.call_id, stored.worker, stored.generation) == (
        1,
        "attempt.started",
        "call_x",
        "w1",
        3,
    )
    assert stored.at == 2.5 and stored.prev_digest == "0" * 64
    assert stored.data == {
        "at": 2.5,
        "attempt": 1,
        "call": "call_x",
        "generation": 3,
        "provider_idempotency_key": None,
        "worker": "w1",
    }
    assert stored.event == AttemptStarted(
        call="call_x", attempt=1, worker="w1", generation=3, at=2.5
    )
    assert canonical_json(stored.data) == ROW[3]
    report = VerifyReport()
    Chain(report).feed(stored)
    assert report.ok, report.problems
