"""How commands print: docs/contract.md §8 JSON objects, plain tables, and ``--json`` switching."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from typing import Any

from effectguard.rules import notes
from effectguard.rules.budget import BudgetNode, BudgetPolicy
from effectguard.rules.money import nanos_to_usd
from effectguard.rules.workstate import WorkState


def money(nanos: int | None) -> str | None:
    """USD as a decimal string, or None."""
    return None if nanos is None else nanos_to_usd(nanos)


def iso(at: float | None) -> str | None:
    """Unix seconds as ISO 8601 UTC to the second (``2026-12-01T02:44:09Z``), or None."""
    if not at:
        return None
    try:
        moment = dt.datetime.fromtimestamp(at, tz=dt.UTC).replace(microsecond=0)
    except (ValueError, OverflowError, OSError):
        # A ledger written before the CLI bounded its dates may hold an instant past the
        # calendar's end (a key's expiry in year 10000): say so rather than fail the listing.
        return _PAST_THE_CALENDAR if at > 0 else _BEFORE_THE_CALENDAR
    return moment.isoformat().replace("+00:00", "Z")


_PAST_THE_CALENDAR = "after 9999-12-31T23:59:59Z"
_BEFORE_THE_CALENDAR = "before 0001-01-01T00:00:00Z"


def age(at: float, now: float) -> str:
    """How long ago ``at`` was, in the two largest units (``45s``, ``3m12s``, ``2d4h``);
    negative (``-2m30s``) for a time ahead of this host's clock: written by a replica
    whose clock is ahead, or here before the clock was stepped back. Shown as ``0s``, such
    a call would read as admitted just now, whatever it waits for."""
    seconds = int(now - at)  # toward zero: less than a second either way is 0s
    if seconds < 0:
        return "-" + _span(-seconds)
    return _span(seconds)


def ago(at: float, now: float) -> str:
    """:func:`age` in words: ``3m12s ago``, or ``2m30s ahead of this host's clock``."""
    shown = age(at, now)
    if shown.startswith("-"):
        return f"{shown[1:]} ahead of this host's clock"
    return f"{shown} ago"


def _span(seconds: int) -> str:
    """A non-negative number of seconds in the two largest units."""
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size or (unit == "s" and not parts):
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts[:2])


def call_json(state: WorkState) -> dict[str, Any]:
    """A call as the docs/contract.md §8 JSON object."""
    return {
        "call_id": state.call_id,
        "idempotency_key": state.idempotency_key,
        "stage": state.stage,
        "effect": state.effect,
        "next_operation": state.next_operation,
        "budget": state.budget,
        "provider": state.provider,
        "model": state.model,
        "attempts": state.attempts,
        "reserved_usd": nanos_to_usd(state.reserved_at_admission),
        "cost_usd": money(state.settled_cost),
        "held_usd": nanos_to_usd(state.held),
        "status": state.status,
        "flagged": state.flagged,
        "created_at": state.created_at,
        "created_at_iso": iso(state.created_at),
    }


def budget_json(node: BudgetNode, policy: BudgetPolicy | None = None) -> dict[str, Any]:
    """A budget node in one period as the docs/contract.md §8 JSON object, with its policy."""
    p = policy or BudgetPolicy(node.path)
    return {
        "path": node.path,
        "period": node.period,
        "limit_usd": money(node.limit),
        "reserved_usd": nanos_to_usd(node.reserved),
        "spent_usd": nanos_to_usd(node.spent),
        "held_usd": nanos_to_usd(node.held),
        "resets": p.period,
        "tz": p.tz,
        "rpm": p.rpm,
        "tpm": p.tpm,
        "concurrency": p.concurrency,
    }


def table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` as aligned text columns under upper-case headings (``-`` for None)."""
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def say(text: str, *, err: bool = False, flush: bool = False) -> None:
    """Print ``text`` (to stderr with ``err``) as a person's terminal should get it: a path
    or name holding a direction override or a control character (pasted, or a ledger's)
    shows those as escapes, never reordering or recolouring the rest of the line."""
    print(notes.terminal_safe(text), file=sys.stderr if err else sys.stdout, flush=flush)


def emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    """Print ``payload`` as JSON with ``--json``, else ``text``."""
    print(json.dumps(payload, indent=2) if args.json else notes.terminal_safe(text))
