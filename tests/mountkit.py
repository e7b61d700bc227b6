"""Filesystems a test can break: a small tmpfs of its own, and that tmpfs remounted
read-only for a while (root only; the tests skip where mounting is not allowed)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tiny tmpfs mounted at ``where`` (skips the test where mounting is not allowed)."""
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@contextlib.contextmanager
def read_only(disk: Path) -> Iterator[None]:
    """``disk`` (a tmpfs) remounted read-only for the block (skips where that is refused)."""
    done = subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], capture_output=True)
