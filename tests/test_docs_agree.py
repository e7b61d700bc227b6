"""The reference tables of docs/ against the code they describe: every metric, every
event field, every config key and every ``--ledger`` default the docs name is one the
software has, and the other way round. Each table is where a user looks things up, so a
name missing from it is a thing they cannot find, and a name only in it is a promise the
software does not keep."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from effectguard import GuardSettings
from effectguard.callpath.crash import POINTS
from effectguard.config import readkeys
from effectguard.config.settings import load_settings
from effectguard.ledger.sqliteevents import FIELDS
from effectguard.ops.cli import build_parser
from effectguard.providers import load_providers
from effectguard.rules.workstate import STAGE_TABLE, STAGES
from effectguard.telemetry.metrics import (
    MAX_BUDGET_SERIES,
    MAX_LABEL_VALUES,
    OTHER_BUDGETS,
    LedgerSnapshot,
    Metrics,
    _gauges,
)

DOCS = Path(__file__).resolve().parent.parent / "docs"
DIGEST = "ab" * 32


def _section(text: str, heading: str) -> str:
    """The text of the section under ``heading``, up to the next heading of any level."""
    start = text.index(heading) + len(heading)
    following = re.search(r"^#", text[start:], re.M)
    return text[start : start + following.start()] if following else text[start:]


def test_the_metrics_table_lists_every_metric_and_only_those() -> None:
    """docs/metrics.md's table has one row per metric family the proxy exposes."""
    metrics = Metrics()
    exposed = {
        line.split()[2]: line.split()[3]
        for line in generate_latest(metrics.registry).decode().splitlines()
        if line.startswith("# TYPE ") and not line.split()[2].endswith("_created")
    }
    exposed |= {family.name: family.type for family in _gauges(LedgerSnapshot(), [])}
    table = _section((DOCS / "metrics.md").read_text(), "## The metrics")
    documented = {
        name: kind.split()[0]
        for name, kind in re.findall(r"^\| `(effectguard_\w+)` \| ([a-z ()]+) \|", table, re.M)
    }
    assert documented == exposed


def test_every_metric_is_on_the_dashboard_or_says_it_is_not() -> None:
    """Each metric of docs/metrics.md's table is read by a query of the shipped Grafana
    dashboard, or its row says "not on the dashboard": an operator looking for a number
    the table promises finds it on the dashboard or knows to query it by hand."""
    import json

    dashboard = json.loads(
        (DOCS.parent / "grafana" / "dashboards" / "effectguard.json").read_text()
    )
    exprs: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            exprs.extend(target["expr"] for target in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    read = set(re.findall(r"\b(effectguard_\w+?)(?:_bucket|_count|_sum)?\b", " ".join(exprs)))
    table = _section((DOCS / "metrics.md").read_text(), "## The metrics")
    rows = dict(re.findall(r"^\| `(effectguard_\w+)` \|(.*)$", table, re.M))
    assert rows
    missing = [n for n, row in rows.items() if n not in read and "not on the dashboard" not in row]
    assert not missing, f"neither on the dashboard nor said to be missing from it: {missing}"


def test_every_documented_outcome_starts_at_zero() -> None:
    """The request outcomes docs/metrics.md lists are those a model's first count makes at
    0 (firstseries): an outcome left out would miss its first count in every rate."""
    from effectguard.telemetry.firstseries import OUTCOMES

    text = (DOCS / "metrics.md").read_text()
    listed = text[text.index("- `outcome`: ") : text.index("`replayed` and `joined` are also")]
    assert re.findall(r"`([a-z_]+)`", listed)[1:] == list(OUTCOMES)


def test_the_metrics_page_states_every_label_cap() -> None:
    """docs/metrics.md gives the bounds that keep a client from adding series without end
    (models and providers per label, budget series), with the series the rest go to: a
    dashboard author meets ``budget="_other"`` and must be able to look it up."""
    labels = (DOCS / "metrics.md").read_text()
    text = " ".join(labels.split())
    assert f"capped at {MAX_LABEL_VALUES} per provider" in text
    assert f"at most {MAX_LABEL_VALUES} providers" in text
    assert f"{MAX_BUDGET_SERIES} budget series" in text
    assert f'`budget="{OTHER_BUDGETS}"`' in text


def test_the_event_table_names_every_stored_field() -> None:
    """docs/contract.md §6.1 names, for each event kind, every field the ledger stores."""
    table = _section((DOCS / "contract.md").read_text(), "### §6.1 Event kinds")
    rows = dict(re.findall(r"^\| `([a-z]+\.[a-z_]+)` \| ([^|]*) \|", table, re.M))
    assert set(rows) >= set(FIELDS), set(FIELDS) - set(rows)
    missing = {
        kind: [f for f in fields if f"`{f}`" not in rows[kind]] for kind, fields in FIELDS.items()
    }
    assert not {kind: fields for kind, fields in missing.items() if fields}


def _asked_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, set[str]]:
    """The keys ``load_settings`` reads, per table, from a file with every table present."""
    seen: list[readkeys.Tracked] = []
    tracked = readkeys.tracked

    def recording(document: dict[str, Any]) -> readkeys.Tracked:
        seen.append(tracked(document))
        return seen[-1]

    monkeypatch.setattr(readkeys, "tracked", recording)
    config = tmp_path / "c.toml"
    key = f'sha256 = "{DIGEST}"\nbudget_root = "a"\n'
    config.write_text(f"[server]\n[guard]\n[upstream]\n[retention]\n[budgets]\n[[keys]]\n{key}")
    load_settings(config=config, environ={})
    top = seen[0]
    asked = {"": top.asked - {"server", "guard", "upstream", "retention", "keys", "admin"}}
    for table in ("server", "guard", "upstream", "retention"):
        asked[table] = set(top[table].asked)
    asked["keys"] = set(top["keys"][0].asked)
    return {table: keys - {"budgets"} for table, keys in asked.items()}


def test_the_config_tables_list_every_key_serve_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/configuration.md has a row for each key of its tables that serve reads, and
    none that it does not ([admin] is documented in operations.md)."""
    text = (DOCS / "configuration.md").read_text()
    documented: dict[str, set[str]] = {}
    for heading, table in (
        ("### Top level", ""),
        ("### `[server]`", "server"),
        ("### `[guard]`", "guard"),
        ("### `[upstream]`", "upstream"),
        ("### `[retention]`", "retention"),
        ("### `[[keys]]`", "keys"),
    ):
        rows = _section(text, heading)
        documented[table] = set(re.findall(r"^\| `([a-z_0-9]+)` \|", rows, re.M))
    assert documented == _asked_keys(tmp_path, monkeypatch)


def _verbs(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> dict[str, Any]:
    found: dict[str, Any] = {" ".join(words): parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= _verbs(sub, (*words, name))
    return found


def test_every_ledger_flag_says_where_the_ledger_comes_from_without_it() -> None:
    """Every command finds its ledger by --ledger, the config file, $EFFECTGUARD_LEDGER and
    ./effectguard.db (contract §8): each --help says so, serve's included. (sim's --ledger
    names an engine, not a ledger.)"""
    for verb, parser in _verbs(build_parser()).items():
        for action in parser._actions:
            if "--ledger" in action.option_strings and action.choices is None:
                assert "$EFFECTGUARD_LEDGER" in (action.help or ""), verb


def test_every_environment_variable_the_package_reads_is_in_the_table() -> None:
    """docs/configuration.md's environment table names every ``EFFECTGUARD_*`` variable
    the package's code mentions (an operator cannot set what they cannot find)."""
    package = Path(__file__).resolve().parent.parent / "effectguard"
    used = {
        name
        for source in package.rglob("*.py")
        for name in re.findall(r"\bEFFECTGUARD_[A-Z_]+\b", source.read_text())
    }
    table = _section((DOCS / "configuration.md").read_text(), "## Environment variables")
    listed = set(re.findall(r"^\| `(EFFECTGUARD_[A-Z_]+)` \|", table, re.M))
    assert used <= listed, used - listed


#: The refusals the contract fixes by status and name (§4, §5, §9 and the second wave's
#: §12): each needs its row in docs/contract.md §9.1, since a client matches on them.
CONTRACT_REFUSALS = {
    (400, "model_not_priced"),
    (400, "invalid_request"),
    (401, "unknown_key"),
    (402, "budget_exceeded"),
    (403, "budget_forbidden"),
    (404, "unknown_provider"),
    (409, "in_progress"),
    (409, "effect_unknown"),
    (409, "drift"),
    (409, "reconciled_applied"),
    (409, "late_answer_applied"),
    (413, "request_too_large"),
    (422, "idempotency_key_reused"),
    (429, "rate_limited"),
    (500, "internal_error"),
    (503, "ledger_unavailable"),
}

#: The headers the contract names (§1, §4, §9 and the second wave's rate limits).
CONTRACT_HEADERS = {
    "retry-after",
    "Idempotency-Key",
    "Effectguard-Budget",
    "Effectguard-Retry-Of",
    "Effectguard-Call-Id",
    "Effectguard-Replayed",
    "x-stainless-retry-count",
    "x-should-retry",
}


def test_the_stage_table_is_the_projections() -> None:
    """docs/contract.md §6 has one row per stage, with the effect and next operation that
    ``work_state`` gives it: the names ``calls``, ``show`` and every 409 carry."""
    table = _section((DOCS / "contract.md").read_text(), "## §6 Work states")
    rows = re.findall(r"^\| `([a-z_]+)` \| [^|]* \| `([a-z]+)` \| `([a-z]+)`", table, re.M)
    assert {stage: (effect, nxt) for stage, effect, nxt in rows} == {
        stage: STAGE_TABLE[stage] for stage in STAGES
    }


def test_the_crash_point_table_lists_every_point_and_only_those() -> None:
    """docs/contract.md §11.1 names every ``EFFECTGUARD_CRASH_AT`` point the code accepts."""
    table = _section((DOCS / "contract.md").read_text(), "### §11.1 Crash points")
    assert set(re.findall(r"^\| `([a-z:-]+)` \|", table, re.M)) == set(POINTS)


def test_the_contract_states_every_refusal_and_header_it_fixes() -> None:
    """docs/contract.md §9.1 has a row for each refusal status and type the contract fixes,
    and §9.2 one for each header it names (users read the docs, not the contract)."""
    text = (DOCS / "contract.md").read_text()
    statuses = _section(text, "### §9.1 Statuses and types")
    rows = {(int(s), t) for s, t in re.findall(r"^\| (\d{3}) \| `([a-z_]+)`", statuses, re.M)}
    assert rows >= CONTRACT_REFUSALS, CONTRACT_REFUSALS - rows
    headers = _section(text, "### §9.2 Headers")
    named = set(re.findall(r"^\| `([A-Za-z-]+)` \|", headers, re.M))
    assert named >= CONTRACT_HEADERS, CONTRACT_HEADERS - named


_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
#: Options every ledger command has, stated once at the top of docs/contract.md §8.
_COMMON_OPTIONS = {"-h", "--help", "--ledger", "--config", "--json"}
#: Commands whose §8 heading is ``...``: their synopsis is the ``sh`` block under this heading.
_SYNOPSIS_ELSEWHERE = {
    "serve": "### §1.1 The proxy",
    "fake-provider": "### §11.2 The fake provider",
}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def _command_of(words: list[str], verbs: dict[str, Any]) -> str | None:
    """The longest command (``key new`` before ``key``) that ``words`` begins with."""
    for n in (2, 1):
        if words[:n] and " ".join(words[:n]) in verbs:
            return " ".join(words[:n])
    return None


def test_each_command_synopsis_in_the_contract_lists_its_options() -> None:
    """Each synopsis of docs/contract.md §8 (``### `effectguard VERB [--flag ...]` ``, and
    for ``serve`` and ``fake-provider`` the block their ``...`` points to) names only
    options its command has, and every option its command has but the shared ones: a user
    reads the heading as the command's usage, so one it leaves out is one they never find
    (``verify --archive`` was missing)."""
    verbs = _verbs(build_parser())
    text = (DOCS / "contract.md").read_text()
    named: dict[str, set[str]] = {}
    chapter = text[text.index("## §8 The command line") : text.index("## §9 ")]
    for heading in re.findall(r"^### `effectguard ([^`]*)`", chapter, re.M):
        command = _command_of(heading.split(), verbs)
        assert command is not None, heading
        named.setdefault(command, set()).update(_FLAG.findall(heading))
    for command, where in _SYNOPSIS_ELSEWHERE.items():
        block = re.search(r"```sh\n(.*?)```", _section(text, where), re.S)
        assert block is not None, where
        named[command] |= set(_FLAG.findall(block.group(1)))
    wrong = {c: sorted(flags - _options(verbs[c])) for c, flags in named.items()}
    assert not {c: f for c, f in wrong.items() if f}
    missing = {
        c: sorted(_options(verbs[c]) - _COMMON_OPTIONS - flags)
        for c, flags in named.items()
        if c != "bench"  # measured, not operated: its options are in performance.md
    }
    assert not {c: f for c, f in missing.items() if f}


def test_every_command_line_in_the_docs_names_options_its_command_has() -> None:
    """Wherever README.md or docs/ write ``effectguard VERB ... --flag`` (in code, up to a
    ``#`` comment or the end of the line), the command exists and has that option."""
    verbs = _verbs(build_parser())
    pages = [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]
    unknown = []
    for page in pages:
        for line in page.read_text().splitlines():
            for match in re.finditer(r"effectguard ((?:[a-z][a-z-]* ?){1,2})([^`#|;)]*)", line):
                command = _command_of(match.group(1).split(), verbs)
                if command is None:
                    continue
                rest = " ".join(match.group(1).split()[len(command.split()) :]) + match.group(2)
                unknown += [
                    (page.name, command, flag)
                    for flag in _FLAG.findall(rest)
                    if flag not in _options(verbs[command])
                ]
    assert not unknown


def _statuses(cell: str) -> set[int]:
    return {int(s) for s in re.findall(r"\b[1-5]\d\d\b", cell)}


def test_the_bundled_declarations_table_is_the_bundled_files() -> None:
    """docs/contract.md §2.4 has one row per bundled provider with its dialect, key
    variable, ``not_processed``, ``retry_statuses`` and ``[transient]`` statuses as its
    file declares them: a user reads there which errors effectguard retries by itself (the
    row of OpenAI once listed its 503 under ``retry_statuses``, which it never retries)."""
    table = _section((DOCS / "contract.md").read_text(), "### §2.4 The bundled declarations")
    header = next(line for line in table.splitlines() if line.startswith("| provider |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    rows = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == len(columns):
            rows[cells[0].strip("`")] = dict(zip(columns, cells, strict=True))
    bundled = load_providers()
    assert set(rows) == set(bundled)
    for name, row in rows.items():
        declared = bundled[name]
        assert row["dialect"] == f"`{declared.dialect}`", name
        assert row["key variable"].startswith(f"`{declared.api_key_env}`"), name
        assert _statuses(row["`not_processed`"]) == set(declared.not_processed), name
        assert _statuses(row["`retry_statuses`"]) == set(declared.retry_statuses), name
        pairs = re.findall(r'`(\d{3}) = "(none|unknown)"`', row["`[transient]`"])
        transient = {int(status): kind for status, kind in pairs}
        assert transient == dict(declared.transient), name


def test_the_precedence_list_names_every_flag_of_serve() -> None:
    """docs/configuration.md's precedence list names each ``serve`` flag that sets what the
    config file would (all but ``--config`` and ``--demo``): an operator who finds a value
    differs from the file looks there for what overrode it."""
    section = _section((DOCS / "configuration.md").read_text(), "## Precedence")
    serve = _verbs(build_parser())["serve"]
    flags = _options(serve) - {"-h", "--help", "--config", "--demo"}
    assert flags <= set(_FLAG.findall(section)), flags - set(_FLAG.findall(section))


def test_every_log_event_the_package_writes_is_in_the_logs_page() -> None:
    """docs/logs-and-traces.md has a row for each ``event`` value a log line can carry (the
    ``extra={"event": ...}`` of a record, and each incident kind): a log shipper's alert
    matches on it, so an event missing from the page is one nobody knows to watch."""
    package = Path(__file__).resolve().parent.parent / "effectguard"
    written = set()
    for source in package.rglob("*.py"):
        text = source.read_text()
        written |= set(re.findall(r'"event": "([a-z_]+)"', text))
        written |= set(re.findall(r'\.incident\(\s*"([a-z_]+)"', text))
    page = (DOCS / "logs-and-traces.md").read_text()
    listed = set(re.findall(r"^\| `([a-z_]+)` \| `effectguard[.a-z]*` \|", page, re.M))
    listed |= {"access"} if '`"event": "access"`' in page else set()
    assert written <= listed, written - listed


def test_the_transport_section_lists_every_guard_setting() -> None:
    """docs/contract.md §1.2 names each field of ``effectguard.GuardSettings`` with its
    default: the transports take the class (``settings=``), so a transport user has no
    config-file table to look its fields up in."""
    text = (DOCS / "contract.md").read_text()
    section = text[text.index("### §1.2 The in-process") : text.index("### §1.3 ")]
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| `([^`]*)`", section, re.M))
    defaults = {f.name: f.default for f in dataclasses.fields(GuardSettings)}
    assert set(rows) == set(defaults)
    assert rows == {name: repr(default) for name, default in defaults.items()}
