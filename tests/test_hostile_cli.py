"""A hostile or careless operator at the command line (docs/contract.md §8): bad input gets
a non-zero exit and one clear line naming what was wrong, never a traceback, and changes
nothing an operator can see (calls, budgets, keys, verify's report, the files beside the
ledger). Legitimate extremes do the documented thing.

Each row runs the entry point in this process against one ledger per row group, copied from
a ledger with a call in every stage (tests/stagedkit.py). ``@stage`` in a row stands for
that stage's call id.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import sqlite3
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from pgkit import DSN, with_schema
from stagedkit import Ran, run, serve_refusing, snapshot, staged_ledger

from effectguard.ledger import Ledger
from effectguard.ops.backup import backup_sqlite
from effectguard.rules.events import KeyCreated


@dataclass(frozen=True, slots=True)
class Group:
    """One row group's ledger, the call ids of its stages and what it looked like at first."""

    ledger: Path
    ids: dict[str, str]
    baseline: dict[str, Any]

    def argv(self, args: Sequence[str]) -> list[str]:
        """``args`` with ``@stage`` replaced by call ids, ``%/`` by the ledger's folder, and
        ``--ledger`` unless given."""
        out = [self.ids.get(a[1:], a) if a.startswith("@") else a for a in args]
        out = [a.replace("%/", f"{self.ledger.parent}/") for a in out]
        return out if "--ledger" in out else [*out, "--ledger", str(self.ledger)]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The staged ledger every group copies (written once, by real guarded traffic)."""
    ledger = tmp_path_factory.mktemp("template") / "ledger.db"
    return ledger, staged_ledger(ledger)


def _group(template: tuple[Path, dict[str, str]], folder: Path) -> Group:
    ledger = folder / "ledger.db"
    backup_sqlite(str(template[0]), ledger)
    return Group(ledger, template[1], snapshot(ledger))


@pytest.fixture(scope="module")
def shared(
    template: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory
) -> Group:
    """The refusal rows' ledger: no row may change it."""
    return _group(template, tmp_path_factory.mktemp("shared"))


@pytest.fixture
def own(template: tuple[Path, dict[str, str]], tmp_path: Path) -> Group:
    """A ledger of the test's own, for commands that are meant to change it."""
    return _group(template, tmp_path)


def refused(group: Group, args: Sequence[str], code: int, *needles: str) -> Ran:
    """Run ``args``: exit ``code``, a one-line message saying ``needles``, nothing changed."""
    done = run(*group.argv(args))
    assert (done.code, done.out) == (code, ""), done
    assert "Traceback" not in done.err
    lines = done.err.rstrip("\n").splitlines()
    # argparse's own errors print the usage first; the message is always the last line.
    assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), done.err
    assert lines[-1].startswith("effectguard"), done.err
    assert all(needle in lines[-1] for needle in needles), done.err
    assert snapshot(group.ledger) == group.baseline
    return done


MAX_USD = "9223372036.854775807"
AMOUNTS = [
    ("-1", "amounts cannot be negative"),
    ("=-0.5", "amounts cannot be negative"),
    ("=-inf", "not a USD amount: '-inf'"),
    ("NaN", "not a USD amount: 'NaN'"),
    ("sNaN", "not a USD amount: 'sNaN'"),
    ("inf", "not a USD amount: 'inf'"),
    ("0x10", "not a USD amount: '0x10'"),
    ("1_000", "not a USD amount: '1_000'"),
    ("\u0661\u0662", "not a USD amount"),  # Arabic-Indic digits
    ("", "not a USD amount: ''"),
    ("1e400", f"must be between 0 and {MAX_USD} USD"),
    ("1e999999", f"must be between 0 and {MAX_USD} USD"),
    (str(10**30), f"must be between 0 and {MAX_USD} USD"),
    ("9223372036.8547758071", "finer than a nano-dollar"),
    ("0.0000000001", "finer than a nano-dollar"),
    ("1e-999999999", "finer than a nano-dollar"),
]


def _flag(name: str, value: str) -> list[str]:
    # "--limit=-1" keeps argparse from reading a leading "-" as an option.
    return [name + value] if value.startswith("=") else [name, value]


@pytest.mark.parametrize(("value", "needle"), AMOUNTS, ids=[repr(a) for a, _ in AMOUNTS])
def test_a_bad_limit_is_refused(shared: Group, value: str, needle: str) -> None:
    """budget set --limit takes a plain decimal USD amount within a counter, to the nano."""
    refused(shared, ["budget", "set", "team", *_flag("--limit", value)], 2, "--limit: ", needle)


@pytest.mark.parametrize(("value", "needle"), AMOUNTS, ids=[repr(a) for a, _ in AMOUNTS])
def test_a_bad_cost_is_refused(shared: Group, value: str, needle: str) -> None:
    """reconcile --cost reads amounts as --limit does (and within one call's maximum)."""
    needle = needle.replace(MAX_USD, "9007199.254740992")
    args = ["reconcile", "@unknown", "--applied", "--note", "n", *_flag("--cost", value)]
    refused(shared, args, 2, "--cost: ", needle)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("0", "0.000000000"),
        (MAX_USD, MAX_USD),
        ("1.5000000000", "1.500000000"),
        ("2e3", "2000.000000000"),
        (" 7 ", "7.000000000"),
    ],
)
def test_an_extreme_but_exact_limit_is_set(own: Group, value: str, shown: str) -> None:
    """Zero, the largest a counter holds, and exact amounts written oddly are set as given."""
    done = run(*own.argv(["budget", "set", "team", "--limit", value, "--json"]))
    assert done.code == 0, done.err
    assert snapshot(own.ledger)["budgets"] == [
        b | {"limit_usd": shown} if b["path"] == "team" else b for b in own.baseline["budgets"]
    ]


@pytest.mark.parametrize("value", ["1e999999", "-1e999999", "1e400"])
def test_an_absurd_limit_in_the_config_file_is_refused(tmp_path: Path, value: str) -> None:
    """serve --config with an amount past any counter exits 2 naming the budget, before it
    opens a ledger."""
    config = tmp_path / "effectguard.toml"
    config.write_text(f'[budgets]\n"team" = "{value}"\n')
    ledger = tmp_path / "ledger.db"
    done = serve_refusing("--config", str(config), "--ledger", str(ledger), "--port", "0")
    assert done.code == 2, done
    assert "budgets.team" in done.err.strip().splitlines()[-1], done.err
    assert not ledger.exists()


@pytest.mark.parametrize("value", ["99999", "-1", "65536", '"8787"', "true", "80.5"])
@pytest.mark.parametrize("key", ["port", "metrics_port"])
def test_a_port_that_is_no_tcp_port_in_the_config_file_is_refused(
    tmp_path: Path, key: str, value: str
) -> None:
    """serve --config with a port out of 0-65535, a string or a boolean exits 2 naming the
    key, before it opens a ledger (the socket layer would take 99999 as 34463, true as 1)."""
    config = tmp_path / "effectguard.toml"
    config.write_text(f"[server]\n{key} = {value}\n")
    ledger = tmp_path / "ledger.db"
    done = serve_refusing("--config", str(config), "--ledger", str(ledger))
    assert done.code == 2, done
    assert f"server.{key}: must be a TCP port from 0 to 65535" in done.err, done.err
    assert not ledger.exists()


@pytest.mark.parametrize(
    ("table", "text", "needle"),
    [
        ("server", "max_header_bytes = 1e400", "server.max_header_bytes: must be a finite"),
        ("server", "drain_timeout_s = inf", "server.drain_timeout_s: must be a finite"),
        ("server", "header_timeout_s = nan", "server.header_timeout_s: must be a non-negative"),
        ("server", "header_timeout_s = 0", "server.header_timeout_s: must be above zero"),
        ("server", "sweep_s = 0", "server.sweep_s: must be above zero"),
        ("server", "lease_s = 0", "server.lease_s: must be above zero"),
        ("server", "heartbeat_s = 0", "server.heartbeat_s: must be above zero"),
        ("server", "heartbeat_s = 20", "server.heartbeat_s: must be shorter than server.lease_s"),
        ("server", "lease_s = 2", "server.heartbeat_s: must be shorter than server.lease_s"),
        ("upstream", "read_timeout_s = 0", "upstream.read_timeout_s: must be above zero"),
        ("upstream", "max_connections = 0", "upstream.max_connections: must be above zero"),
        (
            "upstream",
            "max_connections = 4\nmax_connections_per_upstream = 5",
            "upstream.max_connections_per_upstream: must be at most upstream.max_connections",
        ),
        ("guard", "retry_wait_s = -inf", "guard.retry_wait_s: must be a non-negative"),
    ],
)
def test_a_number_no_timer_can_take_in_the_config_file_is_refused(
    tmp_path: Path, table: str, text: str, needle: str
) -> None:
    """serve --config with inf, nan, a zero interval or a heartbeat no shorter than the
    lease (other replicas would take over a live worker) exits 2 naming the key, before it
    opens a ledger; inf was an OverflowError traceback, the others were accepted."""
    config = tmp_path / "effectguard.toml"
    config.write_text(f"[{table}]\n{text}\n")
    ledger = tmp_path / "ledger.db"
    done = serve_refusing("--config", str(config), "--ledger", str(ledger))
    assert done.code == 2, done
    assert needle in done.err.strip().splitlines()[-1], done.err
    assert not ledger.exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--port", "99999"], "argument --port: a TCP port is a number from 0 to 65535"),
        (["--port", "-1"], "argument --port: a TCP port is a number from 0 to 65535"),
        (["--metrics-port", "1e3"], "argument --metrics-port: a TCP port is a number"),
        (["--ledger", ""], "argument --ledger: a path cannot be empty"),
        (["--config", ""], "argument --config: a path cannot be empty"),
    ],
)
def test_serve_refuses_a_bad_flag_before_it_opens_a_ledger(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    """serve's own flags take the checks every ledger command has: exit 2, one line."""
    ledger = tmp_path / "ledger.db"
    done = serve_refusing(*(args if "--ledger" in args else ["--ledger", str(ledger), *args]))
    assert done.code == 2, done
    assert needle in done.err.strip().splitlines()[-1], done.err
    assert not ledger.exists()


#: PostgreSQL ledger URLs libpq or urlsplit cannot read, each with a password holding
#: "canary": the refusal names the problem, never the password (libpq quotes the piece of
#: a connection string it cannot read), and is no traceback.
BAD_DSNS = [
    ("postgresql://eg:pass word-canary@127.0.0.1:1/db", 4, "unexpected spaces"),
    ("postgresql://eg:canary%zz@127.0.0.1:1/db", 4, "percent-encoded"),
    ("postgresql://eg:canary@[::1/db", 2, "is not a URL"),
]


@pytest.mark.parametrize(("url", "code", "needle"), BAD_DSNS, ids=lambda v: str(v)[:30])
def test_a_ledger_url_that_cannot_be_read_is_refused_without_its_password(
    url: str, code: int, needle: str
) -> None:
    """A ledger command and serve refuse a PostgreSQL URL they cannot read with one line
    naming the problem; the password is in neither that line nor serve's log."""
    done = run("calls", "--ledger", url)
    assert done.code == code, done
    assert "Traceback" not in done.err and needle in done.err, done.err
    assert "canary" not in done.err + done.out, done.err
    if code == 4:  # serve: its startup line goes to log shippers
        served = serve_refusing("--ledger", url, "--port", "0")
        # 4, "the ledger is unavailable", as for every command (until 2026-12-05 serve
        # exited 3, which the exit-code table gives a ledger's refusal).
        assert served.code == 4 and needle in served.err, served
        assert "canary" not in served.err + served.out, served.err


@pytest.mark.postgres
@pytest.mark.skipif(not DSN, reason="needs EFFECTGUARD_TEST_PG_DSN")
@pytest.mark.parametrize("secret", ["password", "sslpassword"])
def test_a_secret_in_a_ledger_urls_query_is_never_printed(secret: str) -> None:
    """A ledger URL's query may carry a secret libpq reads (``password``, and
    ``sslpassword``, which unlocks the client's TLS key): the messages that name the
    ledger show ``***`` in its place."""
    url = f"{with_schema(DSN, 'eg_operator_no_such_schema')}&{secret}=canary-secret"
    done = run("calls", "--ledger", url)
    assert done.code != 0 and "no_such_schema" in done.err, done
    assert "canary" not in done.err + done.out, done.err
    assert f"{secret}=***" in done.err, done.err


#: Ledger URLs of no scheme effectguard reads (SQLAlchemy's driver suffix, another
#: database, a typo), each with a password holding "canary".
FOREIGN_DSNS = [
    "postgresql+psycopg://eg:canary-pw@127.0.0.1:1/db",
    "mysql://eg:canary-pw@127.0.0.1/db",
    "postgressql://eg@127.0.0.1/db?password=canary-pw",
]


@pytest.mark.parametrize("url", FOREIGN_DSNS)
def test_a_ledger_url_of_another_scheme_is_refused_without_its_password(url: str) -> None:
    """A ledger command and serve refuse a URL that names no ledger effectguard reads with
    one line (exit 2) naming it with its password as ``***``: serve's refusal goes to
    its log, which log shippers carry off."""
    done = run("calls", "--ledger", url)
    assert done.code == 2, done
    assert "not a SQLite ledger" in done.err and "***" in done.err, done.err
    assert "canary" not in done.err + done.out, done.err
    served = serve_refusing("--ledger", url, "--port", "0")
    assert served.code == 2 and "not a SQLite ledger" in served.err, served
    assert "canary" not in served.err + served.out, served.err


def test_a_provider_key_with_a_line_break_stops_serve_naming_the_variable_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A provider key read from a file with its trailing line break can go in no header:
    serve stops at start (exit 2) naming the variable, not the key, and opens no ledger,
    instead of admitting every call and failing it after, held as unknown."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-canary-provider-key\n")
    ledger = tmp_path / "ledger.db"
    done = serve_refusing("--ledger", str(ledger), "--port", "0")
    assert done.code == 2, done
    assert "$OPENAI_API_KEY" in done.err.strip().splitlines()[-1], done.err
    assert "canary" not in done.err + done.out and "Traceback" not in done.err
    assert not ledger.exists()


#: Upstream URLs holding a credential (a gateway's user and password): aiohttp sends it as
#: Basic auth and refuses it beside the provider key's Authorization (every call a 500,
#: held as unknown), and the ledger recorded the URL as where an attempt went (sent_to).
CREDENTIAL_URLS = [
    "http://gw:canary-pw@127.0.0.1:9",
    "http://canary-user@127.0.0.1:9/v1",
    "https://gw:canary-pw@[::1]:9",
    "ftp://gw:canary-pw@127.0.0.1:9",
]


@pytest.mark.parametrize("url", CREDENTIAL_URLS)
def test_an_upstream_url_with_a_credential_is_refused_without_it(tmp_path: Path, url: str) -> None:
    """serve --upstream NAME=URL, or a declaration's base_url, with a user or password in
    the URL stops serve at start (exit 2) naming where, never the credential, before it
    opens a ledger: a credential goes in the provider key (api_key_env, key_header)."""
    ledger = tmp_path / "ledger.db"
    done = serve_refusing("--ledger", str(ledger), "--port", "0", "--upstream", f"openai={url}")
    assert done.code == 2, done
    assert "--upstream openai" in done.err.strip().splitlines()[-1], done.err
    assert "canary" not in done.err + done.out and "Traceback" not in done.err
    folder = tmp_path / "providers"
    folder.mkdir()
    (folder / "gateway.toml").write_text(f'extends = "openai"\nbase_url = "{url}"\n')
    done = serve_refusing("--ledger", str(ledger), "--port", "0", "--providers", str(folder))
    assert done.code == 2, done
    assert "gateway.toml: base_url" in done.err.strip().splitlines()[-1], done.err
    assert "canary" not in done.err + done.out and "Traceback" not in done.err
    assert not ledger.exists()


SEGMENT = "s" * 64
BAD_PATHS = ["", "a//b", "/a", "a/", "a=b", "a\nb", "é", "s" * 65, "/".join("abcdefghi"), ".a"]


@pytest.mark.parametrize("path", BAD_PATHS, ids=repr)
def test_a_bad_budget_path_is_refused(shared: Group, path: str) -> None:
    """budget set PATH takes 1-8 '/'-separated segments of letters, digits, '.', '_', '-'."""
    refused(
        shared, ["budget", "set", path, "--limit", "1"], 2, "argument path: invalid budget path"
    )


@pytest.mark.parametrize("path", ["team/", "/team", "a//b", "a/..", "é"], ids=repr)
@pytest.mark.parametrize("filter_", [["budgets", "--under"], ["calls", "--budget"]], ids=str)
def test_a_filter_by_a_path_no_node_can_have_is_refused(
    shared: Group, filter_: list[str], path: str
) -> None:
    """budgets --under and calls --budget refuse a path that is no budget path (exit 2),
    rather than list nothing: "team/" (a trailing slash) read as an empty team."""
    refused(shared, [*filter_, path], 2, "invalid budget path")


BAD_COUNTS = [
    ("-1", "a count cannot be negative"),
    ("1e30", "not a count: '1e30'"),
    ("NaN", "not a count: 'NaN'"),
    ("0x10", "not a count: '0x10'"),
    ("2.5", "not a count: '2.5'"),
    ("+3", "not a count: '+3'"),
    ("1_000", "not a count: '1_000'"),
    ("\u0661\u0662", "not a count"),
    ("", "not a count: ''"),
    (str(2**63), "at most 9223372036854775807"),
    ("9" * 5000, "at most 9223372036854775807"),
]


@pytest.mark.parametrize("flag", ["--rpm", "--tpm", "--concurrency"])
@pytest.mark.parametrize(("value", "needle"), BAD_COUNTS, ids=[v[:8] for v, _ in BAD_COUNTS])
def test_a_bad_rate_limit_is_refused(shared: Group, flag: str, value: str, needle: str) -> None:
    """--rpm, --tpm and --concurrency take ASCII digits that a counter holds, or none."""
    refused(shared, ["budget", "set", "team", *_flag(flag, value)], 2, f"{flag}: ", needle)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["team"], "budget set needs --limit USD or --no-limit"),
        (["team", "--limit", "1", "--no-limit"], "not both"),
        (["team", "--period", "year"], "argument --period: invalid choice: 'year'"),
        (["team", "--period", ""], "argument --period: invalid choice: ''"),
        (["team", "--period", "Day"], "argument --period: invalid choice: 'Day'"),
    ],
)
def test_a_budget_set_without_a_change_is_refused(
    shared: Group, args: list[str], needle: str
) -> None:
    """budget set needs something to set, one limit, and a period it knows."""
    refused(shared, ["budget", "set", *args], 2, needle)


@pytest.mark.parametrize(
    ("args", "field", "shown"),
    [
        (["--rpm", "0"], "rpm", 0),
        (["--tpm", " 12 "], "tpm", 12),
        (["--concurrency", str(2**63 - 1)], "concurrency", 2**63 - 1),
        (["--rpm", "NONE"], "rpm", None),
    ],
)
def test_an_extreme_rate_limit_is_set(own: Group, args: list[str], field: str, shown: Any) -> None:
    """Zero (admit nothing), the largest count a counter holds and 'none' are set as given."""
    path = "/".join([SEGMENT] * 8)  # the longest path there is
    done = run(*own.argv(["budget", "set", path, *args]))
    assert done.code == 0, done
    (node,) = [b for b in snapshot(own.ledger)["budgets"] if b["path"] == path]
    assert node[field] == shown
    # The confirmation says what was set, not only the (unchanged) money limit.
    assert (
        done.out
        == f"{path}: no limit (period total)"
        + ("" if shown is None else f"; {field} {shown}")
        + "\n"
    )


BAD_ZONES = [
    ("Mars/Base", "unknown timezone 'Mars/Base'"),
    ("../../etc/passwd", "unknown timezone '../../etc/passwd'"),
    ("", "unknown timezone ''"),
    ("/etc/localtime", "unknown timezone '/etc/localtime'"),
    ("utc", "unknown timezone 'utc'"),
    ("Europe/Paris ", "unknown timezone 'Europe/Paris '"),
    ("Europe\x00Paris", "unknown timezone"),
    ("A" * 5000, "unknown timezone 'AAAA"),
    ("localtime", "'localtime' is this machine's own zone"),
    ("posixrules", "'posixrules' is this machine's own zone"),
    # Copies some systems keep beside the database: a replica with only the tzdata
    # package cannot load them, and would fail every call charged under the node.
    ("posix/Europe/Berlin", "'posix/Europe/Berlin'"),
    ("right/UTC", "'right/UTC'"),
]


@pytest.mark.parametrize(("zone", "needle"), BAD_ZONES, ids=[z[:12] for z, _ in BAD_ZONES])
def test_a_bad_timezone_is_refused(shared: Group, zone: str, needle: str) -> None:
    """--tz takes an IANA zone name that means the same on every machine; the message
    shows at most the start of a long one."""
    done = refused(shared, ["budget", "set", "team", "--tz", zone], 2, "--tz: ", needle)
    assert len(done.err.splitlines()[-1]) < 200


@pytest.mark.parametrize("zone", ["Europe/Paris", "Etc/GMT+5", "EST5EDT", "Pacific/Kiritimati"])
def test_an_iana_timezone_is_set(own: Group, zone: str) -> None:
    """A zone of the IANA database is set as given."""
    assert run(*own.argv(["budget", "set", "team", "--tz", zone])).code == 0
    (node,) = [b for b in snapshot(own.ledger)["budgets"] if b["path"] == "team"]
    assert node["tz"] == zone


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["budget", "set", "team\n", "--limit", "1"], "argument path: invalid budget path"),
        (["key", "new", "--root", "team\n"], "invalid budget path 'team\\n'"),
        (["key", "new", "--root", "team", "--name", "ci\n"], "key name 'ci\\n'"),
        (["budgets", "--period", "2026-01\n"], "argument --period: not a period: '2026-01\\n'"),
        (["budgets", "--period", "２０２６-01"], "argument --period: not a period"),
        (["budgets", "--period", "2026-W0\u0665"], "argument --period: not a period"),
        (["calls", "--since", "\u0667d"], "argument --since"),
    ],
    ids=["path", "root", "key-name", "label", "fullwidth-label", "week-label", "since"],
)
def test_a_name_is_checked_to_its_last_character(
    shared: Group, args: list[str], needle: str
) -> None:
    """A trailing newline or a non-ASCII digit does not slip past a name's pattern
    ('$' matches before a final newline; '\\d' matches any script's digits)."""
    refused(shared, args, 2, needle)


BAD_LABELS = ["2026-13", "2026-02-30", "2026-02-29", "yesterday", "2026-W54", "2026-W00"]
BAD_LABELS += ["0000-01", "TOTAL", "", "2026-1", "2026-01-1", "2026-01 "]
BAD_DATES = ["yesterday", "now", "", "2026-13-01", "2026-02-30", "2026-05-01T25:00", "2026-05"]
FAR_DATES = ["9999-12-31T23:59:59", "9999-12-31T12:00+00:00", "0001-01-01T00:00"]


@pytest.mark.parametrize("label", BAD_LABELS, ids=repr)
def test_a_bad_period_label_is_refused(shared: Group, label: str) -> None:
    """budgets --period takes YYYY-MM-DD, YYYY-Www, YYYY-MM (real dates) or total."""
    refused(shared, ["budgets", "--period", label], 2, "argument --period: not a period")


@pytest.mark.parametrize("when", BAD_DATES, ids=repr)
def test_a_bad_date_is_refused(shared: Group, when: str) -> None:
    """budgets --at takes a real date, or an ISO date and time."""
    refused(shared, ["budgets", "--at", when], 2, "argument --at: not a date or time")


@pytest.mark.parametrize("command", [["calls", "--since"], ["archive", "--before"]])
@pytest.mark.parametrize("length", ["1" * 400 + "d", "99999999999999w"], ids=["400-digits", "14"])
def test_a_duration_past_the_calendar_is_refused(
    shared: Group, command: list[str], length: str
) -> None:
    """A duration back from now that reaches before year 1 is exit 2 naming it, never a
    traceback (400 digits of days overflowed a float)."""
    refused(shared, [*command, length], 2, "reaches back past year 1")


@pytest.mark.parametrize("when", FAR_DATES, ids=repr)
def test_an_instant_at_the_end_of_the_calendar_is_refused(shared: Group, when: str) -> None:
    """An --at instant whose local date some zone cannot hold is refused, not a traceback."""
    refused(shared, ["budgets", "--at", when], 2, "argument --at: ", "out of range")


def test_period_and_at_do_not_go_together(shared: Group) -> None:
    """budgets takes one of --period and --at."""
    args = ["budgets", "--period", "2026-05", "--at", "2026-05-01"]
    refused(shared, args, 2, "argument --at: not allowed with argument --period")


@pytest.mark.parametrize(
    ("args", "path", "label"),
    [
        (["--period", "2028-02-29"], "daily", "2028-02-29"),
        (["--period", "2026-W53"], "weekly", "2026-W53"),
        (["--period", "9999-12"], "monthly", "9999-12"),
        (["--period", "0001-W01"], "weekly", "0001-W01"),
        (["--at", "0001-01-01"], "daily", "0001-01-01"),
        (["--at", "9999-12-31"], "monthly", "9999-12"),
        (["--at", "0001-01-02T00:00Z"], "weekly", "0001-W01"),
        (["--at", "9999-12-30T23:59:59Z"], "daily", "9999-12-31"),  # Kiritimati: UTC+14
    ],
)
def test_a_period_at_the_end_of_the_calendar_is_shown(
    shared: Group, args: list[str], path: str, label: str
) -> None:
    """The first and last periods the calendar holds are shown, in each node's own zone."""
    done = run(*shared.argv(["budgets", *args, "--json"]))
    assert done.code == 0, done.err
    assert {b["path"]: b["period"] for b in json.loads(done.out)}[path] == label


BAD_KEYS = [
    (["--name", ""], 2, "key name ''"),
    (["--name", "k" * 101], 2, "at most 100 characters"),
    (["--name", "ké"], 2, "key name 'ké'"),
    (["--name", "k\x01"], 2, "key name 'k\\x01'"),
    (["--name", "k=1"], 2, "key name 'k=1'"),
    (["--name", "a b"], 2, "key name 'a b'"),
    (["--name", "ci"], 3, "a key named 'ci' is in use"),
    (["--root", ""], 2, "invalid budget path ''"),
    (["--root", "a//b"], 2, "invalid budget path 'a//b'"),
    (["--expires", "yesterday"], 2, "argument --expires: not an ISO 8601 date"),
    (["--expires", "2026-02-30"], 2, "argument --expires: not an ISO 8601 date"),
    (["--expires", ""], 2, "argument --expires: not an ISO 8601 date"),
    (["--expires", "99999-01-01"], 2, "argument --expires: not an ISO 8601 date"),
    (["--expires", "2099-01-01T00:00+25:00"], 2, "argument --expires: not an ISO 8601 date"),
    (["--expires", "9999-12-31T23:59:59-12:00"], 2, "argument --expires: ", "out of range"),
    (["--expires", "0001-01-01T00:00+01:00"], 2, "argument --expires: ", "out of range"),
    (["--expires", "2020-01-01"], 3, "the expiry is not in the future"),
    (["--models", ""], 2, "argument --models: give at least one name"),
    (["--models", ",,"], 2, "argument --models: give at least one name"),
    (["--models", "gpt-4o,a b"], 2, "argument --models: ", "'a b'"),
    (["--models", "gpt\x01"], 2, "argument --models: ", "'gpt\\x01'"),
    (["--providers", "OpenAI"], 2, "argument --providers: ", "'OpenAI'"),
    (["--providers", "open ai"], 2, "argument --providers: ", "'open ai'"),
]


@pytest.mark.parametrize(
    ("args", "code", *["needles"]),
    [(a, c, n) for a, c, *n in BAD_KEYS],
    ids=[repr(a[1])[:24] for a, *_ in BAD_KEYS],
)
def test_a_bad_key_is_refused(
    shared: Group, args: list[str], code: int, needles: list[str]
) -> None:
    """key new refuses a bad or taken name, a bad root, an expiry that is not a future
    instant the calendar holds, and model or provider names no call could carry."""
    argv = ["key", "new", *(["--root", "team"] if "--root" not in args else []), *args]
    refused(shared, argv, code, *needles)


@pytest.mark.parametrize(
    ("name", "needle"),
    [("nothere", "no key named 'nothere'"), ("", "no key named ''"), ("old", "already revoked")],
)
def test_revoking_an_unknown_or_revoked_key_is_refused(
    shared: Group, name: str, needle: str
) -> None:
    """key revoke of a name the ledger has no live key for exits 3."""
    refused(shared, ["key", "revoke", name], 3, needle)


def test_the_default_name_of_the_longest_root_is_a_valid_name(own: Group) -> None:
    """key new without --name on a root of 8 full segments names the key ROOT-xxxxxx cut to
    100 characters, instead of refusing a name the operator never gave."""
    root = "/".join([SEGMENT] * 8)
    done = run(*own.argv(["key", "new", "--root", root, "--json"]))
    assert done.code == 0, done.err
    name = json.loads(done.out)["name"]
    assert len(name) == 100 and name.startswith(SEGMENT) and name[-7] == "-"
    assert name in {k["name"] for k in snapshot(own.ledger)["keys"]}


def test_a_key_may_expire_at_the_calendars_last_second(own: Group) -> None:
    """--expires 9999-12-31T23:59:59Z is kept, listed and revoked like any other."""
    args = ["key", "new", "--root", "team", "--name", "far", "--expires", "9999-12-31T23:59:59Z"]
    assert run(*own.argv(args)).code == 0
    (far,) = [k for k in snapshot(own.ledger)["keys"] if k["name"] == "far"]
    assert far["expires_at"] == "9999-12-31T23:59:59Z"
    assert run(*own.argv(["key", "revoke", "far"])).code == 0


def test_a_key_written_with_an_expiry_past_the_calendar_still_lists(own: Group) -> None:
    """A ledger written before --expires was bounded may hold a key expiring in year ~33658:
    key list (text and --json) says so instead of failing, and the key can be revoked."""

    async def write() -> None:
        async with Ledger.open(str(own.ledger)) as book:
            digest = hashlib.sha256(b"key-of-far-future").hexdigest()
            await book.create_key(
                KeyCreated(name="far-future", sha256=digest, budget_root="team", expires_at=1e12)
            )

    asyncio.run(write())
    done = run(*own.argv(["key", "list", "--json"]))
    assert done.code == 0, done.err
    (far,) = [k for k in json.loads(done.out) if k["name"] == "far-future"]
    assert (far["status"], far["expires_at"]) == ("active", "after 9999-12-31T23:59:59Z")
    text = run(*own.argv(["key", "list"]))
    assert text.code == 0 and "after 9999-12-31T23:59:59Z" in text.out, text
    assert run(*own.argv(["key", "revoke", "far-future"])).code == 0
    (far,) = [k for k in snapshot(own.ledger)["keys"] if k["name"] == "far-future"]
    assert far["status"] == "revoked"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["key", "new", "--root", "team", "--name", "twice"], "a key named 'twice' is in use"),
        (["key", "revoke", "ci"], "key 'ci' is already revoked"),
    ],
)
def test_the_same_key_command_twice_changes_the_ledger_once(
    own: Group, args: list[str], needle: str
) -> None:
    """A second key new of a name in use, or a second revoke, exits 3 and changes nothing."""
    assert run(*own.argv(args)).code == 0
    refused(replace(own, baseline=snapshot(own.ledger)), args, 3, needle)


DECIDED = ["refused", "in_flight", "not_sent", "not_processed", "completed"]
SETTLED = [s for s in DECIDED if s != "in_flight"]
STAGE_ROWS = [
    *[([f"@{s}", "--resend", "--note", "n"], "not effect_unknown") for s in [*DECIDED, "failed"]],
    *[([f"@{s}", "--accept-evidence"], "not effect_unknown") for s in [*DECIDED, "failed"]],
    *[([f"@{s}", "--applied", "--note", "n"], "nothing to reconcile") for s in SETTLED],
    *[([f"@{s}", "--not-applied", "--note", "n"], "nothing to reconcile") for s in SETTLED],
    # An in-flight call whose worker lives (its lease runs): say how it becomes decidable.
    (["@in_flight", "--applied", "--note", "n"], "decided. Wait, then `effectguard show "),
    (["@in_flight", "--not-applied", "--note", "n"], "else once its lease has run out"),
    (["@unknown", "--accept-evidence"], "has no late answer recorded for attempt 1"),
    (["@unknown_late", "--accept-evidence"], "it proves nothing, so it decides nothing"),
    (["call_nothere", "--resend", "--note", "n"], "no call 'call_nothere'"),
    (["call_nothere", "--applied", "--note", "n"], "no call 'call_nothere'"),
]


@pytest.mark.parametrize(
    ("args", "needle"), STAGE_ROWS, ids=[" ".join(a[:2]) for a, _ in STAGE_ROWS]
)
def test_a_reconcile_the_stage_does_not_allow_is_refused(
    shared: Group, args: list[str], needle: str
) -> None:
    """Each verb is refused with exit 3 by every stage it does not apply to (§8)."""
    refused(shared, ["reconcile", *args], 3, needle)


USAGE_ROWS = [
    (["--resend", "--note", "n"], "reconcile --resend needs CALL_ID"),
    (["@unknown", "--resend"], "needs --note TEXT"),
    (["@unknown", "--resend", "--note", ""], "argument --note: "),
    (["@unknown", "--resend", "--note", "   "], "argument --note: "),
    (["@unknown", "--resend", "--note", "n", "--applied"], "--resend goes with no --applied"),
    (["@unknown", "--accept-evidence", "--resend"], "--resend goes with no"),
    (["@unknown", "--accept-evidence", "--cost", "1"], "--accept-evidence needs CALL_ID, and no"),
    (["@unknown", "--applied", "--not-applied", "--note", "n"], "exactly one of --applied"),
    (["@unknown", "--not-applied", "--cost", "1", "--note", "n"], "--cost goes with --applied"),
    (["@unknown"], "exactly one of --applied / --not-applied"),
    (["@unknown", "--applied"], "reconcile needs --note TEXT"),
    (["@unknown", "--applied", "--note", "n", "--by", ""], "argument --by: "),
    (["@unknown", "--applied", "--note", "n", "--by", " "], "argument --by: "),
    (["@unknown", "--applied", "--note", "n", "--by", "\x1b[31mx"], "argument --by: "),
    (["@unknown", "--applied", "--note", "ok\x1b[2J"], "argument --note: "),
    (["@unknown", "--applied", "--note", "one\ntwo"], "argument --note: "),
    (["@unknown", "--auto"], "reconcile --auto takes no CALL_ID"),
    (["--auto", "--applied"], "reconcile --auto takes no CALL_ID"),
    (["--auto", "--upstream", "openai=http://[::1"], "--upstream openai: must be an http(s) URL"),
    (["--auto", "--upstream", "openai"], "--upstream takes NAME=URL"),
]


@pytest.mark.parametrize(("args", "needle"), USAGE_ROWS, ids=[repr(a[1:3]) for a, _ in USAGE_ROWS])
def test_a_reconcile_that_does_not_say_what_is_refused(
    shared: Group, args: list[str], needle: str
) -> None:
    """A reconcile needs a call, one decision, a note of one printable line and a name for
    who decides; --auto decides for itself and takes none of them."""
    refused(shared, ["reconcile", *args], 2, needle)


#: A byte of another encoding (a Latin-1 terminal's "é", a pasted id): Python reads it
#: as a lone surrogate, which no UTF-8 ledger can hold or look up.
NOT_UTF8 = "x\udcff"
NOT_UTF8_ROWS = [
    (["show", NOT_UTF8], "not UTF-8 text"),
    (["reconcile", NOT_UTF8, "--not-applied", "--note", "n"], "not UTF-8 text"),
    (["reconcile", "@unknown", "--not-applied", "--note", f"checked {NOT_UTF8}"], "printable"),
    (["reconcile", "@unknown", "--not-applied", "--note", "n", "--by", NOT_UTF8], "printable"),
    (["calls", "--provider", NOT_UTF8], "not UTF-8 text"),
    (["key", "revoke", NOT_UTF8], "not UTF-8 text"),
]


@pytest.mark.parametrize(
    ("args", "needle"), NOT_UTF8_ROWS, ids=[" ".join(a[:2]) for a, _ in NOT_UTF8_ROWS]
)
def test_an_argument_that_is_not_utf8_is_refused(
    shared: Group, args: list[str], needle: str
) -> None:
    """A call id, name, provider or note holding a byte that is no UTF-8 is exit 2 with
    one line saying so, nothing written, never a traceback from the ledger's encoder."""
    refused(shared, args, 2, needle)


@pytest.mark.parametrize("login", ["ana\x1b[31m", "x\udcff", "a\u202eb"], ids=repr)
def test_a_login_name_that_is_no_name_is_refused_as_the_default_of_by(
    shared: Group, login: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --by, reconcile records the login name ($LOGNAME, $USER): one that --by
    would refuse (a terminal escape, a byte that is no UTF-8, a direction override) is
    exit 2 asking for --by, nothing written; never recorded, never a traceback."""
    for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        monkeypatch.setenv(name, login)
    refused(shared, ["reconcile", "@unknown", "--not-applied", "--note", "n"], 2, "--by")


TWICE = [
    (["@unknown", "--resend", "--note", "n"], "already has a resend authorized"),
    (["@unknown", "--applied", "--note", "n"], "is reconciled_applied, not effect_unknown"),
    (["@failed", "--not-applied", "--note", "n"], "is reconciled_not_applied, not effect_"),
    (["@unknown_evidence", "--accept-evidence"], "is reconciled_applied, not effect_unknown"),
]


@pytest.mark.parametrize(("args", "needle"), TWICE, ids=[a[1] for a, _ in TWICE])
def test_the_same_decision_twice_is_recorded_once(own: Group, args: list[str], needle: str) -> None:
    """The second of two identical reconciles exits 3 and changes nothing."""
    done = run(*own.argv(["reconcile", *args]))
    assert done.code == 0, done.err
    refused(replace(own, baseline=snapshot(own.ledger)), ["reconcile", *args], 3, needle)


@pytest.fixture(scope="module")
def files(template: tuple[Path, dict[str, str]], tmp_path_factory: pytest.TempPathFactory) -> Group:
    """A ledger beside files that are not ledgers, archives or config files."""
    folder = tmp_path_factory.mktemp("files")
    (folder / "exists.txt").write_text("keep me")
    (folder / "text.txt").write_text("hello\n")
    (folder / "empty.db").write_bytes(b"")
    (folder / "adir").mkdir()
    (folder / "binary.toml").write_bytes(b"\xff\xfe\x00")
    (folder / "bad.toml").write_text('ledger = "\n')
    (folder / "hello.gz").write_bytes(gzip.compress(b"hello\n"))
    foreign = sqlite3.connect(folder / "foreign.sqlite")
    foreign.execute("CREATE TABLE notes (body TEXT)")
    foreign.commit()
    foreign.close()
    return _group(template, folder)


OWN_FILES = ["%/ledger.db-wal", "%/ledger.db-shm", "%/ledger.db-journal"]
FILE_ROWS = [
    (["backup", "%/exists.txt"], "exists; a backup never overwrites a file"),
    (["backup", "%/adir"], "exists; a backup never overwrites a file"),
    (["backup", "%/ledger.db"], "exists; a backup never overwrites a file"),
    *[(["backup", own], "is the ledger's own") for own in OWN_FILES],
    (["backup", "%/nodir/copy.db"], "directory %/nodir does not exist"),
    (["backup", ""], "argument path: a path cannot be empty"),
    (["backup", "%/copy.db", "--ledger", "%/nothere.db"], "no ledger at %/nothere.db"),
    (["backup", "%/copy.db", "--ledger", "%/text.txt"], "is not a SQLite database"),
    (["backup", "%/copy.db", "--ledger", "%/foreign.sqlite"], "is not an effectguard ledger"),
    (["backup", "%/copy.db", "--ledger", "%/empty.db"], "is not an effectguard ledger"),
    (["backup", "%/copy.db", "--ledger", "%/adir"], "%/adir is not a file"),
    (["backup", "%/copy.db", "--ledger", "memory://"], "backup copies SQLite ledgers"),
    *[(["archive", "--before", "0d", "--out", own], "is the ledger's own") for own in OWN_FILES],
    (["archive", "--before", "0d", "--out", "%/ledger.db"], "an archive never overwrites"),
    (["archive", "--before", "0d", "--out", "%/adir"], "an archive never overwrites a file"),
    (["archive", "--before", "0d", "--out", "%/nodir/a.gz"], "directory %/nodir does not exist"),
    (["archive", "--before", "0d", "--out", ""], "argument --out: a path cannot be empty"),
    (["archive", "--before", ""], "'' is neither a duration"),
    (["archive", "--before", "yesterday"], "'yesterday' is neither a duration"),
    (["archive", "--before", "2026-13-01"], "'2026-13-01' is neither a duration"),
    (["archive"], "give --before DATE, or [retention] keep_bodies_days in --config"),
    (["archive", "--before", "0d", "--ledger", "memory://"], "a memory ledger has nothing"),
    (["archive", "--before", "0d", "--ledger", "%/foreign.sqlite"], "not an effectguard ledger"),
    (["archive", "--before", "0d", "--ledger", "%/empty.db"], "not an effectguard ledger"),
    (["verify", "--archive", "%/nothere.gz"], "no archive file at %/nothere.gz"),
    (["verify", "--archive", "%/adir"], "no archive file at %/adir"),
    (["verify", "--archive", "%/text.txt"], "not a readable effectguard archive"),
    (["verify", "--archive", "%/hello.gz"], "not a readable effectguard archive"),
    (["verify", "--ledger", "%/foreign.sqlite"], "is not an effectguard ledger"),
    (["budgets", "--ledger", "sqlite:///%/typo.db"], "no ledger at %/typo.db"),
    (["budgets", "--ledger", "%/text.txt"], "is not a SQLite database"),
    (["budgets", "--ledger", "%/foreign.sqlite"], "is not an effectguard ledger"),
    (["key", "list", "--ledger", "%/empty.db"], "is not an effectguard ledger"),
    (["budget", "set", "x", "--limit", "1", "--ledger", "%/empty.db"], "not an effectguard"),
    (["calls", "--ledger", "%/adir"], "%/adir is not a file"),
    (["budgets", "--config", "%/binary.toml"], "binary.toml: not UTF-8"),
    (["budgets", "--config", "%/bad.toml"], "bad.toml: "),
    (["budgets", "--config", "%/adir"], "adir: "),
    (["budgets", "--config", "%/nothere.toml"], "nothere.toml: "),
    (["calls", "--limit", "-1"], "argument --limit: a count cannot be negative"),
    (["calls", "--limit", "1e3"], "argument --limit: not a count"),
]


@pytest.mark.parametrize(
    ("args", "needle"), FILE_ROWS, ids=[" ".join(a)[:40] for a, _ in FILE_ROWS]
)
def test_a_bad_file_is_refused(files: Group, args: list[str], needle: str) -> None:
    """A command writes only a new file in a directory that exists, never over a file nor
    onto a file SQLite keeps beside the ledger, and reads only a ledger, an archive or a
    config file that is one: anything else is exit 2 naming the file, the file untouched."""
    refused(files, args, 2, needle.replace("%/", f"{files.ledger.parent}/"))


def test_a_backup_to_a_new_file_is_a_ledger(own: Group) -> None:
    """backup PATH in an existing directory writes a copy that verifies."""
    done = run(*own.argv(["backup", "%/copy.db"]))
    assert done.code == 0, done.err
    assert snapshot(own.ledger.parent / "copy.db")["verify"] == own.baseline["verify"]


#: A right-to-left override (what follows it reads backwards) and a C1 control (a
#: terminal's CSI) in a file name: pasted paths carry them, and they would reorder or
#: recolour the rest of the line, digest included, on the operator's terminal.
HOSTILE_NAME = "b\u202ekab\x9b.db"


@pytest.mark.parametrize(
    "args",
    [
        ["backup", f"%/{HOSTILE_NAME}"],
        ["archive", "--before", "2100-01-01", "--out", f"%/{HOSTILE_NAME}"],
        ["backup", "%/new.db", "--ledger", f"%/{HOSTILE_NAME}"],
    ],
    ids=["backup", "archive", "error"],
)
def test_a_path_is_printed_as_its_escapes(own: Group, args: list[str]) -> None:
    """backup, archive and the one-line refusals print a path holding a direction override
    or a control character with those characters as escapes (``\\u202e``, ``\\x9b``), as
    ``show`` prints a ledger's text; never raw."""
    done = run(*own.argv(args))
    printed = done.out + done.err
    assert "\u202e" not in printed and "\x9b" not in printed, done
    assert "b\\u202ekab\\x9b.db" in printed, done


def test_an_archive_before_a_future_date_takes_what_now_allows(own: Group) -> None:
    """archive --before a date in the future archives what a cut-off of now would: the
    final calls before the first one that is not (documented in §8)."""
    done = run(*own.argv(["archive", "--before", "2100-01-01", "--json"]))
    assert done.code == 0, done.err
    moved = json.loads(done.out)
    assert moved["calls"] >= 1 and moved["held_by"] is not None
    assert snapshot(own.ledger)["verify"][0] is True


LONG = "n" * 300  # longer than any file name a file system takes
PATH_ROWS = [
    (["backup", f"%/{LONG}"], "argument path: ", "file name too long"),
    (["backup", "%/a\x00b"], "argument path: ", "NUL"),
    (["archive", "--before", "0d", "--out", f"%/{LONG}"], "argument --out: ", "too long"),
    (["archive", "--before", "0d", "--out", "a\x00b"], "argument --out: ", "NUL"),
    (["verify", "--archive", f"%/{LONG}"], "argument --archive: ", "too long"),
    (["budgets", "--ledger", f"%/{LONG}"], "argument --ledger: ", "too long"),
    (["budgets", "--ledger", "l\x00.db"], "argument --ledger: ", "NUL"),
    (["budgets", "--config", f"%/{LONG}"], "argument --config: ", "too long"),
    (["budgets", "--config", "c\x00.toml"], "argument --config: ", "NUL"),
    (["budgets", "--ledger", ""], "argument --ledger: ", "cannot be empty"),
    (["budgets", "--config", ""], "argument --config: ", "cannot be empty"),
    (["reconcile", "--auto", "--providers", f"%/{LONG}"], "argument --providers: ", "too long"),
]


@pytest.mark.parametrize(
    ("args", "flag", "needle"), PATH_ROWS, ids=[a[-1][-8:] for a, *_ in PATH_ROWS]
)
def test_a_path_no_file_system_takes_is_refused(
    files: Group, args: list[str], flag: str, needle: str
) -> None:
    """A path with a NUL character or a name too long for the file system is refused by
    the parser, naming the argument, instead of an OSError or ValueError traceback."""
    refused(files, args, 2, flag, needle)


def test_an_unreachable_ledger_is_one_line(files: Group) -> None:
    """A PostgreSQL ledger nobody answers for is exit 4 in one line (the driver's own
    message spans several)."""
    refused(files, ["budgets", "--ledger", "postgresql://nobody@127.0.0.1:1/x"], 4, "unavailable")


VERBS = [["--resend", "--note", "n"], ["--accept-evidence"], ["--applied", "--note", "n"]]
VERBS += [["--not-applied", "--note", "n"]]


@pytest.mark.parametrize("decision", ["--applied", "--not-applied"])
@pytest.mark.parametrize("verb", VERBS, ids=[v[0] for v in VERBS])
def test_a_decided_call_takes_no_other_verb(own: Group, decision: str, verb: list[str]) -> None:
    """Once reconciled (applied or not), a call takes no resend, evidence or new decision."""
    assert run(*own.argv(["reconcile", "@unknown", decision, "--note", "n"])).code == 0
    stage = "reconciled_applied" if decision == "--applied" else "reconciled_not_applied"
    after = replace(own, baseline=snapshot(own.ledger))
    refused(after, ["reconcile", "@unknown", *verb], 3, f"is {stage}, not effect_unknown")


def test_a_long_dsn_is_no_file_name(files: Group) -> None:
    """A PostgreSQL DSN longer than a file name is a DSN: it is tried, not refused as a path."""
    dsn = "postgresql://nobody@127.0.0.1:1/x?application_name=" + "a" * 300
    refused(files, ["budgets", "--ledger", dsn], 4, "ledger unavailable")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["budget", "set", "team", "--limit", "NaN"], "argument --limit: not a USD amount"),
        (["archive", "--before", "0d", "--out", "%/ledger.db-journal"], "the ledger's own"),
    ],
    ids=["limit", "archive"],
)
def test_the_installed_command_refuses_the_same_way(
    files: Group, args: list[str], needle: str
) -> None:
    """Through a real process (python -m effectguard), a refusal is the same exit and line."""
    done = subprocess.run(
        [sys.executable, "-m", "effectguard", *files.argv(args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert needle in done.stderr.splitlines()[-1]
    assert snapshot(files.ledger) == files.baseline
