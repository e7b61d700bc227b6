"""The operator page's pure parts: sessions and CSRF tokens, origins, spend, config.

Sessions carry no server state: two replicas with the same ``[admin]`` configuration
accept each other's cookies, and changing the admin keys ends every session.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from effectguard.config.settings import AdminKey, AdminSettings, hash_key, load_settings
from effectguard.errors import ConfigError
from effectguard.ingress.admin.charts import stacked_bars
from effectguard.ingress.admin.session import Sessions, same_origin
from effectguard.ingress.admin.spend import DAY_S, spend_by_day
from effectguard.rules.workstate import WorkState

ANA = AdminKey("ana", hash_key("eg-ana"))
BOB = AdminKey("bob", hash_key("eg-bob"))
NOW = 1_800_000_000.0


def test_a_session_from_one_replica_is_valid_on_another() -> None:
    """Two page instances built from the same config accept each other's session and CSRF."""
    one, two = Sessions(AdminSettings((ANA, BOB))), Sessions(AdminSettings((BOB, ANA)))
    session = one.issue(ANA, NOW)
    checked = two.check(session.token, NOW + 60)
    assert checked is not None and checked.name == "ana"
    assert two.csrf_ok(checked, one.csrf_token(session))


def test_a_session_ends_when_it_expires_or_the_keys_change() -> None:
    """An expired token, or one signed under other admin keys or another secret, is refused."""
    admin = AdminSettings((ANA,), session_s=3600)
    token = Sessions(admin).issue(ANA, NOW).token
    assert Sessions(admin).check(token, NOW + 3599) is not None
    assert Sessions(admin).check(token, NOW + 3601) is None
    assert Sessions(AdminSettings((BOB,))).check(token, NOW) is None
    assert Sessions(AdminSettings((ANA, BOB))).check(token, NOW) is None
    assert Sessions(AdminSettings((ANA,), secret="s")).check(token, NOW) is None


def test_a_tampered_session_or_csrf_token_is_refused() -> None:
    """Changing the name inside a token, or another session's CSRF token, does not pass."""
    sessions = Sessions(AdminSettings((ANA, BOB)))
    ana, bob = sessions.issue(ANA, NOW), sessions.issue(BOB, NOW)
    body, _, signature = ana.token.partition(".")
    assert sessions.check(bob.token.partition(".")[0] + "." + signature, NOW) is None
    assert sessions.check(body, NOW) is None and sessions.check("", NOW) is None
    assert not sessions.csrf_ok(ana, sessions.csrf_token(bob))
    assert not sessions.csrf_ok(ana, "")


@pytest.mark.parametrize(
    ("origin", "referer", "host", "ok"),
    [
        ("http://127.0.0.1:8787", None, "127.0.0.1:8787", True),
        ("https://ops.example.com", None, "ops.example.com", True),
        (None, "http://127.0.0.1:8787/_effectguard/calls/x", "127.0.0.1:8787", True),
        ("https://evil.example", None, "127.0.0.1:8787", False),
        ("null", None, "127.0.0.1:8787", False),
        (None, "http://evil.example/_effectguard/", "127.0.0.1:8787", False),
        ("http://127.0.0.1:9999", None, "127.0.0.1:8787", False),
        (None, None, "127.0.0.1:8787", False),
    ],
)
def test_same_origin(origin: str | None, referer: str | None, host: str, ok: bool) -> None:
    """A POST counts as this page's only if its Origin (else Referer) names the Host."""
    assert same_origin(origin, referer, host) is ok


def _call(call_id: str, at: float, cost: int | None, held: int = 0, model: str = "m") -> WorkState:
    return WorkState(
        call_id=call_id, provider="p", model=model, created_at=at, cost=cost, held=held
    )


def test_spend_is_charged_to_the_day_of_admission_by_provider_and_model() -> None:
    """Cost lands on the UTC day the call was admitted, per provider/model; old days drop out."""
    calls = [
        _call("a", NOW, 100),
        _call("b", NOW - DAY_S, 50),
        _call("c", NOW - DAY_S, 7, model="n"),
        _call("d", NOW, None, held=30),
        _call("e", NOW - 10 * DAY_S, 999),
    ]
    table = spend_by_day(calls, now=NOW, days=3)
    assert table.spent == {"p/m": [0, 50, 100], "p/n": [0, 7, 0]}
    assert table.held == {"p/m": 30, "p/n": 0}
    assert table.series() == ["p/m", "p/n"]
    svg = stacked_bars(["a", "b", "c"], table.spent, title="t")
    assert svg.count("<rect") == 3


def test_admin_keys_are_read_from_the_config(tmp_path: Path) -> None:
    """[[admin.keys]] gives named keys; a key without a name or a bad digest is refused."""
    config = tmp_path / "c.toml"
    config.write_text(
        f'[admin]\nsession_hours = 2\n[[admin.keys]]\nname = "ana"\nsha256 = "{ANA.sha256}"\n'
    )
    admin = load_settings(config=config, environ={"EFFECTGUARD_ADMIN_SECRET": "s"}).admin
    assert admin.keys == (ANA,) and admin.session_s == 7200 and admin.secret == "s"
    assert admin.key_for("eg-ana") == ANA and admin.key_for("eg-bob") is None
    assert not load_settings(environ={}).admin.enabled
    for bad in (f'sha256 = "{ANA.sha256}"', 'name = "ana"\nsha256 = "xyz"'):
        config.write_text(f"[[admin.keys]]\n{bad}\n")
        with pytest.raises(ConfigError, match=r"admin\.keys\[0\]"):
            load_settings(config=config, environ={})


@pytest.mark.parametrize("hours", ["0", "0.001", "1e305", "9000"])
def test_a_session_length_no_cookie_can_carry_is_refused_at_start(
    tmp_path: Path, hours: str
) -> None:
    """``session_hours`` from a minute to a year: shorter, every login's cookie expires at
    once; longer (1e305), the cookie's Max-Age overflowed and every login answered 500."""
    config = tmp_path / "c.toml"
    config.write_text(
        f'[admin]\nsession_hours = {hours}\n[[admin.keys]]\nname = "ana"\nsha256 = "{ANA.sha256}"\n'
    )
    with pytest.raises(ConfigError, match="session_hours must be between"):
        load_settings(config=config, environ={})
