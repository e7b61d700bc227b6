"""The login form's ``next`` over HTTP: only a plain path of the operator page is followed.

``next`` is where a login leads (the page the operator asked for before logging in). It
comes from the request (a link, a form field), so a crafted one must not lead anywhere a
browser would resolve outside the page: a dot segment (``..``, however percent-encoded),
a second slash or a backslash (another host), a scheme, or a control character (which a
browser strips, or which would break the ``Location`` header). Each such ``next`` is
replaced by the page's root, in the form a 401 shows and in the login's redirect alike.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator

import httpx
import pytest
from operatorkit import ADMIN_KEY, PAGE, Stack, operator_stack

pytestmark = pytest.mark.slow

#: Each ``next`` a login must not follow (the page's root is followed instead).
HOSTILE = [
    PAGE + "../openai/v1/models",
    PAGE + "..",
    PAGE + "calls/../../x",
    PAGE + "./../x",
    PAGE + "%2e%2e/x",
    PAGE + "%2E%2e/x",
    PAGE + ".%2e/x",
    PAGE + "%2e./x",
    PAGE + "%2e/x",
    PAGE + "calls/%2e%2e%2f%2e%2e/x",
    PAGE + "..?under=ops",
    PAGE + "/evil.example",
    PAGE + "%2f%2fevil.example",
    PAGE + "\\evil.example",
    PAGE + "%5cevil.example",
    "//evil.example" + PAGE,
    "/\\evil.example" + PAGE,
    "/../x",
    "/%2e%2e/x",
    "https://evil.example" + PAGE,
    "javascript:alert(1)//" + PAGE,
    "JavaScript:" + PAGE,
    "data:text/html," + PAGE,
    PAGE + "x\tx",
    PAGE + "\t/evil.example",
    PAGE + "x\x00",
    PAGE + "x\x7f",
    PAGE + "x\u2028",
    PAGE + "\u00e9",
    "",
]

#: Each ``next`` a login follows as given.
KEPT = [PAGE, PAGE + "budgets?under=ops", PAGE + "spend?days=7", PAGE + "calls/c-1.2..3"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One configured proxy for the module."""
    with operator_stack(tmp_path_factory.mktemp("next")) as running:
        yield running


def login_to(stack: Stack, target: str, key: str = ADMIN_KEY) -> httpx.Response:
    """POST the login form with ``next`` set to ``target``."""
    return httpx.post(
        stack.url + PAGE + "login",
        data={"key": key, "next": target},
        headers={"origin": stack.url},
    )


def next_field(form: str) -> str:
    """The ``next`` a login form carries."""
    found = re.search(r'name="next" value="([^"]*)"', form)
    assert found, form
    return html.unescape(found.group(1))


@pytest.mark.parametrize("target", HOSTILE)
def test_a_login_with_a_hostile_next_lands_on_the_pages_root(stack: Stack, target: str) -> None:
    """A login whose ``next`` leaves the page's paths (or hides a way out) is redirected to
    the page's root, and a wrong key's form does not carry that ``next`` on either."""
    response = login_to(stack, target)
    assert response.status_code == 303, response.text
    assert response.headers["location"] == PAGE
    wrong = login_to(stack, target, key="eg-admin-wrong")
    assert wrong.status_code == 401
    assert next_field(wrong.text) == PAGE


@pytest.mark.parametrize("target", KEPT)
def test_a_login_with_a_plain_next_lands_there(stack: Stack, target: str) -> None:
    """A ``next`` that is a plain path of the page (a query, a dot inside a name) is kept."""
    response = login_to(stack, target)
    assert response.status_code == 303
    assert response.headers["location"] == target


@pytest.mark.parametrize(
    "path", ["%2e%2e/openai/v1/models", "calls/%2e%2e/%2e%2e/x", "%2E./x", "%5c%5cevil.example"]
)
def test_a_401_form_for_a_hostile_path_leads_to_the_pages_root(stack: Stack, path: str) -> None:
    """A GET of a crafted path without a session answers the login form; its ``next`` is the
    page's root (the server decodes ``%2e%2e`` to ``..``), and logging in from it lands there."""
    form = httpx.get(stack.url + PAGE + path)
    assert form.status_code == 401
    target = next_field(form.text)
    assert target == PAGE
    assert login_to(stack, target).headers["location"] == PAGE
