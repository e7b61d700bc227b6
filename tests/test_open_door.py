"""``serve`` warns at start when it listens off the loopback with no proxy keys: anyone who
can reach it then spends, with effectguard's own provider keys where they are set
(docs/contract.md §1). The local default (127.0.0.1, no keys) and a keyed proxy say
nothing. Every proxy here is only ever called on 127.0.0.1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from effectguard.config.settings import hash_key
from effectguard.ingress.openness import loopback_only
from effectguard.testing import running_proxy

pytestmark = pytest.mark.slow

WARNING = "with no proxy keys: anyone who can reach it spends"
KEY = f'[[keys]]\nsha256 = "{hash_key("eg-open-door-test-key")}"\nbudget_root = "team"\n'


def _log_of(tmp_path: Path, host: str | None, keyed: bool) -> str:
    """What a healthy ``serve`` on ``host`` logged at start."""
    args = [] if host is None else ["--host", host]
    if keyed:
        config = tmp_path / "keys.toml"
        config.write_text(KEY)
        args += ["--config", str(config)]
    with running_proxy(tmp_path / "ledger.db", args=args) as proxy:
        return proxy.log()


def test_a_wildcard_address_without_keys_is_warned_about(tmp_path: Path) -> None:
    log = _log_of(tmp_path, "0.0.0.0", keyed=False)
    (line,) = [line for line in log.splitlines() if WARNING in line]
    assert "WARNING" in line and "listening on 0.0.0.0" in line, line
    assert "effectguard key new" in line, line


@pytest.mark.parametrize(
    ("host", "keyed"),
    [(None, False), ("localhost", False), ("0.0.0.0", True)],
    ids=["default", "localhost", "keyed-wildcard"],
)
def test_loopback_or_keyed_says_nothing(tmp_path: Path, host: str | None, keyed: bool) -> None:
    assert WARNING not in _log_of(tmp_path, host, keyed)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.2", True), ("::1", True), ("localhost", True), ("0.0.0.0", False), ("::", False)],
)
def test_what_counts_as_the_loopback(host: str, loopback: bool) -> None:
    """Every address of 127/8 and ::1 is; a wildcard (every interface) is not."""
    assert loopback_only(host) is loopback
