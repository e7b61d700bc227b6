"""How long the operator page's spend chart takes on a ledger of N completed calls.

    python -m effectguard_bench.spendbench --calls 50000 [--ledger PATH | --pg DSN] [--repeats 5]

Fills a ledger (unless ``--ledger`` names one already filled) with ``--calls`` calls
admitted and completed now, as the guard records them (``ledgerbench``), then times the
page's spend query and table (``AdminPage._spend``, the HTML included) over its default
14-day window: every call is in the window. The fill is not timed. ``--pg`` fills and
times a PostgreSQL ledger instead (give it a schema of its own: ``?schema=spendbench``;
a schema that already holds calls is timed as it is).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from effectguard.config.settings import AdminSettings
from effectguard.ingress.admin.routes import AdminPage
from effectguard.ledger import Ledger
from effectguard_bench import ledgerbench

#: Concurrent callers while filling (group commit batches their writes).
_FILLERS = 64


async def fill(url: str, calls: int) -> None:
    """Admit and complete ``calls`` calls on the ledger at ``url``."""
    async with Ledger.open(url) as ledger:
        writer = await ledgerbench.register(ledger, lease_s=3600)
        budget = "bench/spend"
        left = calls

        async def caller() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                admitted = await ledger.admit(writer, ledgerbench.admit_request(budget))
                if admitted.action != "admit":
                    raise RuntimeError(f"admission refused: {admitted.refusal}")
                events = ledgerbench.outcome_events(
                    admitted.call_id, admitted.attempt, budget, ledgerbench.RESERVE
                )
                await ledger.record(writer, admitted.call_id, admitted.attempt, events)

        await asyncio.gather(*(caller() for _ in range(_FILLERS)))


async def time_spend(url: str, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds each of ``repeats`` renderings of the spend chart took (the first one too),
    and the CPU seconds each spent on the event loop's thread: the time the proxy's loop
    served no other request (a SQLite read runs on a reader thread and is not counted)."""
    async with Ledger.open(url) as ledger:
        page = AdminPage(AdminSettings(), ledger)
        times, loop_cpu = [], []
        for _ in range(repeats):
            began, began_cpu = time.perf_counter(), time.thread_time()
            await page._spend(None)
            times.append(time.perf_counter() - began)
            loop_cpu.append(time.thread_time() - began_cpu)
        return times, loop_cpu


async def _has_calls(url: str) -> bool:
    async with Ledger.open(url) as ledger:
        return bool(await ledger.calls(limit=1))


def main() -> None:
    """Fill a ledger (or take one) and print the spend chart's timings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--ledger", help="a SQLite ledger to time (kept; filled if new)")
    parser.add_argument("--pg", help="a PostgreSQL ledger's DSN to time (filled if empty)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(args.ledger or Path(scratch) / "spend.db")
        url = args.pg or str(path)
        if not (asyncio.run(_has_calls(url)) if args.pg else path.exists()):
            began = time.perf_counter()
            asyncio.run(fill(url, args.calls))
            print(f"filled {args.calls} calls in {time.perf_counter() - began:.1f} s")
        times, loop_cpu = asyncio.run(time_spend(url, args.repeats))
    shown = ", ".join(f"{t * 1000:.0f}" for t in times)
    print(f"spend chart: median {statistics.median(times) * 1000:.0f} ms ({shown} ms)")
    print(f"event loop thread CPU: median {statistics.median(loop_cpu) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
