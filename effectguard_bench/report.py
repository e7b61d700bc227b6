"""Turning samples into rows: added latency, ratios to the baseline, the issue's targets.

Everything here is arithmetic on measured values (no I/O); ``effectguard_bench.cli``
prints the result as tables or as one JSON object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from effectguard_bench.commitfloor import CommitFloor
from effectguard_bench.ledgerbench import LedgerResult
from effectguard_bench.proxybench import SCENARIOS, TARGETS, ProxyResult
from effectguard_bench.recoverybench import RecoveryResult
from effectguard_bench.transportbench import TransportSample

Row = dict[str, Any]


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base <= 0:
        return None
    return round(value / base, 2)


def proxy_rows(result: ProxyResult, concurrencies: Sequence[int]) -> list[Row]:
    """One row per scenario × concurrency × target, with added latency and baseline ratios."""
    rows: list[Row] = []
    for scenario in SCENARIOS:
        for concurrency in concurrencies:
            direct = result.sample(scenario, concurrency, "direct")
            cells: dict[str, Row] = {}
            for target in TARGETS:
                sample = result.sample(scenario, concurrency, target)
                if sample is None or direct is None:
                    continue
                row = sample.to_json()
                row["added_p50_ms"] = _r(sample.load.p50_ms - direct.load.p50_ms)
                row["added_p99_ms"] = _r(sample.load.p99_ms - direct.load.p99_ms)
                ttfb = result.ttfb.get(target) if scenario == "stream" else None
                row["ttfb_ms"] = _r(ttfb.ttfb_p50_ms) if ttfb and concurrency == 1 else None
                cells[target] = row
            base, guarded = cells.get("baseline"), cells.get("effectguard")
            if base is not None and guarded is not None:
                guarded["ratio"] = {
                    key: _ratio(guarded[key], base[key])
                    for key in ("added_p50_ms", "rps", "cpu_ms_per_request", "peak_rss_mb")
                } | {"ttfb_ms": _ratio(guarded["ttfb_ms"], base["ttfb_ms"])}
            rows += cells.values()
    return rows


def transport_rows(samples: list[TransportSample]) -> list[Row]:
    """One row per sample; the guarded rows carry ratios to the plain transport."""
    rows = [s.to_json() for s in samples]
    plain = {(r["scenario"], r["concurrency"]): r for r in rows if r["variant"] == "plain"}
    for row in rows:
        base = plain.get((row["scenario"], row["concurrency"]))
        if row["variant"] == "effectguard" and base is not None:
            row["added_p50_ms"] = _r(row["p50_ms"] - base["p50_ms"])
            row["ratio"] = {
                key: _ratio(row[key], base[key]) for key in ("p50_ms", "rps", "cpu_ms_per_request")
            }
    return rows


@dataclass(frozen=True, slots=True)
class Target:
    """One of the issue's targets and what this run measured for it."""

    name: str
    value: float | None
    limit: float
    at_most: bool = True
    #: What physics alone costs toward this figure on this machine (the durable commits
    #: measured by :mod:`effectguard_bench.commitfloor`), where that is known.
    floor: float | None = None
    floor_note: str = ""

    @property
    def met(self) -> bool | None:
        """Whether the figure is within the target (None: not measured)."""
        if self.value is None:
            return None
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    def to_json(self) -> Row:
        """The target as a JSON-ready dict."""
        return {
            "name": self.name,
            "value": _r(self.value),
            "limit": self.limit,
            "at_most": self.at_most,
            "met": self.met,
            "floor": _r(self.floor),
            "floor_note": self.floor_note,
        }


def _figure(rows: list[Row], key: str, **match: Any) -> float | None:
    """``key`` (``ratio.x`` for a ratio) of the first row matching ``match``, if any."""
    row = next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)
    if row is None:
        return None
    value = row.get("ratio", {}).get(key[6:]) if key.startswith("ratio.") else row.get(key)
    return None if value is None else float(value)


def targets(
    proxy: list[Row],
    result: ProxyResult | None,
    ledger: LedgerResult | None,
    recovery: RecoveryResult | None,
    floor: CommitFloor | None = None,
) -> list[Target]:
    """The issue's targets, each with this run's figure (None where not measured)."""
    out: list[Target] = []
    commit = None if floor is None else floor.sqlite_commit_ms
    if result is not None:
        eg1 = _figure(proxy, "added_p50_ms", scenario="plain", concurrency=1, target="effectguard")
        base1 = _figure(proxy, "added_p50_ms", scenario="plain", concurrency=1, target="baseline")
        eg_ttfb, base_ttfb = result.ttfb.get("effectguard"), result.ttfb.get("baseline")
        ttfb_above = None
        if eg_ttfb and base_ttfb and eg_ttfb.ttfb_p50_ms is not None:
            ttfb_above = eg_ttfb.ttfb_p50_ms - (base_ttfb.ttfb_p50_ms or 0.0)
        peaks = [r["peak_rss_mb"] for r in proxy if r["target"] == "effectguard"]
        out += [
            # Issue #17's targets; the baseline is measured in the same run.
            Target(
                "p50 added above baseline at 1 plain (ms)",
                None if eg1 is None or base1 is None else eg1 - base1,
                0.6,
                floor=None if commit is None else 2 * commit,
                floor_note="two durable commits per call",
            ),
            Target(
                "req/s at 32 plain, ratio to baseline",
                _figure(proxy, "ratio.rps", scenario="plain", concurrency=32, target="effectguard"),
                0.65,
                at_most=False,
            ),
            Target(
                "CPU per request at 32 plain, ratio to baseline",
                _figure(
                    proxy,
                    "ratio.cpu_ms_per_request",
                    scenario="plain",
                    concurrency=32,
                    target="effectguard",
                ),
                1.5,
            ),
            Target(
                "stream TTFB above baseline at 1 (ms)",
                ttfb_above,
                0.6,
                floor=commit,
                floor_note="one durable commit before dispatch",
            ),
            Target("peak RSS under load (MB)", max(peaks) if peaks else None, 80.0),
            Target(
                "start to first served request (s)",
                result.start_to_first_served_s.get("effectguard"),
                1.0,
            ),
        ]
    if recovery is not None:
        out.append(
            Target(
                f"start-up on a ledger of {recovery.calls} calls (s)",
                recovery.start_to_first_served_s,
                2.0,
            )
        )
    if ledger is not None:
        sample = next((s for s in ledger.samples if s.engine == "sqlite" and s.callers == 64), None)
        out.append(
            Target(
                "SQLite admit+settle pairs/s at 64 callers",
                None if sample is None else sample.pairs_per_second,
                3000.0,
                at_most=False,
            )
        )
        storage = ledger.storage
        out += [
            Target(
                "SQLite WAL pages per single-operation commit (worst of admit, observe)",
                None
                if storage is None
                else max(storage.admission_wal_pages, storage.observation_wal_pages),
                4.0,
            ),
            Target(
                "SQLite ledger bytes per call beyond the bodies",
                None if storage is None else storage.overhead_per_call,
                600.0,
            ),
        ]
    return out


def table(rows: list[Row], columns: Sequence[tuple[str, str]]) -> str:
    """A plain-text table: ``columns`` are (header, key); ``ratio.x`` reads a ratio."""
    cells: list[list[str]] = []
    for row in rows:
        line = []
        for _, key in columns:
            value = row.get("ratio", {}).get(key[6:]) if key.startswith("ratio.") else row.get(key)
            line.append("-" if value is None else _cell(value))
        cells.append(line)
    headers = [h for h, _ in columns]
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(headers)]
    out = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    out += ["  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)) for c in cells]
    return "\n".join(out)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.2f}"
    return str(value)
