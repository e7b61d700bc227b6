"""Reading a request body at the proxy's front door: in memory, or spooled to a file.

A multipart upload (OpenAI's ``/v1/files``, audio, image edits) can be as large as
``max_body_bytes``. Held whole, it was copied four more times on its way into the ledger
(joined, base64-encoded, sealed into the manifest's JSON): about five times its size in
the heap (docs/performance.md, "Large uploads"). So once a multipart body grows past
``spool_body_bytes`` it goes to a file instead, hashed as it arrives; it is parsed
from that file, stored in the ledger by reference (rules/bodyref) and sent upstream
from it (:class:`SpoolReader`). Other bodies stay in memory: a JSON or form body must be
parsed whole anyway.

The file is private (``mkstemp``, mode 0600) and removed when the request is done
(:meth:`Body.discard`): the ledger's copy is the durable one. While its request lives,
the file stays open with an exclusive ``flock`` on it, which the kernel drops when the
process dies, however it dies. A proxy starting up removes the spool files nobody holds
(:func:`sweep`): those of processes killed mid-request. A lock, unlike a process id,
means the same in every PID namespace on the host, so replicas sharing a directory never
remove each other's live uploads, and a reused pid never keeps a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import IO, Any

import httpx

from effectguard.callpath.bodies import MULTIPART
from effectguard.errors import Refusal
from effectguard.rules.bodyref import CHUNK_BYTES, SpooledBody

__all__ = ["PREFIX", "Body", "SpoolReader", "TooLarge", "read_body", "spools", "sweep"]

log = logging.getLogger("effectguard.ingress.spool")

#: Spool files are named ``effectguard-body-<pid>-<random>`` (the pid is for people).
PREFIX = "effectguard-body-"
#: A file younger than this is never swept: it may be between its creation and its lock.
SWEEP_GRACE_S = 5.0


class TooLarge(Exception):
    """The body grew past ``max_body_bytes`` while it was read."""


@dataclass(slots=True)
class Body:
    """A request body as read: its bytes, or (``spool`` set, ``data`` empty) its file."""

    data: bytes
    spool: SpooledBody | None = None
    #: The spool file, open and locked for as long as the request lives.
    held: IO[bytes] | None = None

    def discard(self) -> None:
        """Remove the spool file and let go of it, if any (idempotent)."""
        if self.spool is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.spool.path)
        if self.held is not None:
            self.held.close()
            self.held = None


def spools(content_type: str | None) -> bool:
    """Whether a body of this ``Content-Type`` is spooled once it is large."""
    return (content_type or "").split(";", 1)[0].strip().lower() == MULTIPART


async def read_body(
    receive: Any, limit: int, *, spool_over: int | None, spool_dir: str | None
) -> Body:
    """Read the ASGI request body, at most ``limit`` bytes (else :class:`TooLarge`);
    past ``spool_over`` bytes (None: never) the rest goes to a file in ``spool_dir``."""
    chunks: list[bytes] = []
    size = 0
    sink: _Sink | None = None
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refusal(400, "client_disconnected", "the client went away")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise TooLarge
            if sink is not None:
                sink.write(chunk)
            elif spool_over is not None and size > spool_over:
                sink = _Sink(spool_dir)
                for held in chunks:
                    sink.write(held)
                sink.write(chunk)
                chunks.clear()
            else:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if sink is None:
            return Body(b"".join(chunks))
        return sink.finish()
    except BaseException:
        if sink is not None:
            sink.abandon()
        raise


class _Sink:
    """A spool file being written, and the SHA-256 of what went into it."""

    def __init__(self, directory: str | None) -> None:
        fd, self.path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory)
        self._file = os.fdopen(fd, "wb")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours while the request lives
        except BaseException:
            self.abandon()
            raise
        self._sha = hashlib.sha256()
        self._size = 0

    def write(self, chunk: bytes) -> None:
        # A write to the page cache: far quicker than the network that delivered it.
        self._file.write(chunk)
        self._sha.update(chunk)
        self._size += len(chunk)

    def finish(self) -> Body:
        self._file.flush()
        spooled = SpooledBody(self.path, self._size, self._sha.hexdigest())
        return Body(b"", spooled, self._file)

    def abandon(self) -> None:
        # Unlinked whatever closing says: a full disk fails the flush inside close().
        try:
            self._file.close()
        except OSError:
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class SpoolReader:
    """A spooled upload as aiohttp sends it: chunks of a file opened before the send,
    read off the loop, and closed by whoever finishes with it (aiohttp's body writer,
    however early the upstream answers, or the send that failed before it started)."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file

    @classmethod
    def open(cls, body: SpooledBody) -> SpoolReader:
        """The reader of ``body``'s file; a file already gone means nothing was sent."""
        try:
            return cls(open(body.path, "rb"))
        except OSError as exc:
            raise httpx.ConnectError(f"the spooled request body is gone: {exc}") from exc

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            while chunk := await asyncio.to_thread(self._file.read, CHUNK_BYTES):
                yield chunk
        finally:
            self.close()

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()


def sweep(directory: str | None) -> int:
    """Remove the spool files no live process holds; how many were removed. Never fails:
    a start-up must not be stopped by what another user left in a shared directory."""
    removed = 0
    now = time.time()
    try:
        entries = list(os.scandir(directory or tempfile.gettempdir()))
    except OSError as exc:
        log.warning("cannot list the spool directory: %s", exc)
        return 0
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if _orphaned(entry, now):
                os.unlink(entry.path)
                removed += 1
        except OSError as exc:  # gone meanwhile, another user's, or unreadable: not ours
            log.debug("spool sweep skips %s: %s", entry.path, exc)
    return removed


def _orphaned(entry: os.DirEntry[str], now: float) -> bool:
    """Whether ``entry`` is this user's old spool file that no process holds locked."""
    if not entry.is_file(follow_symlinks=False):
        return False
    stat = entry.stat(follow_symlinks=False)
    if stat.st_uid != os.getuid() or now - stat.st_mtime < SWEEP_GRACE_S:
        return False
    fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a live request holds it
    finally:
        os.close(fd)
    return True
