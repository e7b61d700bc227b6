"""Reading a receipt log while the process that appends to it is still running."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_receipts"]


def read_receipts(path: Path) -> list[dict[str, Any]]:
    """The log's finished lines, parsed; no file is no receipts.

    A last line without its newline is a write still under way (or cut by a kill) and
    is left out: Linux copies a write into the page cache a page at a time, so a reader
    can see the first part of a line that crosses a page boundary before the rest.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    finished = text.split("\n")[:-1]
    return [json.loads(line) for line in finished if line.strip()]
