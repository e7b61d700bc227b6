"""GuardTransport (sync): an answer cut off at its bound no longer holds the worker thread
that was reading it.

The sync inner transport's reads run on worker threads (ingress/syncinner). When
``upstream_read_timeout_s`` ends a trickled plain answer as a whole, the guard closes the
answer; the thread blocked reading its next bytes used to go on waiting for them (up to
the read timeout), holding the thread and its connection after the caller had its 504.
Now closing the answer wakes that read, and the thread is free at once.

Observed through the threads themselves: after the 504, the transport is closed (in the
background) and its reader threads must be gone within a wait far shorter than the
trickle's next byte.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import FAST

from effectguard import GuardTransport
from effectguard.testing import FakeProvider, fake_provider

READ_S = 4
#: The next byte comes 7.8 s after the headers, 3.8 s after the cut at READ_S: a reader
#: still waiting for it outlasts WAIT_S by far.
TRICKLE = {"x-fake-behaviour": "trickle=3.9"}
WAIT_S = 1.5
READERS = "effectguard-upstream-read"


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeProvider]:
    with fake_provider(tmp_path / "receipts.jsonl") as running:
        yield running


def _readers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(READERS)]


@pytest.mark.slow
def test_a_cut_off_answer_frees_its_reader_thread(tmp_path: Path, fake: FakeProvider) -> None:
    settings = dataclasses.replace(FAST, upstream_read_timeout_s=READ_S)
    transport = GuardTransport(
        ledger=str(tmp_path / "ledger.db"), settings=settings, upstreams={"openai": fake.url}
    )
    client = httpx.Client(transport=transport, timeout=30)
    chat = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "slow"}]}
    answer = client.post(fake.url + "/v1/chat/completions", json=chat, headers=TRICKLE)
    assert answer.status_code == 504, answer.text
    assert "read_timeout_s" in answer.json()["error"]["message"]
    assert _readers(), "the answer was read on a reader thread"
    closing = threading.Thread(target=client.close, daemon=True)
    closing.start()
    ends = time.monotonic() + WAIT_S
    while _readers() and time.monotonic() < ends:
        time.sleep(0.02)
    assert not _readers(), "a reader thread still waits for the cut-off answer's next byte"
    closing.join(timeout=30)
    assert [r["behaviour"] for r in fake.receipts()] == ["trickle=3.9"]
