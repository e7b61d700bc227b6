"""``effectguard archive`` and ``verify`` across the cut, through a real proxy.

Calls go through a real proxy to the fake provider; archives are taken with the CLI while
the proxy serves. After each, ``verify`` passes on the live ledger (continuity across
the cut, budgets re-derived from the checkpoint) and on the archive file on its own.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import sqlite3
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from observing import call_stages

from effectguard.ops.archivefile import lines_sha256
from effectguard.ops.cli import main
from effectguard.rules.events import canonical_json, event_digest
from effectguard.testing import Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"


def chat(n: int) -> dict[str, Any]:
    """A small chat completion request."""
    return {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": f"archive {n}"}],
        "max_tokens": 8,
    }


def later() -> str:
    """A cut-off an hour from now: every final call so far is before it."""
    return (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).isoformat()


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    """``effectguard ARGS --json``: the exit code and the JSON it printed (or its stderr)."""
    capsys.readouterr()
    code = main([*args, "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out) if out.out.strip() else {"err": out.err}


def send_chats(proxy: Proxy, numbers: Iterable[int]) -> None:
    """One chat completion per number through ``proxy``, each answered 200."""
    for n in numbers:
        r = httpx.post(proxy.url + CHAT, json=chat(n), timeout=30)
        assert r.status_code == 200, r.text


def archive(ledger: Path | str, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    """``effectguard archive --json``; asserts exit 0 and returns what it moved."""
    code, moved = cli(capsys, "archive", "--ledger", str(ledger), "--before", later(), *extra)
    assert code == 0, moved
    return moved


def verify(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    """``effectguard verify --json ARGS``: the exit code and the report."""
    return cli(capsys, "verify", *args)


def test_archive_then_verify_and_an_archived_key_answers_409_archived(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Keyed completed calls are archived; verify passes live and on the file; resending a
    key answers 409 archived (422 for another body) and the provider sees nothing more."""
    ledger = tmp_path / "ledger.db"
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        for n in range(4):
            headers = {"Idempotency-Key": f"key-{n}", "Effectguard-Budget": "team/a"}
            r = httpx.post(proxy.url + CHAT, json=chat(n), headers=headers, timeout=30)
            assert r.status_code == 200
        budgets_before = main(["budgets", "--json", "--ledger", str(ledger)])
        spent_before = json.loads(capsys.readouterr().out)
        moved = archive(ledger, capsys)
        assert moved["calls"] == 4 and moved["keys"] == 4 and moved["first_seq"] == 1
        assert call_stages(ledger) == {}
        assert archive(ledger, capsys)["events"] == 0  # no call left: nothing more to move
        code, report = verify(capsys, "--ledger", str(ledger))
        assert code == 0, report["problems"]
        assert main(["budgets", "--json", "--ledger", str(ledger)]) == budgets_before
        assert json.loads(capsys.readouterr().out) == spent_before
        code, report = verify(capsys, "--archive", moved["path"], "--ledger", str(ledger))
        assert code == 0 and report["calls"] == 4, report["problems"]

        sent = len(fake.receipts())
        again = httpx.post(
            proxy.url + CHAT,
            json=chat(0),
            headers={"Idempotency-Key": "key-0", "Effectguard-Budget": "team/a"},
            timeout=30,
        )
        assert again.status_code == 409, again.text
        assert again.json()["error"]["type"] == "archived"
        assert again.headers["x-should-retry"] == "false"
        other = httpx.post(
            proxy.url + CHAT,
            json=chat(99),
            headers={"Idempotency-Key": "key-1", "Effectguard-Budget": "team/a"},
            timeout=30,
        )
        assert other.status_code == 422
        assert len(fake.receipts()) == sent  # never resent

        # A second archive continues the chain from the first checkpoint.
        send_chats(proxy, range(10, 13))
        second = archive(ledger, capsys)
        assert second["first_seq"] == moved["checkpoint_seq"]
        code, report = verify(capsys, "--ledger", str(ledger))
        assert code == 0, report["problems"]
        code, report = verify(capsys, "--archive", second["path"], "--ledger", str(ledger))
        assert code == 0, report["problems"]

    # The second file starts from the first cut's state, which the first checkpoint (now
    # inside the second file) vouches for: a header that lowers a counter is caught.
    def lower_spent(rows: list[str]) -> list[str]:
        header = json.loads(rows[0])
        header["start_state"]["budgets"][0][3] -= 1
        return [json.dumps(header), *rows[1:]]

    _rewrite(Path(second["path"]), lower_spent)
    code, report = verify(capsys, "--archive", second["path"], "--ledger", str(tmp_path / "no"))
    assert code == 1
    assert any("start is not its checkpoint" in p for p in report["problems"]), report


def test_an_archive_of_a_ledger_with_a_restricted_key_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A proxy key limited to models and providers is carried in every checkpoint's state:
    each archive file verifies (it was reported BROKEN, its checkpoint's key read back as
    lists and the folded key's as tuples, and an operator told to delete a ``.partial``
    file that does not verify would have deleted the only copy of its events)."""
    ledger = tmp_path / "ledger.db"
    assert main(["migrate", "--ledger", str(ledger)]) == 0
    code, made = cli(capsys, "key", "new", "--ledger", str(ledger), "--root", "team",
                     "--models", "gpt-4o-mini", "--providers", "openai")  # fmt: skip
    assert code == 0, made
    headers = {"Effectguard-Key": made["key"], "Effectguard-Budget": "team/a"}
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        files = []
        for n in range(2):  # the second file starts from the first checkpoint's state
            r = httpx.post(proxy.url + CHAT, json=chat(n), headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            files.append(archive(ledger, capsys)["path"])
    for path in files:
        code, report = verify(capsys, "--archive", path, "--ledger", str(ledger))
        assert code == 0, report["problems"]
    code, report = verify(capsys, "--ledger", str(ledger))
    assert code == 0, report["problems"]


def test_unresolved_calls_are_never_archived(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A call in flight during an archive stays live with everything after it; once it
    completes, the next archive takes it."""
    ledger = tmp_path / "ledger.db"
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
        ThreadPoolExecutor(2) as pool,
    ):
        assert httpx.post(proxy.url + CHAT, json=chat(0), timeout=30).status_code == 200
        held = pool.submit(
            httpx.post,
            proxy.url + CHAT,
            json=chat(1),
            headers={"x-fake-delay": "4"},
            timeout=30,
        )
        deadline = time.monotonic() + 20
        while "in_flight" not in call_stages(ledger).values():
            assert time.monotonic() < deadline, "the held call never started"
            time.sleep(0.05)
        assert httpx.post(proxy.url + CHAT, json=chat(2), timeout=30).status_code == 200
        moved = archive(ledger, capsys)
        assert moved["calls"] == 1  # only the call before the held one
        live = call_stages(ledger)
        (held_id,) = [c for c, stage in live.items() if stage == "in_flight"]
        assert (moved["held_by"], moved["held_because"]) == (
            held_id,
            "stage in_flight is not final",
        )
        assert main(["archive", "--ledger", str(ledger), "--before", later()]) == 0
        said = capsys.readouterr().out
        assert "nothing to archive yet" in said
        assert f"the cut stops at call {held_id} (stage in_flight is not final)" in said
        assert sorted(live.values()) == ["completed", "in_flight"]
        code, report = verify(capsys, "--ledger", str(ledger))
        assert code == 0, report["problems"]
        assert held.result(timeout=30).status_code == 200
        moved = archive(ledger, capsys)
        assert moved["calls"] == 2 and call_stages(ledger) == {}
        assert moved["held_by"] is None
        code, report = verify(capsys, "--ledger", str(ledger))
        assert code == 0, report["problems"]
    # The counters carried across the cut still bind: a budget row that drifts is caught.
    conn = sqlite3.connect(ledger)
    try:
        conn.execute("UPDATE budget_periods SET spent = spent + 1 WHERE path = 'default'")
        conn.commit()
    finally:
        conn.close()
    code, report = verify(capsys, "--ledger", str(ledger))
    assert code == 1
    assert any("budget 'default'" in p for p in report["problems"]), report["problems"]


def _rewrite(path: Path, change: Any) -> None:
    with gzip.open(path, "rt", encoding="utf-8") as src:
        rows = src.read().splitlines()
    rows = change(rows)
    with gzip.open(path, "wt", encoding="utf-8") as out:
        out.write("\n".join(rows) + "\n")


def test_tampering_with_an_archive_file_is_caught(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An edited body, a dropped event, and a file rewritten with a resealed chain are
    each caught by ``verify --archive``."""
    ledger = tmp_path / "ledger.db"
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        send_chats(proxy, range(3))
        path = Path(archive(ledger, capsys)["path"])
    original = path.read_bytes()

    def edit_body(rows: list[str]) -> list[str]:
        event = json.loads(rows[2])
        event["data"]["body"] = event["data"].get("body", "") + " "
        rows[2] = json.dumps(event)
        return rows

    def drop_event(rows: list[str]) -> list[str]:
        return rows[:3] + rows[4:]

    for change, expect in ((edit_body, "digest"), (drop_event, "expected sequence number")):
        path.write_bytes(original)
        _rewrite(path, change)
        code, report = verify(capsys, "--archive", str(path), "--ledger", str(tmp_path / "no.db"))
        assert code == 1
        assert any(expect in p for p in report["problems"]), report["problems"]

    # A forger who reseals everything (a fresh chain, a fresh checkpoint) passes the file's
    # own checks, but not the ledger's checkpoint.
    path.write_bytes(original)
    _reseal_with_one_body_changed(path)
    code, report = verify(capsys, "--archive", str(path), "--ledger", str(tmp_path / "no.db"))
    assert code == 0, report["problems"]
    code, report = verify(capsys, "--archive", str(path), "--ledger", str(ledger))
    assert code == 1
    assert any("not this archive's" in p for p in report["problems"]), report["problems"]


def digest_of(e: dict[str, Any]) -> str:
    """The digest an exported event (or checkpoint mark) ``e`` must carry."""
    return event_digest(
        seq=e["seq"],
        kind=e["kind"],
        call_id=e["call_id"],
        data_json=canonical_json(e["data"]),
        worker=e["worker"],
        generation=e["generation"],
        at=e["at"],
        prev_digest=e["prev_digest"],
    )


def reseal_mark(mark: dict[str, Any], last_digest: str, archive_sha256: str) -> None:
    """Make the checkpoint ``mark`` vouch for a forged range, as a forger would."""
    mark["data"]["last_digest"] = last_digest
    mark["data"]["archive_sha256"] = archive_sha256
    mark["digest"] = digest_of(mark)


def _reseal_with_one_body_changed(path: Path) -> None:
    def reseal(rows: list[str]) -> list[str]:
        header, events, tail = rows[0], [json.loads(r) for r in rows[1:-1]], json.loads(rows[-1])
        events[1]["data"]["body"] = events[1]["data"]["body"].replace("archive", "forged!")
        prev = json.loads(header)["prev_digest"]
        for e in events:
            e["prev_digest"] = prev
            e["digest"] = prev = digest_of(e)
        lines = [canonical_json(e) for e in events]
        reseal_mark(tail["checkpoint"], prev, lines_sha256(lines))
        return [header, *lines, canonical_json(tail)]

    _rewrite(path, reseal)


@pytest.mark.parametrize("left", ["file", "dangling-link"])
def test_a_partial_file_an_earlier_archive_left_is_never_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], left: str
) -> None:
    """An archive that crashed after its commit, before its rename, leaves the only copy
    of the events it moved in ``.FILE.partial``. Archiving to FILE again is refused, the
    file untouched and nothing moved, with what to do; it used to be overwritten. A
    symbolic link planted there (a shared directory) is refused too, never written
    through."""
    ledger = tmp_path / "ledger.db"
    target = tmp_path / "arch.jsonl.gz"
    partial = tmp_path / ".arch.jsonl.gz.partial"
    elsewhere = tmp_path / "elsewhere"
    if left == "file":
        partial.write_bytes(b"the only copy of an earlier range")
    else:
        partial.symlink_to(elsewhere)
    with (
        fake_provider(tmp_path / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        send_chats(proxy, range(3))
    code, out = cli(
        capsys, "archive", "--ledger", str(ledger), "--before", later(), "--out", str(target)
    )
    assert code == 2
    assert str(partial) in out["err"] and "verify" in out["err"]
    if left == "file":
        assert partial.read_bytes() == b"the only copy of an earlier range"
    assert not elsewhere.exists()
    assert len(call_stages(ledger)) == 3 and not target.exists()
    partial.unlink()
    assert archive(ledger, capsys, "--out", str(target))["calls"] == 3


def test_archive_refuses_memory_and_needs_a_cutoff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A memory ledger, or --out with a PostgreSQL ledger (its archive is a table), is
    refused with exit 2 and a reason; without --before the config's [retention]
    keep_bodies_days gives the cut-off."""
    assert main(["archive", "--before", "1d", "--ledger", "memory://"]) == 2
    assert "memory" in capsys.readouterr().err
    assert main(["archive", "--before", "1d", "--ledger", "postgresql://h/db", "--out", "f"]) == 2
    assert "archived_events" in capsys.readouterr().err
    assert main(["verify", "--archived", "--ledger", str(tmp_path / "x.db")]) == 2
    assert "--archive FILE" in capsys.readouterr().err
    # The two are one choice (`--archive FILE | --archived`), refused together on any store.
    (tmp_path / "a.jsonl.gz").write_bytes(b"x")
    with pytest.raises(SystemExit) as both:
        main(["verify", "--archive", str(tmp_path / "a.jsonl.gz"), "--archived"])
    assert both.value.code == 2 and "not allowed with" in capsys.readouterr().err
    ledger = tmp_path / "ledger.db"
    assert main(["migrate", "--ledger", str(ledger)]) == 0
    assert main(["archive", "--ledger", str(ledger)]) == 2
    assert "keep_bodies_days" in capsys.readouterr().err
    config = tmp_path / "c.toml"
    config.write_text("[retention]\nkeep_bodies_days = 30\n")
    assert main(["archive", "--ledger", str(ledger), "--config", str(config)]) == 0
    assert "nothing to archive" in capsys.readouterr().out


def test_the_events_table_refuses_a_delete_outside_an_archive(tmp_path: Path) -> None:
    """Only events up to a checkpoint's range may be deleted, and the mark that allows it
    moves only with a checkpoint as the newest event."""
    ledger = tmp_path / "ledger.db"
    assert main(["migrate", "--ledger", str(ledger)]) == 0
    assert main(["budget", "set", "team", "--limit", "5", "--ledger", str(ledger)]) == 0
    conn = sqlite3.connect(ledger)
    try:
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("DELETE FROM events WHERE seq = 1")
        with pytest.raises(sqlite3.IntegrityError, match="checkpoint"):
            conn.execute("UPDATE meta SET value = 1 WHERE key = 'archived_through'")
        # The mark cannot be removed, and a ledger that lost it anyway (an old file
        # edited by hand) still refuses: a missing mark means 0.
        with pytest.raises(sqlite3.IntegrityError, match="cannot be deleted"):
            conn.execute("DELETE FROM meta WHERE key = 'archived_through'")
        conn.execute("DROP TRIGGER meta_keeps_archived_through")
        conn.execute("DELETE FROM meta WHERE key = 'archived_through'")
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("DELETE FROM events WHERE seq = 1")
    finally:
        conn.close()
