"""One request's failure never harms another, and the ledger's failures get clear answers.

Issue 13, findings 1, 2 and 9, through real processes: ``effectguard serve`` and the
fake provider, effects counted from the provider's receipt log.

* poisoned requests (integers no counter can hold) are refused with 400 while good calls
  sent at the same moment all complete;
* a startup failure exits non-zero at once, and one call whose interruption cannot commit
  blocks neither the restart nor the other calls;
* a ledger file deleted or replaced under a running proxy refuses new work with 503.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from observing import cli_json, wait_for

from effectguard.ledger import sqliteevents
from effectguard.testing import FakeProvider, fake_provider, running_proxy, start_proxy

pytestmark = pytest.mark.slow

CHAT = "/openai/v1/chat/completions"
MODEL = "gpt-4o-mini"
#: Long enough for any prompt startup failure on a loaded machine; a hang never ends.
EXIT_WITHIN_S = 60


def chat(content: str, **extra: Any) -> dict[str, Any]:
    """A small chat completion request."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    return {**body, **extra}


def stages(ledger: Path) -> list[str]:
    """Every call's stage."""
    return sorted(c["stage"] for c in cli_json("calls", "--ledger", str(ledger)))


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeProvider]:
    """The fake provider, its receipts next to (not inside) the ledger's directory."""
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        yield provider


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    """A ledger path in a directory of its own."""
    (tmp_path / "db").mkdir()
    return tmp_path / "db" / "ledger.db"


# -- finding 1: one request fails alone ---------------------------------------------------


POISONS = [
    ("max_tokens", {"max_tokens": 20000000000000000}),
    ("n", {"n": 1e17}),
    ("n", {"n": 100000000000000000}),
    ("max_completion_tokens", {"max_completion_tokens": 2**64}),
]


def test_poisoned_requests_are_refused_while_good_ones_complete(
    ledger: Path, fake: FakeProvider
) -> None:
    """60 good calls and 40 poisoned ones sent together: 60 completed, 40 refused 400."""
    with running_proxy(ledger, upstreams={"openai": fake.url}) as proxy:

        def send(i: int) -> tuple[bool, httpx.Response]:
            poisoned = i % 5 in (1, 3)  # 40 of 100, interleaved with the good ones
            extra = POISONS[i % len(POISONS)][1] if poisoned else {}
            body = chat(f"call {i}", **extra)
            return poisoned, httpx.post(proxy.url + CHAT, json=body, timeout=60)

        with ThreadPoolExecutor(100) as pool:
            results = list(pool.map(send, range(100)))
    good = [r for poisoned, r in results if not poisoned]
    bad = [r for poisoned, r in results if poisoned]
    assert len(good) == 60 and len(bad) == 40
    assert all(r.status_code == 200 for r in good), [r.text for r in good if r.status_code != 200]
    for response in bad:
        assert response.status_code == 400, response.text
        assert response.headers["x-should-retry"] == "false"
        error = response.json()["error"]
        assert error["type"] == "invalid_request"
        assert error["param"] in {"max_tokens", "n", "max_completion_tokens"}
        assert error["param"] in error["message"]
    assert len(fake.effects()) == 60
    assert stages(ledger) == ["completed"] * 60
    assert all(n["held_usd"] == "0.000000000" for n in cli_json("budgets", "--ledger", str(ledger)))
    assert cli_json("verify", "--ledger", str(ledger))["ok"] is True


# -- finding 2: startup failures exit, and one call never blocks a sweep -------------------


def _workers_dir_is_a_file(ledger: Path) -> None:
    # The store opens (its threads start), then the worker's lock directory cannot be made.
    workers = Path(str(ledger) + ".workers")
    shutil.rmtree(workers)
    workers.write_text("not a directory")


def _corrupt_ledger(ledger: Path) -> None:
    ledger.write_bytes(b"this is not a SQLite database" * 300)


@pytest.mark.parametrize(
    ("break_it", "said"),
    [
        (_workers_dir_is_a_file, "startup failed"),
        # Refused before anything starts, in one line (a corrupt file is no ledger).
        (_corrupt_ledger, "is not a sqlite database"),
    ],
)
def test_a_failed_startup_exits_non_zero_promptly(
    ledger: Path, break_it: Callable[[Path], None], said: str
) -> None:
    """Whatever makes startup fail, the process exits non-zero instead of hanging."""
    with running_proxy(ledger):
        pass  # a ledger that once worked
    break_it(ledger)
    proxy = start_proxy(ledger, wait=False)
    try:
        code = proxy.process.wait(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        proxy.kill()
        proxy.process.wait()
        pytest.fail(f"effectguard serve hung after a failed startup:\n{proxy.log()}")
    assert code != 0
    assert said in proxy.log().lower()
    assert "Traceback" not in proxy.log()  # a known cause is one line, not a stack


def test_a_call_that_cannot_be_marked_blocks_no_other(ledger: Path, fake: FakeProvider) -> None:
    """Restart after a crash: one call's interruption cannot commit; the others are marked."""
    proxy = start_proxy(ledger, upstreams={"openai": fake.url})
    pool = ThreadPoolExecutor(3)
    try:
        # Three calls the provider holds for a long time, then the proxy dies under them.
        for i in range(3):
            pool.submit(
                httpx.post,
                proxy.url + CHAT,
                json=chat(f"slow {i}"),
                headers={"x-fake-delay": "30"},
                timeout=60,
            )
        wait_for(lambda: len(fake.receipts()) == 3, 30, "three dispatched calls")
        proxy.kill(signal.SIGKILL)
        proxy.process.wait()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    calls = cli_json("calls", "--ledger", str(ledger))
    assert sorted(c["stage"] for c in calls) == ["in_flight"] * 3
    poisoned = calls[0]["call_id"]
    # Any failure inside one call's write: here the database itself refuses its events.
    with contextlib.closing(sqlite3.connect(ledger)) as db:
        # The trigger names the call as the events table stores it (format 2: bytes).
        stored = sqliteevents.call_key(poisoned)
        literal = f"X'{stored.hex()}'" if isinstance(stored, bytes) else f"'{stored}'"
        db.execute(
            "CREATE TRIGGER poison BEFORE INSERT ON events "
            f"WHEN NEW.call_id = {literal} BEGIN SELECT RAISE(ABORT, 'poisoned'); END"
        )
        db.commit()
    with running_proxy(ledger, upstreams={"openai": fake.url}) as restarted:
        # It started (healthy) although one call cannot be marked, and marked the others.
        by_id = {c["call_id"]: c["stage"] for c in cli_json("calls", "--ledger", str(ledger))}
        assert by_id.pop(poisoned) == "in_flight"
        assert list(by_id.values()) == ["effect_unknown"] * 2
        ok = httpx.post(restarted.url + CHAT, json=chat("after restart"), timeout=30)
        assert ok.status_code == 200, ok.text
        with contextlib.closing(sqlite3.connect(ledger)) as db:
            db.execute("DROP TRIGGER poison")
            db.commit()
        # The next periodic sweep marks it too.
        wait_for(
            lambda: stages(ledger).count("effect_unknown") == 3, 60, "the poisoned call marked"
        )
    assert cli_json("verify", "--ledger", str(ledger))["ok"] is True


# -- finding 9: the ledger vanishing under a running proxy ---------------------------------


def _delete(ledger: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(str(ledger) + suffix).unlink(missing_ok=True)


def _replace(ledger: Path) -> None:
    copy = ledger.with_name("copy.db")
    shutil.copyfile(ledger, copy)
    copy.replace(ledger)


@pytest.mark.parametrize("vanish", [_delete, _replace])
def test_a_deleted_or_replaced_ledger_refuses_new_work(
    ledger: Path, fake: FakeProvider, vanish: Callable[[Path], None]
) -> None:
    """Ledger file deleted or replaced while serving: 503 ledger_unavailable, nothing sent."""
    with running_proxy(ledger, upstreams={"openai": fake.url}) as proxy:
        assert httpx.post(proxy.url + CHAT, json=chat("before"), timeout=30).status_code == 200
        vanish(ledger)
        refused = httpx.post(
            proxy.url + CHAT, json=chat("after"), headers={"Idempotency-Key": "k"}, timeout=30
        )
        assert refused.status_code == 503, refused.text
        assert refused.headers["x-should-retry"] == "true"
        assert refused.json()["error"]["type"] == "ledger_unavailable"
        assert len(fake.receipts()) == 1
        health = httpx.get(proxy.url + "/healthz", timeout=30)
        assert health.status_code == 503
        assert health.json() == {"ledger": "unavailable"}


def test_healthz_reflects_the_last_real_commit(ledger: Path, fake: FakeProvider) -> None:
    """Real writes failing while an empty probe still commits (a full disk): /healthz is 503."""
    with running_proxy(ledger, upstreams={"openai": fake.url}) as proxy:
        assert httpx.post(proxy.url + CHAT, json=chat("before"), timeout=30).status_code == 200
        with contextlib.closing(sqlite3.connect(ledger)) as db:
            for table in ("events", "workers"):  # every real write, heartbeats included
                db.execute(
                    f"CREATE TRIGGER refuse_{table} BEFORE INSERT ON {table} "
                    "BEGIN SELECT RAISE(ABORT, 'disk full'); END"
                )
            db.commit()
        refused = httpx.post(proxy.url + CHAT, json=chat("during"), timeout=30)
        assert refused.status_code == 503, refused.text
        assert httpx.get(proxy.url + "/healthz", timeout=30).status_code == 503
        with contextlib.closing(sqlite3.connect(ledger)) as db:
            db.execute("DROP TRIGGER refuse_events")
            db.execute("DROP TRIGGER refuse_workers")
            db.commit()
        # The next heartbeat is a real commit again.
        wait_for(
            lambda: httpx.get(proxy.url + "/healthz", timeout=30).status_code == 200,
            30,
            "healthz to recover",
        )
        assert len(fake.receipts()) == 1
    assert cli_json("verify", "--ledger", str(ledger))["ok"] is True
