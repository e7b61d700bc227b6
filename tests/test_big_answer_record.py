"""Recording a large answer (a 20 MB stream's observation) must not stall the event loop.

Found by sending 10 streams of 20 MB through ``serve`` on SQLite with a stack sampler in
the process: the only pauses of the loop longer than 100 ms were the observation's
recording (``seal`` writing its JSON and digest) run inline on the loop thread, while
other clients' small calls waited seconds for an answer. Storing an upload's chunks was
already moved off the loop (:func:`~effectguard.ledger.base.bulky`); a large answer is the
same kind of work.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_store_contract import admit_ok, completion, register, req

from effectguard.ledger import Ledger
from effectguard.ledger.base import Writer
from effectguard.rules import events
from effectguard.rules.callevents import AttemptObserved


async def _record_answer(ledger: Ledger, writer: Writer, ns: str, body: str) -> None:
    admitted = await admit_ok(ledger, writer, req(ns))
    done = completion(admitted.call_id, f"{ns}/run", 900)
    first = done[0]
    assert isinstance(first, AttemptObserved)
    done[0] = replace(first, body=body)
    await ledger.record(writer, admitted.call_id, 1, done)


async def test_a_large_answer_is_recorded_off_the_event_loop_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small answer is recorded inline (a thread hop would only add latency); one of a
    few MiB is written (its JSON, its digest, its rows) on the committer's thread."""
    sealers: list[tuple[int, int]] = []
    real = events.canonical_json

    def canonical_json(value: object) -> str:
        text = real(value)
        sealers.append((threading.get_ident(), len(text)))
        return text

    monkeypatch.setattr(events, "canonical_json", canonical_json)
    async with Ledger.open(str(tmp_path / "ledger.db")) as ledger:
        writer = await register(ledger, "w-big")
        ns = "t" + uuid.uuid4().hex[:12]
        await _record_answer(ledger, writer, ns, "small")
        small = {thread for thread, size in sealers if size < 1 << 20}
        sealers.clear()
        await _record_answer(ledger, writer, ns, "x" * (4 << 20))
        big = {thread for thread, size in sealers if size > 4 << 20}
    loop_thread = threading.get_ident()
    assert small == {loop_thread}, "a small answer is recorded inline"
    assert big and loop_thread not in big, "a large answer's recording leaves the loop"


def _probe(size: int) -> dict[str, Any]:
    """Run tests/bigstream_probe.py on a stream of about ``size`` bytes, in its own process."""
    probe = Path(__file__).with_name("bigstream_probe.py")
    done = subprocess.run(
        [sys.executable, str(probe), str(size)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_a_large_stream_is_stored_exactly_without_many_copies_of_it() -> None:
    """An 8 MB stream is recorded byte for byte, its chain verifies, and the heap's peak
    while it is forwarded and recorded stays near 3x its size (docs/configuration.md,
    ``max_answer_bytes``). Found measuring a 20 MB stream: 5.0x, as its chunks, their
    join, its text, its JSON and the digest's two copies of that JSON were held at once.
    tracemalloc counts every allocation, so the ratio does not depend on timing."""
    result = _probe(8_000_000)
    assert result["exact"] and result["verified"]
    assert result["peak"] < 3.5 * result["answer"], result
