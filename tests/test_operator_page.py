"""The operator page over HTTP, through a real ``effectguard serve`` with a config file.

It is invisible without an admin key, refuses every page and form without the key
(401) or with a wrong one (401), and refuses a cross-site POST (403) without
touching the ledger; a same-site POST with the session's CSRF token records the
decision as ``call.reconciled`` by the admin key's name.
"""

from __future__ import annotations

import contextlib
import html
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from operatorkit import (
    ADMIN_KEY,
    ADMIN_NAME,
    CHAT,
    PAGE,
    Stack,
    chat_body,
    config_text,
    ledger_view,
    operator_stack,
    reconciliations,
    send_chat,
    unknown_call,
)

from effectguard.config.keysettings import AdminKey, AdminSettings, hash_key
from effectguard.ingress.admin.session import Sessions
from effectguard.testing import Proxy, running_proxy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One configured proxy for the module (each test makes its own calls)."""
    with operator_stack(tmp_path_factory.mktemp("operator")) as running:
        yield running


def fresh_key() -> str:
    """An idempotency key no other test uses."""
    return "k-" + uuid.uuid4().hex


def login(stack: Stack) -> dict[str, str]:
    """Log in through the form; the ``Cookie`` header that carries the session."""
    response = httpx.post(
        stack.url + PAGE + "login",
        data={"key": ADMIN_KEY, "next": PAGE},
        headers={"origin": stack.url},
    )
    assert response.status_code == 303, response.text
    token = response.cookies["effectguard_admin"]
    return {"cookie": f"effectguard_admin={token}"}


def test_a_login_link_with_a_line_break_in_next_lands_on_the_page(stack: Stack) -> None:
    """A crafted link (``next`` holding CR LF) once made the login fail with an internal
    error when uvicorn refused the Location header: such a target goes to the page's start."""
    response = httpx.post(
        stack.url + PAGE + "login",
        data={"key": ADMIN_KEY, "next": PAGE + "x\r\nSet-Cookie: a=b"},
        headers={"origin": stack.url},
    )
    assert response.status_code == 303, response.text
    assert response.headers["location"] == PAGE
    assert "a" not in response.cookies


def csrf_of(page: str) -> str:
    """The CSRF token in a page's forms."""
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, "no CSRF field on the page"
    return found.group(1)


def reconcile_post(
    stack: Stack, call_id: str, headers: dict[str, str], **form: str
) -> httpx.Response:
    """POST the not-applied form of ``call_id`` with ``headers`` and ``form``."""
    data = {"decision": "not_applied", "note": "provider dashboard shows nothing"} | form
    url = f"{stack.url}{PAGE}calls/{call_id}/reconcile"
    return httpx.post(url, data=data, headers=headers)


def test_page_is_invisible_without_admin_keys(tmp_path: Path) -> None:
    """Without [[admin.keys]] every path under /_effectguard/ is a plain 404, GET or POST."""
    with operator_stack(tmp_path, admin=False) as bare:
        for path in ("", "login", "budgets", "calls/x"):
            assert httpx.get(bare.url + PAGE + path).status_code == 404
        posted = httpx.post(bare.url + PAGE + "login", data={"key": ADMIN_KEY})
        assert posted.status_code == 404
        assert "_effectguard" not in httpx.get(bare.url + PAGE).text.lower().replace(
            "no provider named '_effectguard'", ""
        )


def test_every_page_and_form_needs_the_key(stack: Stack) -> None:
    """Without a key every page answers 401 with the login form, and a POST changes nothing."""
    call_id = unknown_call(stack, fresh_key())
    for path in ("", "budgets", "spend", f"calls/{call_id}", "nowhere"):
        response = httpx.get(stack.url + PAGE + path)
        assert response.status_code == 401, path
        assert 'name="key"' in response.text
        assert "gpt-4o" not in response.text and "ops/agents" not in response.text
    refused = reconcile_post(stack, call_id, {"origin": stack.url})
    assert refused.status_code == 401
    assert ledger_view(stack, call_id)[0].stage == "effect_unknown"


def test_non_ascii_credentials_are_refused_not_a_500(stack: Stack) -> None:
    """A cookie signature, CSRF token or Origin with non-ASCII characters is refused like
    any wrong one (hmac.compare_digest raises on such text: that was a 500)."""
    call_id = unknown_call(stack, fresh_key())
    forged = [(b"cookie", "effectguard_admin=YWJj.\u00e9t\u00e9".encode())]
    assert httpx.get(stack.url + PAGE, headers=forged).status_code == 401
    session = login(stack)
    page = httpx.get(f"{stack.url}{PAGE}calls/{call_id}", headers=session)
    token = csrf_of(page.text)
    bad_token = reconcile_post(stack, call_id, session | {"origin": stack.url}, csrf="\u00e9" * 64)
    assert bad_token.status_code == 403, bad_token.text
    raw_origin = [(b"origin", f"http://{stack.url.removeprefix('http://')}\u00e9".encode())]
    url = f"{stack.url}{PAGE}calls/{call_id}/reconcile"
    cookie = [(k.encode(), v.encode()) for k, v in session.items()]
    form = {"decision": "not_applied", "note": "n", "csrf": token}
    bad_origin = httpx.post(url, data=form, headers=cookie + raw_origin)
    assert bad_origin.status_code == 403, bad_origin.text
    assert ledger_view(stack, call_id)[0].stage == "effect_unknown"


def test_logging_in_again_returns_to_the_page_the_operator_was_on(stack: Stack) -> None:
    """A decision posted after the session ended gets 401 and the login form, and nothing is
    written; logging in from that form leads back to the call's page (not to a 404 for the
    form's action), and a page with a query string is returned to with its query."""
    call_id = unknown_call(stack, fresh_key())
    ended = {"cookie": "effectguard_admin=ZW5kZWQ.00", "origin": stack.url}
    refused = reconcile_post(stack, call_id, ended)
    assert refused.status_code == 401 and 'name="key"' in refused.text
    assert ledger_view(stack, call_id)[0].stage == "effect_unknown"
    asked = httpx.get(stack.url + PAGE + "budgets", params={"under": "ops"})
    for form, back_to in ((refused, f"{PAGE}calls/{call_id}"), (asked, f"{PAGE}budgets?under=ops")):
        found = re.search(r'name="next" value="([^"]*)"', form.text)
        assert found, form.text
        again = httpx.post(
            stack.url + PAGE + "login",
            data={"key": ADMIN_KEY, "next": html.unescape(found.group(1))},
            headers={"origin": stack.url},
        )
        assert again.status_code == 303 and again.headers["location"] == back_to
        cookie = {"cookie": f"effectguard_admin={again.cookies['effectguard_admin']}"}
        assert httpx.get(stack.url + back_to, headers=cookie).status_code == 200


def test_a_wrong_key_is_refused(stack: Stack) -> None:
    """A wrong bearer key, a wrong key in the login form and a forged cookie all get 401."""
    call_id = unknown_call(stack, fresh_key())
    wrong = httpx.get(stack.url + PAGE, headers={"authorization": "Bearer eg-not-the-key"})
    assert wrong.status_code == 401
    form = httpx.post(
        stack.url + PAGE + "login", data={"key": "eg-not-the-key"}, headers={"origin": stack.url}
    )
    assert form.status_code == 401 and "set-cookie" not in form.headers
    cookie = login(stack)["cookie"]
    body, _, signature = cookie.partition(".")
    forged = {"cookie": body + "." + ("0" if signature[0] != "0" else "1") + signature[1:]}
    assert httpx.get(stack.url + PAGE, headers=forged).status_code == 401
    decided = reconcile_post(
        stack, call_id, {"authorization": "Bearer eg-not-the-key", "origin": stack.url}
    )
    assert decided.status_code == 401
    assert ledger_view(stack, call_id)[0].stage == "effect_unknown"


def test_every_wrong_key_is_logged_as_a_warning(stack: Stack) -> None:
    """A wrong key is logged at warning whichever way it came, as operations.md says: a
    bearer key too (a script guessing keys that way left no trace, as a login form's did)."""

    def warned() -> int:
        return sum(
            "WARNING effectguard.admin" in line and "wrong" in line
            for line in stack.proxy.log().splitlines()
        )

    for attempt in (
        lambda: httpx.get(stack.url + PAGE, headers={"authorization": "Bearer eg-guess"}),
        lambda: httpx.post(
            stack.url + PAGE + "login", data={"key": "eg-guess"}, headers={"origin": stack.url}
        ),
    ):
        before = warned()
        assert attempt().status_code == 401
        deadline = time.monotonic() + 10
        while warned() == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert warned() == before + 1
    assert "eg-guess" not in stack.proxy.log()


def test_login_cookie_is_a_signed_httponly_strict_token(stack: Stack) -> None:
    """The session cookie is HttpOnly, SameSite=Strict, scoped to the page and not the key."""
    response = httpx.post(
        stack.url + PAGE + "login", data={"key": ADMIN_KEY}, headers={"origin": stack.url}
    )
    assert response.status_code == 303 and response.headers["location"] == PAGE
    cookie = response.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and f"Path={PAGE}" in cookie
    assert ADMIN_KEY not in cookie
    page = httpx.get(stack.url + PAGE, headers={"cookie": cookie.split(";")[0]})
    assert page.status_code == 200 and ADMIN_NAME in page.text


def _forged_from_the_config_file() -> str:
    """A session cookie signed with what the config file holds (names and digests) and no
    secret: what anyone who can read the file can make."""
    key = AdminKey(ADMIN_NAME, hash_key(ADMIN_KEY))
    sessions = Sessions(AdminSettings((key,), 3600.0, ""))
    return f"effectguard_admin={sessions.issue(key, time.time()).token}"


def test_a_shorter_session_hours_shortens_the_logins_already_made(tmp_path: Path) -> None:
    """``session_hours`` is how long a login lasts: after it is lowered (a year to one
    hour) and the proxy restarted, a cookie from a login made under the old setting,
    which still claims most of a year, is refused; a new login works."""
    config = tmp_path / "effectguard.toml"
    ledger = tmp_path / "ledger.db"

    def serve(hours: str) -> contextlib.AbstractContextManager[Proxy]:
        config.write_text(config_text(extra=f"[admin]\nsession_hours = {hours}\n"))
        return running_proxy(ledger, args=["--config", str(config)])

    with serve("8784") as proxy:
        answer = httpx.post(
            proxy.url + PAGE + "login", data={"key": ADMIN_KEY}, headers={"origin": proxy.url}
        )
        assert answer.status_code == 303, answer.text
        old = {"cookie": f"effectguard_admin={answer.cookies['effectguard_admin']}"}
        assert httpx.get(proxy.url + PAGE, headers=old).status_code == 200
    with serve("1") as proxy:
        assert httpx.get(proxy.url + PAGE, headers=old).status_code == 401
        again = httpx.post(
            proxy.url + PAGE + "login", data={"key": ADMIN_KEY}, headers={"origin": proxy.url}
        )
        assert "Max-Age=3600;" in again.headers["set-cookie"]
        new = {"cookie": f"effectguard_admin={again.cookies['effectguard_admin']}"}
        assert httpx.get(proxy.url + PAGE, headers=new).status_code == 200


def test_without_the_admin_secret_serve_warns_that_a_login_can_be_forged(
    stack: Stack,
) -> None:
    """Without EFFECTGUARD_ADMIN_SECRET the config file is all a forger needs, so serve says
    so at start, naming the variable."""
    forged = httpx.get(stack.url + PAGE, headers={"cookie": _forged_from_the_config_file()})
    assert forged.status_code == 200  # the documented trade-off the warning is about
    warnings = [line for line in stack.proxy.log().splitlines() if "can forge a login" in line]
    assert len(warnings) == 1 and "EFFECTGUARD_ADMIN_SECRET" in warnings[0], warnings


def test_with_the_admin_secret_a_login_forged_from_the_config_file_is_refused(
    tmp_path: Path,
) -> None:
    """With EFFECTGUARD_ADMIN_SECRET set, a cookie signed from the config file alone is 401,
    the admin key still logs in, and serve gives no warning."""
    config = tmp_path / "effectguard.toml"
    config.write_text(config_text())
    env = {"EFFECTGUARD_ADMIN_SECRET": "s-" + uuid.uuid4().hex}
    with running_proxy(tmp_path / "ledger.db", args=["--config", str(config)], env=env) as proxy:
        forged = httpx.get(proxy.url + PAGE, headers={"cookie": _forged_from_the_config_file()})
        assert forged.status_code == 401
        bearer = httpx.get(proxy.url + PAGE, headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert bearer.status_code == 200
    assert "can forge a login" not in proxy.log()


@pytest.mark.parametrize(
    ("case", "origin", "csrf"),
    [
        ("no CSRF token", "self", None),
        ("a wrong CSRF token", "self", "0" * 64),
        ("a foreign Origin", "https://evil.example", "good"),
        ("neither Origin nor Referer", None, "good"),
    ],
)
def test_cross_site_post_is_refused_and_changes_nothing(
    stack: Stack, case: str, origin: str | None, csrf: str | None
) -> None:
    """A cookie POST without the session's CSRF token or from another origin is 403."""
    call_id = unknown_call(stack, fresh_key())
    session = login(stack)
    token = csrf_of(httpx.get(f"{stack.url}{PAGE}calls/{call_id}", headers=session).text)
    headers = dict(session)
    if origin is not None:
        headers["origin"] = stack.url if origin == "self" else origin
    form = {} if csrf is None else {"csrf": token if csrf == "good" else csrf}
    _, before = ledger_view(stack, call_id)
    refused = reconcile_post(stack, call_id, headers, **form)
    assert refused.status_code == 403, case
    state, after = ledger_view(stack, call_id)
    assert state.stage == "effect_unknown" and len(after) == len(before)
    # The same session, from its own page with its token, is accepted: the check was the cause.
    accepted = reconcile_post(stack, call_id, session | {"origin": stack.url}, csrf=token)
    assert accepted.status_code == 303
    assert ledger_view(stack, call_id)[0].stage == "reconciled_not_applied"


def test_a_decision_needs_a_note(stack: Stack) -> None:
    """A reconcile form without a note is refused with 400 and nothing is recorded."""
    call_id = unknown_call(stack, fresh_key())
    session = login(stack)
    token = csrf_of(httpx.get(f"{stack.url}{PAGE}calls/{call_id}", headers=session).text)
    refused = reconcile_post(
        stack, call_id, session | {"origin": stack.url}, csrf=token, note="   "
    )
    assert refused.status_code == 400 and "note is required" in refused.text
    assert reconciliations(stack, call_id) == []


@pytest.mark.parametrize(
    ("note", "kept"),
    [
        ("checked the\r\n  outbox\tat 09:00\n", "checked the outbox at 09:00"),
        ("fine\x1b[2J\x1b[31m", None),
        ("paid \u202eaton\u202c", None),
        ("a\u2028b", "a b"),
    ],
    ids=["line breaks and tabs", "terminal escape", "bidi override", "line separator"],
)
def test_a_note_is_kept_on_one_printable_line(stack: Stack, note: str, kept: str | None) -> None:
    """A textarea's line breaks and tabs are folded into single spaces; a note holding a
    terminal escape or a bidi override (which ``show`` would print as they are) is refused
    with 400 and nothing is recorded, as ``reconcile --note`` refuses it."""
    call_id = unknown_call(stack, fresh_key())
    session = login(stack)
    token = csrf_of(httpx.get(f"{stack.url}{PAGE}calls/{call_id}", headers=session).text)
    answer = reconcile_post(stack, call_id, session | {"origin": stack.url}, csrf=token, note=note)
    if kept is None:
        assert answer.status_code == 400 and "a note is printable text" in answer.text
        assert reconciliations(stack, call_id) == []
    else:
        assert answer.status_code == 303, answer.text
        [decision] = reconciliations(stack, call_id)
        assert decision["note"] == kept


@pytest.mark.parametrize(
    "body",
    [b"decision=not_applied&note=checked%FF%FE", b"decision=not_applied&note=checked\xff"],
    ids=["escaped", "raw"],
)
def test_a_form_that_is_not_utf8_is_refused(stack: Stack, body: bytes) -> None:
    """A note whose bytes are no UTF-8 (a browser always sends UTF-8: a script's mistake)
    is refused with 400 and nothing is recorded, as ``reconcile --note`` refuses such an
    argument; it is never recorded as replacement characters."""
    call_id = unknown_call(stack, fresh_key())
    answer = httpx.post(
        f"{stack.url}{PAGE}calls/{call_id}/reconcile",
        content=body,
        headers={
            "authorization": f"Bearer {ADMIN_KEY}",
            "content-type": "application/x-www-form-urlencoded",
        },
    )
    assert answer.status_code == 400, answer.text
    assert "UTF-8" in answer.text
    assert reconciliations(stack, call_id) == []


def test_applied_with_a_cost_is_recorded_by_the_admin_name(stack: Stack) -> None:
    """Applied with a cost writes call.reconciled (applied, that cost, by the key's name)."""
    call_id = unknown_call(stack, fresh_key())
    session = login(stack)
    token = csrf_of(httpx.get(f"{stack.url}{PAGE}calls/{call_id}", headers=session).text)
    decided = reconcile_post(
        stack,
        call_id,
        session | {"origin": stack.url},
        csrf=token,
        decision="applied",
        cost="0.0125",
        note="billed on the invoice",
    )
    assert decided.status_code == 303
    assert decided.headers["location"] == f"{PAGE}calls/{call_id}?done=reconciled_applied"
    [decision] = reconciliations(stack, call_id)
    assert decision["applied"] is True and decision["cost"] == 12_500_000
    assert decision["by"] == ADMIN_NAME and decision["note"] == "billed on the invoice"
    again = reconcile_post(stack, call_id, session | {"origin": stack.url}, csrf=token)
    assert again.status_code == 409 and len(reconciliations(stack, call_id)) == 1


@pytest.mark.parametrize(
    ("cost", "problem"),
    [
        ("1_000", "not a USD amount"),
        ("+5", "not a USD amount"),
        ("\uff11\uff12", "not a USD amount"),  # full-width digits
        ("\u0663", "not a USD amount"),  # an Arabic-Indic digit
        ("1.0000000001", "finer than a nano-dollar"),
        ("1e-10", "finer than a nano-dollar"),
        ("-1", "cannot be negative"),
        ("9007199.254740993", "must be between 0 and"),
    ],
)
def test_a_cost_is_read_exactly_as_reconcile_reads_it(
    stack: Stack, cost: str, problem: str
) -> None:
    """The page's cost box takes what ``reconcile --cost`` takes, and nothing else: an
    amount it would have to round, or digits of another script, is refused with 400 and
    nothing is recorded (a stray ``_`` once read as a thousand dollars)."""
    call_id = unknown_call(stack, fresh_key())
    session = login(stack)
    token = csrf_of(httpx.get(f"{stack.url}{PAGE}calls/{call_id}", headers=session).text)
    refused = reconcile_post(
        stack,
        call_id,
        session | {"origin": stack.url},
        csrf=token,
        decision="applied",
        cost=cost,
        note="billed on the invoice",
    )
    assert refused.status_code == 400 and problem in refused.text, refused.text
    assert reconciliations(stack, call_id) == []


def test_a_script_may_use_the_key_as_a_bearer_token(stack: Stack) -> None:
    """With Authorization: Bearer KEY a script reads pages and decides without a CSRF token."""
    call_id = unknown_call(stack, fresh_key())
    bearer = {"authorization": f"Bearer {ADMIN_KEY}"}
    listed = httpx.get(stack.url + PAGE, headers=bearer)
    assert listed.status_code == 200 and call_id in listed.text
    decided = reconcile_post(stack, call_id, bearer)
    assert decided.status_code == 303
    assert reconciliations(stack, call_id)[0]["by"] == ADMIN_NAME


def test_ledger_text_is_escaped(stack: Stack) -> None:
    """Request text from a client reaches the call's page escaped, never as markup."""
    call_id = unknown_call(stack, fresh_key(), content="<script>alert('x')</script>")
    page = httpx.get(
        f"{stack.url}{PAGE}calls/{call_id}", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert page.status_code == 200
    assert "<script>" not in page.text and "&lt;script&gt;" in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]


def test_a_direction_override_from_a_client_is_shown_as_its_escape(stack: Stack) -> None:
    """A client's idempotency key and prompt holding a right-to-left override (U+202E makes
    what follows read backwards: "deliaf" after it reads as "failed") and a C1 control reach
    the call's page as their escapes, as ``effectguard show`` prints them, never raw."""
    key = "k-" + uuid.uuid4().hex + "-\u202edeilppa"
    headers = {
        "idempotency-key": key.encode(),
        "effectguard-budget": "ops/agents",
        "x-fake-behaviour": "drop",
    }
    body = {**chat_body(), "messages": [{"role": "user", "content": "status: \u202edeliaf\x9b"}]}
    answer = httpx.post(stack.url + CHAT, json=body, headers=headers, timeout=30)
    assert answer.status_code in (502, 504), answer.text
    call_id = answer.headers["effectguard-call-id"]
    bearer = {"authorization": f"Bearer {ADMIN_KEY}"}
    for path in (f"calls/{call_id}", ""):
        page = httpx.get(stack.url + PAGE + path, headers=bearer)
        assert page.status_code == 200
        assert "\u202e" not in page.text and "\x9b" not in page.text
        assert "\\u202edeilppa" in page.text
    assert "status: \\u202edeliaf\\x9b" in page_of(stack, call_id)


def test_a_link_cannot_say_a_decision_was_recorded(stack: Stack) -> None:
    """The "Recorded" notice after a decision comes from the link's ``done`` parameter: a
    link someone sends the operator, or a tab reloaded after another tab decided
    otherwise, claims nothing the ledger does not hold. It is shown only while the call
    is in that stage."""
    call_id = unknown_call(stack, fresh_key())
    bearer = {"authorization": f"Bearer {ADMIN_KEY}"}
    url = f"{stack.url}{PAGE}calls/{call_id}"
    lie = httpx.get(url, params={"done": "reconciled_not_applied"}, headers=bearer)
    assert lie.status_code == 200
    assert "Recorded" not in lie.text
    decided = httpx.post(
        f"{url}/reconcile", data={"decision": "applied", "note": "seen"}, headers=bearer
    )
    assert decided.status_code == 303, decided.text
    assert "Recorded: reconciled_applied." in page_of(stack, call_id, decided.headers["location"])
    stale = httpx.get(url, params={"done": "reconciled_not_applied"}, headers=bearer)
    assert "Recorded" not in stale.text


def page_of(stack: Stack, call_id: str, location: str | None = None) -> str:
    """A call's page (or the page at ``location``, a redirect's), as the admin."""
    bearer = {"authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.get(stack.url + (location or f"{PAGE}calls/{call_id}"), headers=bearer).text


def test_budgets_and_spend_show_the_ledger(stack: Stack) -> None:
    """The budget page shows each node against its limit; the spend page charts the cost."""
    answered = send_chat(stack, fresh_key())
    assert answered.status_code == 200
    bearer = {"authorization": f"Bearer {ADMIN_KEY}"}
    budgets = httpx.get(stack.url + PAGE + "budgets", headers=bearer).text
    assert "ops" in budgets and "agents" in budgets and "$5.00" in budgets
    spend = httpx.get(stack.url + PAGE + "spend?days=7", headers=bearer).text
    assert "openai/gpt-4o-mini" in spend and "<svg" in spend and "<rect" in spend
    # A days value that is no ASCII number shows the default window, never a 500.
    for days, shown in [("²", 14), ("9" * 5000, 366), ("-3", 14), ("0", 1), ("99999", 366)]:
        page = httpx.get(stack.url + PAGE + "spend", params={"days": days}, headers=bearer)
        assert page.status_code == 200, (days, page.text)
        assert f"Spend, last {shown} days" in page.text


def test_the_spend_page_shows_a_bounded_number_of_series(tmp_path: Path) -> None:
    """Every dated snapshot a client names (``gpt-4o-mini-20240101`` ...) is priced as its
    base model but kept as sent, one series each: past ``SPEND_SERIES`` the page sums the
    smallest into one ``other`` series that says how many it holds, so a client cannot
    grow the chart and its table without bound. Every call is still counted."""
    from effectguard.ingress.admin.spend import SPEND_SERIES

    made = SPEND_SERIES + 5
    with operator_stack(tmp_path) as own, httpx.Client(timeout=30) as client:
        for n in range(made):
            body = {**chat_body(), "model": f"gpt-4o-mini-202401{n + 1:02d}"}
            assert client.post(own.url + CHAT, json=body).status_code == 200
        bearer = {"authorization": f"Bearer {ADMIN_KEY}"}
        page = client.get(own.url + PAGE + "spend", headers=bearer).text
    rows = re.findall(r"<tr><td><span[^>]*>■</span> ([^<]*)</td><td class=\"num\">(\d+)<", page)
    names = [name for name, _ in rows]
    assert len(names) == SPEND_SERIES + 1, names
    assert sum(name.startswith("openai/gpt-4o-mini-2024") for name in names) == SPEND_SERIES
    assert "other (5 series)" in names
    assert sum(int(calls) for _, calls in rows) == made
    # One bar segment per series and day (two days if the calls straddle UTC midnight).
    assert page.count("<rect") <= 2 * (SPEND_SERIES + 1)


def test_the_budget_page_says_whose_day_a_period_is(stack: Stack) -> None:
    """A daily node in Asia/Kathmandu (UTC+05:45) shows its current day's label with its
    zone, so an operator in another zone can tell which day the money counts in."""
    from effectguard.ops.cli import main as cli_main
    from effectguard.rules import periods

    zone = "Asia/Kathmandu"
    assert cli_main(["budget", "set", "ops/nepal", "--limit", "1", "--period", "day", "--tz", zone,
                     "--ledger", stack.proxy.ledger]) == 0  # fmt: skip
    before = periods.label("day", zone, time.time())
    page = httpx.get(
        stack.url + PAGE + "budgets", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    ).text
    after = periods.label("day", zone, time.time())
    assert f"{before} ({zone})" in page or f"{after} ({zone})" in page


def test_the_budget_page_opens_the_tree_a_few_levels_at_a_time(stack: Stack) -> None:
    """Per-run nodes add a node with every run: the page shows two levels, each name opens
    the tree below it, and past 500 nodes it lists 500 and counts the rest. A path given
    is a path, never a pattern: one no budget can have is refused 400 as the CLI refuses
    it (it showed an empty node), its echo escaped."""
    import asyncio

    from effectguard.ledger import Ledger
    from effectguard.rules.budget import BudgetPolicy

    async def declare() -> None:
        async with Ledger.open(stack.proxy.ledger) as ledger:
            for path in ["wide/team/u1/run-1", *(f"wide/many/u{i:03d}" for i in range(501))]:
                await ledger.set_policy(BudgetPolicy(path, 10**9))

    asyncio.run(declare())
    bearer = {"authorization": f"Bearer {ADMIN_KEY}"}

    def shown(under: str | None) -> str:
        params = {} if under is None else {"under": under}
        got = httpx.get(stack.url + PAGE + "budgets", params=params, headers=bearer)
        assert got.status_code == 200, got.text
        return got.text

    top = shown(None)
    assert 'title="wide/team"' in top and 'title="wide/team/u1"' not in top
    assert 'href="/_effectguard/budgets?under=wide/team"' in top
    team = shown("wide/team")
    assert 'title="wide/team/u1/run-1"' in team and 'title="wide/many"' not in team
    many = shown("wide/many")
    assert many.count('title="wide/many/u') == 499  # the node itself and 499 below it
    assert "2 more nodes at these levels are not listed" in many
    assert "No budget node here." in shown("wide/none")
    for bad in ("w%", "../wide", "<script>alert(1)</script>"):
        got = httpx.get(stack.url + PAGE + "budgets", params={"under": bad}, headers=bearer)
        assert got.status_code == 400, got.text
        assert "invalid budget path" in got.text and "<script>alert" not in got.text
