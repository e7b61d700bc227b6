"""Python heap held and peaked by one multipart upload on the proxy's body path, by step.

``python -m effectguard_bench.uploadmemory [--mib 10]`` builds a multipart body with one
binary file part (random bytes, so the manifest stores it as base64), then measures with
``tracemalloc``, one step after the other and in this process (no ledger is written):

1. the front door reading it as a server hands it over (64 KiB chunks);
2. ``prepare``: parsing and hashing its parts, and encoding it for the manifest;
3. sealing the ``call.manifest`` event (its canonical JSON, which carries the body).

It runs twice: with the front door's spooling off (the body joined in memory, stored
inside its manifest) and at the default ``spool_body_bytes`` (the body in a file, parsed
through a memory map and stored by reference, docs/contract.md §2.5). The ledger's copy
of a spooled body is written in chunks (rules/bodyref): step 4 admits the upload into a
new SQLite ledger, which stores it (inside the manifest, or by reference).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import tracemalloc
from typing import Any

import httpx

from effectguard.callpath.exchange import Outbound
from effectguard.callpath.prepare import prepare
from effectguard.config.defaults import SPOOL_BODY_BYTES
from effectguard.config.settings import GuardSettings
from effectguard.ingress import spool
from effectguard.ledger import Ledger, Writer
from effectguard.providers import load_providers
from effectguard.rules.admission import AdmitRequest
from effectguard.rules.events import GENESIS_DIGEST, CallManifest, seal
from effectguard_bench import ledgerbench

BOUNDARY = "b0undary"
CHUNK = 64 * 1024


def upload(size: int) -> bytes:
    """A ``/v1/files``-style multipart body whose file part has ``size`` random bytes."""
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nassistants\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    )
    return head.encode() + os.urandom(size) + f"\r\n--{BOUNDARY}--\r\n".encode()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


Step = tuple[str, int, int]


def _step(steps: list[Step], name: str) -> None:
    held, peak = tracemalloc.get_traced_memory()
    steps.append((name, held, peak))
    tracemalloc.reset_peak()


async def measure(
    size: int, *, spool_over: int | None, spool_dir: str | None = None, ledger: str | None = None
) -> list[Step]:
    """What each step holds and peaks at for an upload of about ``size`` bytes, the front
    door spooling past ``spool_over`` bytes (None: never, the body stays in memory); with
    ``ledger`` (a new SQLite file), a fourth step admits it there."""
    if ledger is None:
        return await _measure(size, spool_over, spool_dir, None)
    async with Ledger.open(ledger) as opened:
        writer = await ledgerbench.register(opened, lease_s=600)
        return await _measure(size, spool_over, spool_dir, (opened, writer))


async def _measure(
    size: int, spool_over: int | None, spool_dir: str | None, ledger: tuple[Ledger, Writer] | None
) -> list[Step]:
    body = upload(size)
    pos = 0

    async def receive() -> dict[str, Any]:
        nonlocal pos  # a new bytes object per chunk, as a server hands it over
        chunk = body[pos : pos + CHUNK]
        pos += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": pos < len(body)}

    openai = load_providers([])["openai"]
    steps: list[Step] = []
    tracemalloc.start()
    read = await spool.read_body(receive, len(body), spool_over=spool_over, spool_dir=spool_dir)
    try:
        _step(steps, "1. front door read" + (" (spooled)" if read.spool else " (joined)"))
        url = httpx.URL(openai.base_url + "/v1/files")
        content_type = f"multipart/form-data; boundary={BOUNDARY}".encode()
        request = Outbound(
            "POST",
            str(url),
            url.path,
            url.raw_path.decode(),
            [(b"content-type", content_type)],
            read.data,
            spool=read.spool,
        )
        prepared = prepare(openai, request, GuardSettings(), budget="default", budget_root=None)
        assert prepared is not None
        _step(steps, f"2. prepare (parts hashed, body {prepared.admit.body_encoding})")
        sealed = seal(
            _manifest(prepared.admit),
            seq=1,
            worker="w",
            generation=1,
            at=0.0,
            prev_digest=GENESIS_DIGEST,
        )
        _step(steps, "3. call.manifest sealed (canonical JSON)")
        del sealed
        if ledger is not None:
            await ledger[0].admit(ledger[1], prepared.admit)
            _step(steps, "4. admitted into a SQLite ledger (body stored)")
    finally:
        tracemalloc.stop()
        read.discard()
    return steps


def _manifest(a: AdmitRequest) -> CallManifest:
    return CallManifest(
        call="c",
        request_hash=a.request_hash,
        provider=a.provider,
        endpoint=a.endpoint,
        method=a.method,
        model=a.model,
        idempotency_key=None,
        budget=a.budget,
        budget_root=a.budget,
        effect_kind=a.effect_kind,
        body=a.body,
        body_encoding=a.body_encoding,
    )


def _print(title: str, steps: list[Step]) -> None:
    print(title)
    for name, held, peak in steps:
        print(f"  {name:<54} held {_mib(held):>10}  peak {_mib(peak):>10}")


def main() -> None:
    """The command line: ``--mib`` sets the file part's size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=10.0, help="file part size in MiB")
    args = parser.parse_args()
    size = int(args.mib * 2**20)
    print(f"upload of {_mib(size)} (one binary file part)")
    with tempfile.TemporaryDirectory() as tmp:
        held = asyncio.run(measure(size, spool_over=None, ledger=f"{tmp}/held.db"))
        _print("held in memory (spooling off):", held)
        spooled = asyncio.run(
            measure(size, spool_over=SPOOL_BODY_BYTES, ledger=f"{tmp}/spooled.db")
        )
        _print(f"spooled past {_mib(SPOOL_BODY_BYTES)} (the default):", spooled)


if __name__ == "__main__":
    main()
