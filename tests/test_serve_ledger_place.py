"""``serve`` and ``migrate`` create a ledger, so they take a path where none exists yet; a
path where no ledger can be made or opened is refused before anything starts.

A directory, a file that is not a SQLite database, a path whose directory is missing, or
another program's database: exit 2 (contract §8, a configuration error) in one line, no
traceback, and nothing written (``serve --demo`` wrote its receipt log first).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from stagedkit import run, serve_refusing

from effectguard.ops.demo import RECEIPTS


def _foreign(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.commit()
    conn.close()


PLACES = [
    ("adir", "is not a file"),
    ("text.txt", "is not a SQLite database"),
    ("nodir/sub/ledger.db", "no directory"),
    ("foreign.sqlite", "is another program's SQLite database (tables notes)"),
]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A directory holding a directory, a text file and another program's database."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "text.txt").write_text("junk\n")
    _foreign(tmp_path / "foreign.sqlite")
    return tmp_path


def _unchanged(folder: Path) -> None:
    assert sorted(p.name for p in folder.iterdir()) == ["adir", "foreign.sqlite", "text.txt"]
    assert list((folder / "adir").iterdir()) == []


@pytest.mark.parametrize(("name", "needle"), PLACES, ids=[p for p, _ in PLACES])
@pytest.mark.parametrize("demo", [False, True], ids=["plain", "demo"])
def test_serve_refuses_a_path_no_ledger_can_be_at(
    folder: Path, name: str, needle: str, demo: bool
) -> None:
    """serve --ledger at such a path exits 2 with one line naming it, and writes nothing
    (with --demo, no receipt log beside it either)."""
    args = ["--ledger", str(folder / name), "--port", "0", *(["--demo"] if demo else [])]
    done = serve_refusing(*args)
    assert done.code == 2, done
    assert done.err.count("\n") == 1 and needle in done.err, done.err
    assert not (folder / RECEIPTS).exists()
    _unchanged(folder)


@pytest.mark.parametrize(("name", "needle"), PLACES, ids=[p for p, _ in PLACES])
def test_migrate_refuses_a_path_no_ledger_can_be_at(folder: Path, name: str, needle: str) -> None:
    """migrate --ledger at such a path is exit 2 (a configuration error, not 4: the ledger
    is not unavailable, it is misnamed), and writes nothing."""
    done = run("migrate", "--ledger", str(folder / name))
    assert done.code == 2, done
    assert needle in done.err, done.err
    _unchanged(folder)


def test_migrate_makes_a_ledger_of_a_new_or_empty_file(tmp_path: Path) -> None:
    """A new path, or an empty file (no tables yet), becomes a ledger the commands read."""
    (tmp_path / "empty.db").write_bytes(b"")
    for name in ("new.db", "empty.db"):
        assert run("migrate", "--ledger", str(tmp_path / name)).code == 0
        assert run("budgets", "--ledger", str(tmp_path / name)).code == 0
