"""The names of a SQLite ledger's archive files, one per step, and the ``.partial`` files
an archive that stopped may have left under them.

Without ``--out``, step files are ``NAME-archive-FIRST-LAST.jsonl.gz`` beside the ledger.
With ``--out FILE``, the first step's file is ``FILE`` and each further step's is ``FILE``
with its range before the extension (``jan.jsonl.gz``, ``jan-50001-100000.jsonl.gz``).

A step writes ``.FILE.partial`` and renames it once its transaction committed: a crash
in between leaves the only copy of the events it moved in that file. The next archive
names its range anew, so it looks for any partial file under the names this ledger's
(or this ``--out``'s) archives take, not only its own next name, and refuses to run
while one is there. A partial file that an archive running now holds
(:class:`~effectguard.ops.outpath.Held`) is refused as that archive's: the instructions
for a left-over file (verify it, then rename or delete it) would have an operator delete
the events of a step about to commit.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from effectguard.errors import ConfigError
from effectguard.ops.outpath import in_use, partial_of

#: What an archive file's name ends with, where the operator's ``--out`` has it.
_SUFFIXES = (".jsonl.gz", ".gz")


class Names:
    """Where each step of an archive of ``ledger`` writes (``out``: the operator's)."""

    def __init__(self, ledger: Path, out: Path | None) -> None:
        self.ledger = ledger
        self.out = out

    def target(self, first: int, last: int, step: int) -> Path:
        """The file of the step (0 for the first) that archives events ``first..last``."""
        if self.out is None:
            return self.ledger.with_name(f"{self.ledger.stem}-archive-{first}-{last}.jsonl.gz")
        if step == 0:
            return self.out
        base, suffix = _split(self.out.name)
        return self.out.with_name(f"{base}-{first}-{last}{suffix}")

    def _patterns(self) -> list[Path]:
        if self.out is None:
            stem = glob.escape(self.ledger.stem)
            return [self.ledger.with_name(f".{stem}-archive-*.jsonl.gz.partial")]
        base, suffix = _split(self.out.name)
        return [
            partial_of(self.out),
            self.out.with_name(f".{glob.escape(base)}-*-*{glob.escape(suffix)}.partial"),
        ]

    def refuse_stale_partials(self) -> None:
        """``ConfigError`` naming a partial file an earlier archive left under these names."""
        for pattern in self._patterns():
            if glob.has_magic(pattern.name):
                found = sorted(glob.glob(pattern.name, root_dir=pattern.parent))
            else:
                found = [pattern.name] if os.path.lexists(pattern) else []
            if found:
                partial = pattern.with_name(found[0])
                target = partial.with_name(partial.name[1 : -len(".partial")])
                raise ConfigError(left_or_running(partial, target, self.ledger))


def left_or_running(partial: Path, target: Path, ledger: Path) -> str:
    """What to do about ``partial``: wait for the archive writing it, or, where an
    archive to ``target`` stopped and left it, prove it and rename or delete it."""
    if in_use(partial):
        return running(partial)
    return (
        f"{partial} exists: an earlier archive to {target.name} stopped before renaming it "
        f"into place. Run `effectguard verify --archive {partial} --ledger {ledger}`: if it "
        f"passes, the file holds archived events: rename it to {target}; if not, delete it. "
        "Then run archive again"
    )


def running(partial: Path) -> str:
    """The refusal while another archive is writing ``partial``."""
    return (
        f"another archive is running now: it is writing {partial} (leave that file alone); "
        "run archive again once it has finished"
    )


def _split(name: str) -> tuple[str, str]:
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], suffix
    return name, ""
