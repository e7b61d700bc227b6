"""Programs that create one SQLite ledger at the same moment all start, and a command run
while another program creates the ledger says what is there.

Two ``serve`` replicas, two programs with a guarded transport, or ``serve`` and a command,
started together on a path where no ledger exists yet: each creates the file and switches
it to WAL. SQLite does not wait for another connection's lock at that switch (its busy
timeout does not apply), so one of them failed at start with "database is locked".

The children (``children/ledger_user.py``) are started once and then given each round's
job at the same moment, so they meet on the fresh path as programs started together do;
rounds are repeated, since the meeting is a matter of a millisecond.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from operatorkit import CHAT, chat_body

from effectguard.ledger.sqliteschema import MIGRATIONS
from effectguard.ops.cli import main as cli_main
from effectguard.testing import fake_provider, start_proxy

pytestmark = pytest.mark.slow

CHILD = Path(__file__).parent / "children" / "ledger_user.py"
#: How far ahead of its jobs' common start a round gives them out.
START_AHEAD_S = 0.05
#: The bound on one round's jobs (a ledger's creation takes milliseconds).
ROUND_BOUND_S = 30.0
#: The bound on a test's rounds: it stops there, however many it ran.
ROUNDS_BOUND_S = 40.0


class Users:
    """Child processes, each a user of a ledger, given their jobs together."""

    def __init__(self, processes: list[subprocess.Popen[str]]) -> None:
        self.processes = processes

    def run(self, actions: list[str], path: Path) -> list[dict[str, Any]]:
        """Give child ``i`` the job ``actions[i] path`` (all at once); what each did."""
        instant = time.monotonic() + START_AHEAD_S
        for process, action in zip(self.processes, actions, strict=True):
            assert process.stdin is not None
            process.stdin.write(f"{instant} {action} {path}\n")
            process.stdin.flush()
        return [self._answer(process) for process in self.processes[: len(actions)]]

    @staticmethod
    def _answer(process: subprocess.Popen[str]) -> dict[str, Any]:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], ROUND_BOUND_S)
        assert ready, f"a ledger user did not answer within {ROUND_BOUND_S} s"
        line = process.stdout.readline()
        assert line, f"a ledger user exited with {process.wait()}"
        answer: dict[str, Any] = json.loads(line)
        return answer


@contextlib.contextmanager
def users(count: int) -> Iterator[Users]:
    """``count`` child processes, ready for jobs once started (stopped after)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    processes = [
        subprocess.Popen(
            [sys.executable, str(CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(count)
    ]
    try:
        yield Users(processes)
    finally:
        for process in processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


def rounds(tmp: Path, count: int) -> Iterator[Path]:
    """Fresh ledger paths, one a round, for at most ``count`` rounds and ROUNDS_BOUND_S."""
    deadline = time.monotonic() + ROUNDS_BOUND_S
    for i in range(count):
        if time.monotonic() > deadline:
            return
        folder = tmp / f"round{i}"
        folder.mkdir()
        yield folder / "ledger.db"


def test_programs_creating_one_ledger_at_once_all_start(tmp_path: Path) -> None:
    """Four programs start a guarded transport on one new ledger at the same moment, round
    after round: every one starts, and the ledger they made verifies. (An empty file its
    owner made, ``touch``, is the same case: each program finds an empty file there.)"""
    failed: list[dict[str, Any]] = []
    paths: list[Path] = []
    with users(4) as children:
        for path in rounds(tmp_path, 160):
            answers = children.run(["open"] * 4, path)
            paths.append(path)
            failed += [a for a in answers if a["code"] != 0]
            if failed:
                break
    assert not failed, f"round {len(paths)}: {failed}"
    assert len(paths) >= 20  # enough rounds ran for the meeting to happen (1 in 5 to 40)
    assert cli_main(["verify", "--ledger", str(paths[-1])]) == 0


def test_two_serve_replicas_started_together_on_a_new_ledger_both_serve(tmp_path: Path) -> None:
    """Two ``serve`` replicas started together on a path with no ledger: both start, each
    sends the call it is given (two effects at the provider), and the ledger verifies."""
    ledger = tmp_path / "ledger.db"
    with fake_provider(tmp_path / "receipts.jsonl") as provider:
        upstreams = {"openai": provider.url}
        with ThreadPoolExecutor(2) as pool:
            starts = [pool.submit(start_proxy, ledger, upstreams=upstreams) for _ in range(2)]
        proxies = [start.result() for start in starts if start.exception() is None]
        try:
            assert len(proxies) == 2, [str(start.exception()) for start in starts]
            for i, proxy in enumerate(proxies):
                answer = httpx.post(proxy.url + CHAT, json=chat_body(f"replica {i}"), timeout=30)
                assert answer.status_code == 200, answer.text
        finally:
            for proxy in proxies:
                proxy.stop()
        assert len(provider.effects()) == 2
    assert cli_main(["verify", "--ledger", str(ledger)]) == 0


#: What a command that creates no ledger may say of a path where none was yet: "no ledger".
NONE_YET = "no ledger at "


def test_commands_run_while_a_program_creates_the_ledger_say_what_is_there(
    tmp_path: Path,
) -> None:
    """A program starts a transport on a new path while, at the same moment, ``migrate``,
    ``calls`` and ``verify`` run on it, round after round: the program and ``migrate``
    succeed, and ``calls`` and ``verify`` either find no ledger yet (exit 2, "no ledger
    at") or read the one made, never a file half made."""
    wrong: list[dict[str, Any]] = []
    paths: list[Path] = []
    with users(4) as children:
        for path in rounds(tmp_path, 40):
            answers = children.run(["open", "migrate", "calls", "verify"], path)
            paths.append(path)
            for answer in answers:
                creates = answer["action"] in ("open", "migrate")
                none_yet = answer["code"] == 2 and answer["said"].startswith(
                    f"effectguard: {NONE_YET}"
                )
                if answer["code"] != 0 and (creates or not none_yet):
                    wrong.append(answer)
            if wrong:
                break
    assert not wrong, f"round {len(paths)}: {wrong}"
    assert len(paths) >= 10  # enough rounds ran for the meeting to happen
    assert cli_main(["verify", "--ledger", str(paths[-1])]) == 0


def test_of_two_migrates_at_once_on_a_new_path_one_says_it_created_the_ledger(
    tmp_path: Path,
) -> None:
    """Two ``effectguard migrate`` run at the same moment on a path with no ledger: one says
    it created the ledger, the other that it found it up to date (both said "created")."""
    said: list[list[str]] = []
    with users(2) as children:
        for path in rounds(tmp_path, 10):
            answers = children.run(["migrate", "migrate"], path)
            assert [a["code"] for a in answers] == [0, 0], answers
            said.append(sorted(a["out"].split(": ", 1)[1] for a in answers))
    last = len(MIGRATIONS)
    expected = [
        f"created: {last} migrations applied, now at migration {last}",
        f"up to date at migration {last}; nothing applied",
    ]
    assert said == [expected] * len(said)
