"""Settings objects print no secret: a repr ends up in tracebacks, debug logs and bug
reports. Before, ``repr(ServeSettings)`` showed every provider's API key and the ledger
URL's password, ``repr(AdminSettings)`` the session-signing secret, and a ``Session``
its bearer token."""

from __future__ import annotations

from effectguard.config.keysettings import AdminKey, AdminSettings
from effectguard.config.settings import ServeSettings
from effectguard.ingress.admin.session import Session

PASSWORD = "pg-hunter2-secret"
PROVIDER_KEY = "sk-live-provider-secret"
ADMIN_SECRET = "admin-signing-secret"
TOKEN = "session-token-secret"


def test_serve_settings_repr_shows_no_provider_key_and_no_ledger_password() -> None:
    admin = AdminSettings(keys=(AdminKey("ops", "0" * 64),), secret=ADMIN_SECRET)
    settings = ServeSettings(
        ledger=f"postgresql://eg:{PASSWORD}@db.internal/ledger?sslpassword={PASSWORD}",
        provider_keys={"openai": PROVIDER_KEY},
        admin=admin,
    )
    shown = repr(settings)
    for secret in (PASSWORD, PROVIDER_KEY, ADMIN_SECRET):
        assert secret not in shown
    # Still useful: which ledger, which providers have a key.
    assert "db.internal" in shown and "openai" in shown


def test_admin_settings_and_session_reprs_show_no_secret() -> None:
    assert ADMIN_SECRET not in repr(AdminSettings(secret=ADMIN_SECRET))
    assert TOKEN not in repr(Session("ops", TOKEN, 0.0))
