"""Instructions per request, counted by callgrind: a measure the machine's load cannot move.

Wall and CPU time on a shared 2-core machine move by 15-30% between identical runs, so
small changes on the hot path cannot be told apart by them. ``valgrind --tool=callgrind``
counts the instructions a process executes, the same for the same code and inputs
whatever else runs. This runs a harness twice under callgrind, with ``small`` and
``large`` requests, and prints the difference divided by ``large - small``: start-up,
imports and warm-up cancel out, and what is left is the cost of one request.

``python -m effectguard_bench.instructions [--harness phases|inprocess|ledger]
[--concurrency N] [--by-object] [-- extra harness arguments]``

- ``phases``: one client through the proxy app (:mod:`effectguard_bench.phases`);
- ``inprocess``: N clients through the proxy app (:mod:`effectguard_bench.inprocess`);
  ``--baseline`` after ``--`` counts the bare baseline proxy instead;
- ``ledger``: admit + record pairs on a SQLite ledger, one caller, no proxy.

``--by-object`` splits the count by shared object (the interpreter, SQLite, OpenSSL...).
Needs valgrind (Debian: ``apt-get install valgrind``); each run takes about a minute.
Only user-space instructions count: the kernel's share of a commit (``fdatasync``, the
WAL's writes) is not in these figures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_HARNESS = {
    "phases": ["-m", "effectguard_bench.phases", "--requests"],
    "inprocess": ["-m", "effectguard_bench.inprocess", "--requests"],
    "ledger": ["-m", "effectguard_bench.instructions", "--ledger-pairs"],
}
_LINE = re.compile(r"\s*([\d,]+) \([ \d.]+%\)\s+(.*?)(?:\s+\[(.*?)\])?\s*$")


def _count(out: Path, command: list[str]) -> int:
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *command],
        check=True,
        capture_output=True,
    )
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary in {out}")


def _by_object(out: Path) -> collections.Counter[str]:
    text = subprocess.run(
        ["callgrind_annotate", "--threshold=100", str(out)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return objects_of(text)


def objects_of(annotated: str) -> collections.Counter[str]:
    """Instructions by shared object, from ``callgrind_annotate``'s per-function lines."""
    counts: collections.Counter[str] = collections.Counter()
    for line in annotated.splitlines():
        m = _LINE.match(line)
        if m and m[2] != "PROGRAM TOTALS":
            # callgrind_annotate names the object only where the file alone is ambiguous.
            name = m[3] or ("libpython" if "/Python-3" in m[2] else m[2].split(":", 1)[0])
            counts[name.rsplit("/", 1)[-1]] += int(m[1].replace(",", ""))
    return counts


async def _ledger_pairs(pairs: int) -> None:
    from effectguard.ledger import Ledger
    from effectguard_bench import ledgerbench, storagebench

    with tempfile.TemporaryDirectory() as tmp:
        async with Ledger.open(str(Path(tmp) / "ledger.db")) as ledger:
            writer = await ledgerbench.register(ledger, lease_s=600)
            for _ in range(100 + pairs):  # 100 to warm up, as the other harnesses do
                await storagebench._one_call(ledger, writer, "bench/instructions")
            done = await ledger.calls("completed", limit=100 + pairs)
            print(f"{len(done)} calls completed")


def main(argv: list[str] | None = None) -> int:
    """Count and print instructions per request (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="effectguard_bench.instructions")
    parser.add_argument("--harness", choices=sorted(_HARNESS), default="phases")
    parser.add_argument("--concurrency", type=int, default=32, help="inprocess clients")
    parser.add_argument("--small", type=int, default=400)
    parser.add_argument("--large", type=int, default=1200)
    parser.add_argument("--by-object", action="store_true")
    parser.add_argument("--ledger-pairs", type=int, help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="more arguments for the harness")
    args = parser.parse_args(argv)
    if args.ledger_pairs is not None:
        asyncio.run(_ledger_pairs(args.ledger_pairs))
        return 0
    if shutil.which("valgrind") is None:
        print("effectguard_bench.instructions: valgrind is not installed", file=sys.stderr)
        return 1
    base = [sys.executable, *_HARNESS[args.harness]]
    tail = [*(["--concurrency", str(args.concurrency)] if args.harness == "inprocess" else [])]
    with tempfile.TemporaryDirectory() as tmp:
        outs = {n: Path(tmp) / f"callgrind.{n}" for n in (args.small, args.large)}
        totals = {n: _count(out, [*base, str(n), *tail, *args.extra]) for n, out in outs.items()}
        per = (totals[args.large] - totals[args.small]) / (args.large - args.small)
        what = f"{args.harness} {' '.join(tail + args.extra)}".strip()
        print(f"{what}: {per:,.0f} instructions per request")
        if args.by_object:
            small, large = (_by_object(outs[n]) for n in (args.small, args.large))
            split = {k: (large[k] - small[k]) / (args.large - args.small) for k in large}
            for name, count in sorted(split.items(), key=lambda kv: -kv[1])[:10]:
                print(f"  {count:12,.0f}  {100 * count / per:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
