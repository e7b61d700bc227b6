"""A config value is taken in its own TOML type, never converted: ``"false"`` is no
boolean (``bool("false")`` is true), ``2.5`` no count (``int(2.5)`` is 2), ``5`` no name.

Each case runs ``effectguard serve --config`` in a process of its own: exit 2, one line
naming the key, and no ledger created.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from stagedkit import serve_refusing

DIGEST = "ab" * 32
KEY = f'[[keys]]\nsha256 = "{DIGEST}"\nbudget_root = "team-a"\n'

CASES = [
    ('[guard]\ncreate_budgets = "false"', "guard.create_budgets: must be true or false"),
    ("[guard]\ncreate_budgets = 0", "guard.create_budgets: must be true or false"),
    ('[server]\notel = "no"', "server.otel: must be true or false"),
    (f'{KEY}metrics = "false"', "keys[0].metrics: must be true or false"),
    ("[guard]\nmax_retries = 2.5", "guard.max_retries: must be a whole number"),
    ("[guard]\nmax_retries = 2.0", "guard.max_retries: must be a whole number"),
    ("[guard]\nmax_answer_bytes = 1e6", "guard.max_answer_bytes: must be a whole number"),
    ("[server]\nmax_body_bytes = 0.5", "server.max_body_bytes: must be a whole number"),
    ("[server]\nspool_body_bytes = 1024.5", "server.spool_body_bytes: must be a whole number"),
    ("[server]\nmax_header_bytes = 65536.5", "server.max_header_bytes: must be a whole number"),
    ('[server]\nmax_connections = "10"', "server.max_connections: must be a non-negative"),
    ("[server]\nmetrics_host = 5", "server.metrics_host: must be a host name or address"),
    ('[server]\nhost = ""', "server.host: must be a host name or address"),
    ('[[keys]]\nsha256 = "x"\nbudget_root = 5', "keys[0].sha256: must be a hex"),
    (f'[[keys]]\nsha256 = "{DIGEST}"\nbudget_root = 5', "keys[0].budget_root: must be a string"),
    (f"{KEY}name = 5", "keys[0].name: must be a string"),
    (f'{KEY}name = "tab\\there"', "keys[0].name: must be a printable, non-empty name"),
    (f'{KEY}name = "  "', "keys[0].name: must be a printable, non-empty name"),
    (f"[[keys]]\nsha256 = {'1' * 64}\nbudget_root = 'a'", "keys[0].sha256: must be a string"),
    ('[[admin.keys]]\nname = true\nsha256 = "00"', "admin.keys[0].name: must be a string"),
    ("keys = 5", "keys must be an array of tables ([[keys]])"),
    ('[keys]\nsha256 = "00"', "keys must be an array of tables ([[keys]])"),
    ('[retention]\nkeep_bodies_days = "x"', "retention.keep_bodies_days: must be"),
    # One secret is one key: a second entry with its digest silently replaced the first
    # (its budget root lost), and an admin key that is also a proxy key could spend.
    (f'{KEY}[[keys]]\nsha256 = "{DIGEST}"\nbudget_root = "team-b"', "keys[1].sha256: "),
    (
        f'[[admin.keys]]\nname = "a"\nsha256 = "{DIGEST}"\n'
        f'[[admin.keys]]\nname = "b"\nsha256 = "{DIGEST}"',
        "admin.keys[1].sha256: ",
    ),
    (f'{KEY}[[admin.keys]]\nname = "a"\nsha256 = "{DIGEST}"', "admin.keys[0].sha256: "),
    # A limit is exact, as `budget set --limit` takes it: never rounded up to a nano-dollar
    # (it was, to 0.000000001 and 5.000000001), and digits are ASCII digits.
    ('[budgets]\nteam = "0.0000000001"', "budgets.team: 0.0000000001 USD is finer than a"),
    ('[budgets]\nteam = "5.0000000001"', "budgets.team: 5.0000000001 USD is finer than a"),
    ('[budgets]\nteam = "1_000"', "budgets.team: not a USD amount: '1_000'"),
    ('[budgets]\nteam = "\uff15"', "budgets.team: not a USD amount"),
    ('[budgets]\nteam = "-0"', "budgets.team: amounts cannot be negative"),
]


@pytest.mark.parametrize(("text", "needle"), CASES, ids=[c[0].replace("\n", " ") for c in CASES])
def test_a_value_of_the_wrong_type_is_refused_naming_its_key(
    tmp_path: Path, text: str, needle: str
) -> None:
    """serve --config with a value that is not of its key's TOML type exits 2 with one line
    naming the file and the key, before it creates a ledger (a [server], [guard] or
    [upstream] key's line once named no file)."""
    config = tmp_path / "effectguard.toml"
    config.write_text(text + "\n")
    ledger = tmp_path / "ledger.db"
    done = serve_refusing("--config", str(config), "--ledger", str(ledger), "--port", "0")
    assert done.code == 2, done
    assert done.err.count("\n") == 1 and needle in done.err, done.err
    assert done.err.startswith(f"effectguard: {config}: "), done.err
    assert not ledger.exists()
