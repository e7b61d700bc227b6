"""What the tests of the transports in real programs share: a fake provider process for
each test, and the calls' stages as ``effectguard calls`` lists them."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from effectguard.ops.cli import main as cli_main
from effectguard.testing import FakeProvider, fake_provider


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[FakeProvider]:
    """A fake provider process for one test."""
    with fake_provider(tmp_path / "receipts.jsonl") as fake:
        yield fake


def stages_of(capsys: pytest.CaptureFixture[str], ledger: Path) -> Counter[str]:
    """How many calls of ``ledger`` are in each stage, read through the CLI."""
    capsys.readouterr()
    assert cli_main(["calls", "--json", "--ledger", str(ledger)]) == 0
    return Counter(row["stage"] for row in json.loads(capsys.readouterr().out))
