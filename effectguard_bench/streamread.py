"""What reading a stream's chunks costs the loop: ``python -m effectguard_bench.streamread``.

Every chunk of a guarded stream is read twice on the event loop before it is forwarded:
by the stream reader, for its usage and terminal event (``rules/streamusage``), and, where
effectguard asked an OpenAI stream for its usage, by the filter that keeps the usage event
from the client (``rules/addedusage``). This feeds each of them whole chat streams of
three shapes, and prints the best of ``--repeat`` timings (wall time, this process) per
stream and per chunk, beside a baseline measured in the same run: one count of every
chunk's line ends, the least any reader that finds events must do. The ratio to it is the
figure to compare across machines and runs; the absolute times move with the load.

- ``small``: ``--events`` OpenAI chunks of one short delta each, one event a read, as
  OpenAI sends them;
- ``one-read``: the same stream as a fast upstream hands it over, in 16 KiB reads;
- ``big``: ``--big-events`` events of a 64 KiB delta each (a large answer).

``--callgrind`` counts instructions instead (valgrind's callgrind, each reader run over
one stream and over three, the difference halved): a figure the machine's load cannot move,
for changes too small for wall time on a shared machine. It takes a minute or two.

Run this file by path with another tree first on ``PYTHONPATH`` for a before/after pair
(it imports nothing of :mod:`effectguard_bench`): ``PYTHONPATH=OLD python
effectguard_bench/streamread.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from effectguard.rules.addedusage import AddedUsage
from effectguard.rules.streamusage import StreamUsage

_HEAD = (
    b'data: {"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion.chunk",'
    b'"created":1741570283,"model":"gpt-4o-mini-2024-07-18","system_fingerprint":"fp_06737a9306",'
    b'"choices":[{"index":0,"delta":{"content":"'
)
_TAIL = b'"},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
_USAGE = (
    b'data: {"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion.chunk",'
    b'"created":1741570283,"model":"gpt-4o-mini-2024-07-18","system_fingerprint":"fp_06737a9306",'
    b'"choices":[],"usage":{"prompt_tokens":19,"completion_tokens":300,"total_tokens":319}}\n\n'
)
_DONE = b"data: [DONE]\n\n"


def chat_stream(events: int, delta: bytes) -> list[bytes]:
    """``events`` content events of ``delta``, the usage event and ``[DONE]``, one a read."""
    return [*[_HEAD + delta + _TAIL] * events, _USAGE, _DONE]


def in_reads(chunks: list[bytes], size: int) -> list[bytes]:
    """The same bytes cut into reads of ``size`` (the last shorter)."""
    whole = b"".join(chunks)
    return [whole[at : at + size] for at in range(0, len(whole), size)]


def _best(work: Callable[[], object], repeat: int) -> float:
    """The best of ``repeat`` timings of ``work``, in seconds."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        runs.append(time.perf_counter() - start)
    return min(runs)


def _baseline(chunks: list[bytes]) -> None:
    for chunk in chunks:
        chunk.count(b"\n")


def _reader(chunks: list[bytes]) -> StreamUsage:
    reader = StreamUsage("openai", "/v1/chat/completions")
    for chunk in chunks:
        reader.feed(chunk)
    return reader


def _filter(chunks: list[bytes]) -> list[bytes]:
    shown = AddedUsage()
    out = [shown.feed(chunk) for chunk in chunks]
    out.append(shown.flush())
    return out


def _check(chunks: list[bytes]) -> None:
    """Each reader reads the stream as it should (once, untimed)."""
    reader = _reader(chunks)
    assert reader.finished and reader.result().problem is None
    assert b"".join(_filter(chunks)) == b"".join(chunks).replace(_USAGE, b"")


_READERS: dict[str, Callable[[list[bytes]], object]] = {
    "baseline": _baseline,
    "streamusage": _reader,
    "addedusage": _filter,
}


def measure(name: str, chunks: list[bytes], repeat: int) -> str:
    """One line: per stream and per chunk, each reader's best time and its ratio."""
    _check(chunks)
    base = _best(lambda: _baseline(chunks), repeat)
    cells = [f"{name:9} chunks={len(chunks):5} bytes={sum(map(len, chunks)):9}"]
    cells.append(f"baseline {base * 1e6:8.1f} us")
    for label in ("streamusage", "addedusage"):
        took = _best(lambda label=label: _READERS[label](chunks), repeat)  # type: ignore[misc]
        per = took / len(chunks) * 1e9
        cells.append(f"{label} {took * 1e6:8.1f} us ({per:6.0f} ns/chunk, x{took / base:5.1f})")
    return "  ".join(cells)


def _instructions(args: list[str], passes: int) -> int:
    """What callgrind counts for one run of this file with ``--run ARGS --passes N``."""
    with tempfile.TemporaryDirectory() as where:
        out = Path(where) / "callgrind.out"
        command = [sys.executable, os.path.abspath(__file__), "--run", *args]
        command += ["--passes", str(passes)]
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *command],
            check=True,
            capture_output=True,
        )
        summary = next(x for x in out.read_text().splitlines() if x.startswith("summary:"))
        return int(summary.split()[1])


def counted(name: str, chunks: list[bytes], argv: list[str]) -> str:
    """One line: each reader's instructions per stream and per chunk, and the ratio."""
    per_stream = {
        label: (_instructions([name, label, *argv], 3) - _instructions([name, label, *argv], 1))
        // 2
        for label in _READERS
    }
    cells = [f"{name:9} chunks={len(chunks):5} baseline {per_stream['baseline']:11,} Ir"]
    for label in ("streamusage", "addedusage"):
        ir = per_stream[label]
        ratio = ir / per_stream["baseline"]
        cells.append(f"{label} {ir:12,} Ir ({ir // len(chunks):7,} Ir/chunk, x{ratio:5.1f})")
    return "  ".join(cells)


def main() -> None:
    """Print one line per stream shape."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000, help="small events (default 2000)")
    parser.add_argument("--big-events", type=int, default=64, help="64 KiB events (default 64)")
    parser.add_argument("--repeat", type=int, default=15, help="timings per figure (default 15)")
    parser.add_argument("--callgrind", action="store_true", help="count instructions instead")
    parser.add_argument("--run", nargs=2, metavar=("SHAPE", "READER"), help=argparse.SUPPRESS)
    parser.add_argument("--passes", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    small = chat_stream(args.events, b" word")
    shapes = {
        "small": small,
        "one-read": in_reads(small, 16 << 10),
        "big": chat_stream(args.big_events, b"y" * (64 << 10)),
    }
    if args.run:  # one reader, for callgrind to count
        shape, label = args.run
        for _ in range(args.passes):
            _READERS[label](shapes[shape])
        return
    sizes = ["--events", str(args.events), "--big-events", str(args.big_events)]
    for name, chunks in shapes.items():
        line = (
            counted(name, chunks, sizes) if args.callgrind else measure(name, chunks, args.repeat)
        )
        print(line, flush=True)


if __name__ == "__main__":
    main()
