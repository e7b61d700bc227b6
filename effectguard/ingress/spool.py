"""Reading a request body at the proxy's front door: in memory, or spooled to a file.

A multipart upload (OpenAI's ``/v1/files``, audio, image edits) can be as large as
``max_body_bytes``. Held whole, it was copied four more times on its way into the ledger
(joined, base64-encoded, sealed into the manifest's JSON): about five times its size in
the heap (docs/performance.md, "Large uploads"). So once a multipart body grows past
``spool_body_bytes`` it goes to a file instead, hashed as it arrives; it is parsed
from that file, stored in the ledger by reference (rules/bodyref) and sent upstream
from it. Other bodies stay in memory: a JSON or form body must be parsed whole anyway.

The file is private (``mkstemp``, mode 0600) and removed when the request is done
(:meth:`Body.discard`): the ledger's copy is the durable one. A process killed mid-request
cannot remove its files, so each name carries its process id and a proxy starting up
removes the files of processes that no longer run (:func:`sweep`); replicas and tests
sharing one directory never lose a live upload to each other.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from effectguard.callpath.bodies import MULTIPART
from effectguard.errors import Refusal
from effectguard.rules.bodyref import SpooledBody

__all__ = ["PREFIX", "Body", "TooLarge", "read_body", "spools", "sweep"]


#: Spool files are named ``effectguard-body-<pid>-<random>``.
PREFIX = "effectguard-body-"


def sweep(directory: str | None) -> int:
    """Remove the spool files of processes that no longer run; how many were removed."""
    removed = 0
    for entry in os.scandir(directory or tempfile.gettempdir()):
        owner = entry.name.removeprefix(PREFIX).split("-", 1)[0]
        if not entry.name.startswith(PREFIX) or not owner.isdigit() or _alive(int(owner)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


class TooLarge(Exception):
    """The body grew past ``max_body_bytes`` while it was read."""


@dataclass(slots=True)
class Body:
    """A request body as read: its bytes, or (``spool`` set, ``data`` empty) its file."""

    data: bytes
    spool: SpooledBody | None = None

    def discard(self) -> None:
        """Remove the spool file, if any (idempotent)."""
        if self.spool is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.spool.path)


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
    except BaseException:
        if sink is not None:
            sink.abandon()
        raise
    if sink is None:
        return Body(b"".join(chunks))
    return Body(b"", sink.finish())


class _Sink:
    """A spool file being written, and the SHA-256 of what went into it."""

    def __init__(self, directory: str | None) -> None:
        fd, self.path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=directory)
        self._file = os.fdopen(fd, "wb")
        self._sha = hashlib.sha256()
        self._size = 0

    def write(self, chunk: bytes) -> None:
        # A write to the page cache: far quicker than the network that delivered it.
        self._file.write(chunk)
        self._sha.update(chunk)
        self._size += len(chunk)

    def finish(self) -> SpooledBody:
        self._file.close()
        return SpooledBody(self.path, self._size, self._sha.hexdigest())

    def abandon(self) -> None:
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
