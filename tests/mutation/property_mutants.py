"""Hand mutations of the safety-critical rules mutmut 3 leaves alone (decorated functions).

mutmut does not mutate properties, so the budget node's ``committed`` and ``room``, the
stream parser's ``finished`` and ``complete``, usage belief and the stage table reads are
mutated here, one at a time, and the fast rule tests must fail on each. Run from the
repository root: ``python -m tests.mutation.property_mutants`` (exit 1 if any survives).
See docs/testing.md for the mutmut run this completes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FAST_TESTS = (
    "tests/test_classifier.py",
    "tests/test_admission.py",
    "tests/test_workstate.py",
    "tests/test_budget.py",
    "tests/test_usage.py",
)
_COMMITTED = "return self.spent + self.reserved + self.held"
_ROOM = "return max(0, self.limit - self.committed)"
_COMPLETE = "return self._finished or not _TERMINAL[self._api]"
_BELIEVED = "return self.usage is not None and self.problem is None"
_REFUSED = 'return state if state.attempts else replace(state, stage="refused")'

#: (file, original text, mutated text)
MUTANTS: tuple[tuple[str, str, str], ...] = (
    ("effectguard/rules/budget.py", _COMMITTED, "return self.spent + self.reserved"),
    ("effectguard/rules/budget.py", _COMMITTED, "return self.reserved + self.held"),
    ("effectguard/rules/budget.py", _COMMITTED, "return self.spent + self.held"),
    ("effectguard/rules/budget.py", _COMMITTED, "return self.spent - self.reserved + self.held"),
    ("effectguard/rules/budget.py", _ROOM, "return self.limit - self.committed"),
    ("effectguard/rules/budget.py", _ROOM, "return max(1, self.limit - self.committed)"),
    (
        "effectguard/rules/budget.py",
        "        if self.limit is None:\n            return None\n",
        "        if self.limit is None:\n            return 0\n",
    ),
    ("effectguard/rules/usage.py", _COMPLETE, "return self._finished and not _TERMINAL[self._api]"),
    ("effectguard/rules/usage.py", _COMPLETE, "return self._finished"),
    ("effectguard/rules/usage.py", _COMPLETE, "return True"),
    (
        "effectguard/rules/usage.py",
        _COMPLETE,
        "return self._finished or bool(_TERMINAL[self._api])",
    ),
    ("effectguard/rules/usage.py", "        return self._finished\n", "        return True\n"),
    ("effectguard/rules/usage.py", _BELIEVED, "return self.usage is not None"),
    ("effectguard/rules/usage.py", _BELIEVED, "return self.problem is None"),
    (
        "effectguard/rules/workstate.py",
        "return STAGE_TABLE[self.stage][0]",
        "return STAGE_TABLE[self.stage][1]",
    ),
    (
        "effectguard/rules/workstate.py",
        "return STAGE_TABLE[self.stage][1]",
        "return STAGE_TABLE[self.stage][0]",
    ),
    # The terminal-stage guard once in workstate._to lives on as this attempts check.
    ("effectguard/rules/workstate.py", _REFUSED, 'return replace(state, stage="refused")'),
)


def run_one(path: str, old: str, new: str) -> bool:
    """Apply one mutation, run the fast tests, restore the file; whether the tests failed."""
    source = Path(path)
    original = source.read_text()
    if original.count(old) != 1:
        raise SystemExit(f"{path}: the text to mutate is not there exactly once: {old!r}")
    source.write_text(original.replace(old, new))
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *FAST_TESTS],
            capture_output=True,
            check=False,
        )
    finally:
        source.write_text(original)
    return result.returncode != 0


def main() -> int:
    """Run every mutant; print one line each and the totals; 1 if any survived."""
    survived = 0
    for path, old, new in MUTANTS:
        killed = run_one(path, old, new)
        survived += not killed
        print("killed  " if killed else "SURVIVED", path, repr(new.strip()[:70]), flush=True)
    print(f"{len(MUTANTS) - survived} killed, {survived} survived")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
