"""A misspelt ``EFFECTGUARD_CRASH_AT`` stops ``serve`` and ``reconcile`` at start as any
configuration error does (contract §8, §11.1): exit 2 with one line naming the variable,
never a traceback, and nothing served or written."""

from __future__ import annotations

from pathlib import Path

import pytest

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
