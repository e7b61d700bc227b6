"""A misspelt ``EFFECTGUARD_CRASH_AT`` stops ``serve`` and ``reconcile`` at start as any
configuration error does (contract §8, §11.1): exit 2 with one line naming the variable,
never a traceback, and nothing served or written."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from observing import call_stages
from test_archive_rules import admitted_long_ago

from effectguard.ops.cli import main


@pytest.mark.parametrize("verb", [["serve", "--port", "0"], ["reconcile", "--auto"]])
def test_an_unknown_crash_point_is_a_configuration_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    verb: list[str],
) -> None:
    """The process stops with exit 2 and one line on stderr; the ledger is unchanged."""
    ledger = str(tmp_path / "l.db")
    assert main(["migrate", "--ledger", ledger]) == 0
    before = Path(ledger).read_bytes()
    capsys.readouterr()
    monkeypatch.setenv("EFFECTGUARD_CRASH_AT", "after:admitt")
    assert main([*verb, "--ledger", ledger]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "EFFECTGUARD_CRASH_AT" in err and "'after:admitt'" in err and "after:admit," in err
    assert Path(ledger).read_bytes() == before


@pytest.mark.parametrize(
    "decision",
    [["--not-applied", "--note", "n"], ["--applied", "--note", "n"], ["--accept-evidence"]],
)
def test_an_unknown_crash_point_stops_a_manual_reconcile_before_it_decides(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    decision: list[str],
) -> None:
    """``reconcile CALL_ID`` read the variable only after its decision had committed, so
    a misspelt point answered exit 2, the usage error that promises nothing was written,
    for a call it had just decided. It is read at start, as ``--auto`` reads it."""
    ledger = tmp_path / "l.db"
    _, unknown = asyncio.run(admitted_long_ago(ledger, time.time()))
    monkeypatch.setenv("EFFECTGUARD_CRASH_AT", "after:reconcil")
    capsys.readouterr()
    assert main(["reconcile", unknown, *decision, "--ledger", str(ledger)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "EFFECTGUARD_CRASH_AT" in err, err
    assert call_stages(ledger)[unknown] == "effect_unknown"
