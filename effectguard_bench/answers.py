"""What one large upstream answer costs the proxy: ``python -m effectguard_bench.answers``.

A billable answer is held whole until its observation is written, so its size is memory
in the proxy and bytes in the ledger; past ``max_answer_bytes`` it is not read further
(docs/contract.md §3.4). For each case this runs a fresh ``effectguard serve`` on a new
SQLite ledger in front of the fake provider, sends one chat completion whose answer the
fake pads (``x-fake-behaviour: pad=N``) or never ends (``endless``), and prints the status,
the time, the proxy's peak RSS (``VmHWM``), what the ledger grew by, and the longest
``/healthz`` answer measured alongside (what the one answer cost every other client).

Run it with another tree first on ``PYTHONPATH`` for a before/after pair
(docs/performance.md, "An upstream's answer, bounded").
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import httpx

from effectguard.testing import fake_provider, running_proxy

CHAT = "/openai/v1/chat/completions"


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _ledger_mb(ledger: Path) -> float:
    files = [ledger, ledger.with_name(ledger.name + "-wal")]
    return sum(f.stat().st_size for f in files if f.exists()) / 2**20


def measure(tmp: Path, behaviour: str, stream: bool) -> str:
    """One answer through a fresh proxy, as a line of figures."""
    ledger = tmp / f"{behaviour}-{stream}.db"
    with (
        fake_provider(tmp / "receipts.jsonl") as fake,
        running_proxy(ledger, upstreams={"openai": fake.url}) as proxy,
    ):
        before = _ledger_mb(ledger)
        pings: list[float] = []
        done = threading.Event()

        def ping() -> None:
            while not done.is_set():
                start = time.perf_counter()
                httpx.get(proxy.url + "/healthz", timeout=30)
                pings.append(time.perf_counter() - start)
                time.sleep(0.01)

        pinger = threading.Thread(target=ping)
        pinger.start()
        message = {"role": "user", "content": "hi"}
        body = {"model": "gpt-4o-mini", "messages": [message], "stream": stream}
        headers = {"x-fake-behaviour": behaviour}
        start = time.perf_counter()
        received, outcome = 0, ""
        try:
            with httpx.stream(
                "POST", proxy.url + CHAT, json=body, headers=headers, timeout=300
            ) as response:
                for chunk in response.iter_raw():
                    received += len(chunk)
                outcome = str(response.status_code)
        except httpx.HTTPError as exc:
            outcome = f"{type(exc).__name__}"
        seconds = time.perf_counter() - start
        done.set()
        pinger.join()
        peak = _peak_rss_mb(proxy.process.pid)
        grown = _ledger_mb(ledger) - before
    kind = "stream" if stream else "body"
    return (
        f"{behaviour:>14} {kind:>6}  {outcome:>18}  {seconds:7.2f} s  client got "
        f"{received / 2**20:7.1f} MiB  proxy peak RSS {peak:7.1f} MB  ledger +{grown:7.1f} MiB"
        f"  /healthz max {max(pings, default=0) * 1000:6.1f} ms"
    )


def main() -> None:
    """The command line: ``--mib`` sets the padded answers' size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, action="append", help="padded answer sizes (MiB)")
    parser.add_argument("--no-endless", action="store_true", help="skip the endless answers")
    args = parser.parse_args()
    cases = [f"pad={mib << 20}" for mib in args.mib or [60, 300]]
    cases += [] if args.no_endless else ["endless"]
    with tempfile.TemporaryDirectory() as tmp:
        for behaviour in cases:
            for stream in (False, True):
                print(measure(Path(tmp), behaviour, stream), flush=True)


if __name__ == "__main__":
    main()
