"""``effectguard_ledger_info`` names a ledger by where it is, never by its URL (docs/metrics.md)."""

from __future__ import annotations

import os
from pathlib import Path

import prometheus_client
import pytest

from effectguard.ledger import Ledger
from effectguard.telemetry.ledgerinfo import identity
from effectguard.telemetry.metrics import Metrics

PG = "postgresql://eg:s3cret@DB.example:5432/effectguard?schema=prod"


def test_replicas_of_one_ledger_agree_however_they_log_in() -> None:
    assert identity(PG) == identity("postgresql://other@db.example/effectguard?schema=prod")
    assert identity(PG)[0] == "postgresql"


@pytest.mark.parametrize(
    "other",
    [
        "postgresql://eg@db.example:5432/effectguard?schema=staging",
        "postgresql://eg@db.example:5433/effectguard?schema=prod",
        "postgresql://eg@db2.example:5432/effectguard?schema=prod",
        "postgresql://eg@db.example:5432/other?schema=prod",
    ],
)
def test_other_ledgers_differ(other: str) -> None:
    assert identity(other) != identity(PG)


def test_a_sqlite_file_is_named_by_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    here = identity("ledger.db")
    assert here == identity(str(tmp_path / "ledger.db")) == identity("sqlite:///ledger.db")
    assert here[0] == "sqlite"
    assert here != identity(str(tmp_path / "other.db"))
    assert here != identity(f"postgresql://eg@localhost/{os.path.basename(tmp_path)}")


async def test_the_scrape_names_the_ledger_and_never_its_password(tmp_path: Path) -> None:
    metrics = Metrics(registry=prometheus_client.CollectorRegistry())
    async with Ledger.open(str(tmp_path / "ledger.db")) as ledger:
        metrics.attach(ledger, PG)  # the URL shown is the one given, not this ledger's
        await metrics.refresh()
        text = metrics.render()[0].decode()
    (line,) = [x for x in text.splitlines() if x.startswith("effectguard_ledger_info{")]
    store, ledger_id = identity(PG)
    assert f'store="{store}"' in line and f'ledger="{ledger_id}"' in line, line
    assert line.endswith(" 1.0"), line
    assert "s3cret" not in text and "db.example" not in text
