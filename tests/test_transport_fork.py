# ruff: noqa: F811  (the provider fixture is imported by name and used as an argument)
"""Transports and forked processes, with the real fake provider (its receipt log counts
what reached it) and real processes (docs/contract.md §3.8, §7):

* an AsyncGuardTransport used before a fork refuses every call in the child with an
  error naming the fork, nothing sent, and its ``aclose()`` there returns at once;
* a long-lived child forked from a program using a transport does not keep the
  program's worker lock: after the program is killed, a restart takes its calls over
  at start-up;
* a child forked while the parent has a SQLite ledger open is refused, at its first call,
  a transport of its own on it (SQLite's locks do not survive a fork), every time; one
  forked from a parent that made its transport but had not used it yet (gunicorn
  ``--preload``), or had closed it, works;
* an open SQLite ``Ledger`` the parent passes to its transports is refused in a child
  (it hung there, on the parent's reader thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
from transportkit import provider, stages_of  # noqa: F401  (a fixture, used by name)

import effectguard
from effectguard.ops.cli import main as cli_main
from effectguard.testing import FakeProvider

pytestmark = pytest.mark.slow

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}

#: A bound on a hang, not a timing claim.
HANG_BOUND_S = 60.0


async def _child_uses(transport: effectguard.AsyncGuardTransport, url: str) -> list[str]:
    """What a forked child meets: a call, the ``aclose()`` the error advises, a call."""
    client = httpx.AsyncClient(transport=transport, base_url=url)
    seen = []
    for step in ("call", "aclose", "call"):
        try:
            if step == "aclose":
                await asyncio.wait_for(transport.aclose(), 10)
            else:
                await client.post("/v1/chat/completions", json=CHAT)
            seen.append(f"{step}: done")
        except RuntimeError as exc:
            seen.append(f"{step}: " + ("forked" if "forked" in str(exc) else str(exc)))
        except TimeoutError:
            seen.append(f"{step}: hung")
    return seen


def test_an_async_transport_used_before_a_fork_refuses_the_child(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The parent's loop uses an AsyncGuardTransport, then the program forks: in the child
    a call is refused with an error naming the fork and nothing is sent; ``aclose()``
    returns at once and leaves the parent's runtime alone; the transport stays refused
    there. The child used to be told of "another event loop"; its ``aclose()`` then waited
    for ever on the parent's threads, and its next call went out recorded as the parent's
    worker, through the parent's ledger connections."""
    ledger = tmp_path / "ledger.db"
    transport = effectguard.AsyncGuardTransport(
        ledger=str(ledger), upstreams={"openai": provider.url}
    )
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_parent_loop(coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(HANG_BOUND_S)

    client = httpx.AsyncClient(transport=transport, base_url=provider.url)
    assert on_parent_loop(client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            signal.alarm(int(HANG_BOUND_S))  # a bound on a hang
            seen = asyncio.run(_child_uses(transport, provider.url))
            os.write(write_end, json.dumps(seen).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as child:
        seen = json.loads(child.read() or b"null")
    os.waitpid(pid, 0)
    assert seen == ["call: forked", "aclose: done", "call: forked"]
    assert on_parent_loop(client.post("/v1/chat/completions", json=CHAT)).status_code == 200
    on_parent_loop(transport.aclose())
    loop.call_soon_threadsafe(loop.stop)
    assert len(provider.effects()) == 2
    assert stages_of(capsys, ledger) == Counter(completed=2)


FORKS_A_HELPER = """
import os, sys, time
import httpx, effectguard

url, ledger = sys.argv[1], sys.argv[2]
transport = effectguard.GuardTransport(ledger=ledger, upstreams={"openai": url})
client = httpx.Client(transport=transport, base_url=url, timeout=100)
chat = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
client.post("/v1/chat/completions", json=chat)
helper = os.fork()  # a long-lived helper, as a multiprocessing pool's worker
if helper == 0:
    time.sleep(300)
    os._exit(0)
print(helper, flush=True)
client.post("/v1/chat/completions", json=chat, headers={"x-fake-behaviour": "delay=60"})
"""


def _in_flight(capsys: pytest.CaptureFixture[str], ledger: Path) -> int:
    """How many calls ``ledger`` holds in flight, once there is one (bounded)."""
    deadline = time.monotonic() + HANG_BOUND_S
    while not (count := stages_of(capsys, ledger)["in_flight"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def test_a_forked_helper_does_not_keep_a_killed_programs_worker_lock(
    provider: FakeProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A program using a GuardTransport forks a long-lived helper, then is SIGKILLed with
    a call on its way. The helper outlives it; a restart on the same host finds the
    program's worker lock free and marks the stranded call ``effect_unknown`` in its
    start-up sweep. The helper kept its copy of the lock's open file, so the lock stayed
    held and the restart left the call in flight until the program's lease ran out."""
    ledger = tmp_path / "ledger.db"
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(FORKS_A_HELPER))
    program = subprocess.Popen(
        [sys.executable, str(script), provider.url, str(ledger)], stdout=subprocess.PIPE
    )
    assert program.stdout is not None
    helper = int(program.stdout.readline())
    try:
        assert _in_flight(capsys, ledger) == 1
        program.kill()
        program.wait()
        restart = effectguard.GuardTransport(ledger=str(ledger), upstreams={"openai": provider.url})
        with httpx.Client(transport=restart, base_url=provider.url) as client:
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
            stages = stages_of(capsys, ledger)  # right after the start-up sweep
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(helper, signal.SIGKILL)
    assert stages == Counter(completed=2, effect_unknown=1)


def _run_program(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a Python program that forks, bounded: on a hang its children (a pool's
    workers, which a timeout's kill of the program alone leaves running) end with it."""
    program = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = program.communicate(timeout=HANG_BOUND_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(program.pid, signal.SIGKILL)
        program.wait()
    return subprocess.CompletedProcess(args, program.returncode, out, err)


CHILD_OWN_TRANSPORT = """
import multiprocessing, os, sys
import httpx, effectguard

url, ledger, parent = sys.argv[1], sys.argv[2], sys.argv[3]
chat = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
# Made at import, as a web app or a Celery app module does.
transport = effectguard.GuardTransport(ledger=ledger, upstreams={"openai": url})
client = httpx.Client(transport=transport, base_url=url, timeout=30)


def own_call(_: int) -> str:
    \"\"\"In the child: a transport of its own on the same ledger, one call.\"\"\"
    mine = effectguard.GuardTransport(ledger=ledger, upstreams={"openai": url})
    try:
        with httpx.Client(transport=mine, base_url=url, timeout=30) as own:
            return str(own.post("/v1/chat/completions", json=chat).status_code)
    except effectguard.LedgerUnavailable as exc:
        return "refused-forked" if "forked" in str(exc) else f"refused: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def module_call(_: int) -> str:
    \"\"\"In the child: the client made at import.\"\"\"
    try:
        return str(client.post("/v1/chat/completions", json=chat).status_code)
    except RuntimeError as exc:
        return "said-closed" if "closed" in str(exc) else "said-forked"


if __name__ == "__main__":
    if parent in ("used", "closed", "used-module"):
        client.post("/v1/chat/completions", json=chat)
    if parent == "closed":
        transport.close()
    work = module_call if parent in ("unused", "used-module") else own_call
    with multiprocessing.get_context("fork").Pool(2) as pool:
        print(" ".join(pool.map(work, range(2))), flush=True)
    if parent != "closed":
        transport.close()
"""


@pytest.mark.parametrize(
    ("parent", "children"),
    [
        ("used", ["refused-forked"] * 2),
        ("closed", ["200"] * 2),
        ("unused", ["200"] * 2),
        ("used-module", ["said-forked"] * 2),
    ],
)
def test_a_child_forked_with_the_sqlite_ledger_open_is_refused_it(
    provider: FakeProvider,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    parent: str,
    children: list[str],
) -> None:
    """A program whose transport has used a SQLite ledger and is still open forks a pool:
    each child's own transport on that ledger is refused at its first call, with an error
    naming the fork, nothing sent. The child used to open it anyway: it worked when no
    thread of the parent was inside SQLite at the fork, and otherwise found the ledger
    locked for ever or hung. Forked after the parent closed its transport, or from a
    parent that made one at import without using it (gunicorn ``--preload``), it works.
    The client made at import and used in the parent is refused in the children with an
    error that says they were forked (it said "closed, or ... forked")."""
    ledger = tmp_path / "ledger.db"
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(CHILD_OWN_TRANSPORT))
    # Made first, so that only forks are tested here: two children creating a fresh file
    # at the same instant is test_ledger_creation's (it met SQLite's "database is locked"
    # on the switch to WAL until 2026-12-05).
    made = subprocess.run(
        [sys.executable, "-m", "effectguard", "migrate", "--ledger", str(ledger)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    done = _run_program([str(script), provider.url, str(ledger), parent])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == children
    sent = (0 if parent == "unused" else 1) + children.count("200")
    assert len(provider.effects()) == sent
    assert stages_of(capsys, ledger) == Counter(completed=sent)
    capsys.readouterr()
    assert cli_main(["verify", "--ledger", str(ledger)]) == 0


PASSES_ITS_LEDGER = """
import asyncio, os, signal, sys
import httpx, effectguard
from effectguard.ledger import open_store

url, path = sys.argv[1], sys.argv[2]
chat = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
loop = asyncio.new_event_loop()
ledger = effectguard.Ledger(open_store(path))  # opened once, passed to transports
loop.run_until_complete(ledger.store.open())


async def child() -> str:
    transport = effectguard.AsyncGuardTransport(ledger=ledger, upstreams={"openai": url})
    client = httpx.AsyncClient(transport=transport, base_url=url)
    try:
        return str((await client.post("/v1/chat/completions", json=chat)).status_code)
    except effectguard.LedgerUnavailable as exc:
        return "refused-forked" if "forked" in str(exc) else f"refused: {exc}"
    finally:
        await transport.aclose()


read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:
    signal.alarm(20)  # a bound on a hang
    os.write(write_end, asyncio.run(child()).encode())
    os._exit(0)
os.close(write_end)
print(os.fdopen(read_end).read() or "hung", flush=True)
os.waitpid(pid, 0)
loop.run_until_complete(ledger.store.close())
"""


def test_a_sqlite_ledger_opened_before_a_fork_is_refused_in_the_child(
    provider: FakeProvider, tmp_path: Path
) -> None:
    """A program opens a SQLite ``effectguard.Ledger`` once and passes it to its
    transports (``ledger=`` takes an open one), then forks: a transport the child makes
    with it is refused at its first call, with an error naming the fork, nothing sent.
    The child used to go on with the parent's connections and threads, and hung."""
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(PASSES_ITS_LEDGER))
    done = _run_program([str(script), provider.url, str(tmp_path / "ledger.db")])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["refused-forked"]
    assert provider.effects() == []
