"""The operator page driven in a real headless Chromium (Debian's chromium + chromium-driver).

An ``effect_unknown`` call is made through a real proxy and the fake provider; an
operator logs in with the admin key, finds the call among the unknown ones, opens
it and reconciles it as not applied with a note. The ledger then holds the decision
by the admin key's name, and the same idempotency key goes out exactly once more.
Each page is saved as a screenshot under ``$EFFECTGUARD_ARTIFACTS`` (default: the
test's temporary directory).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operatorkit import (
    ADMIN_KEY,
    ADMIN_NAME,
    PAGE,
    ledger_view,
    operator_stack,
    reconciliations,
    send_chat,
    unknown_call,
)

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 30

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
    pytest.skip(
        "headless Chromium needs the Debian packages chromium and chromium-driver "
        f"({CHROMIUM}, {CHROMEDRIVER})",
        allow_module_level=True,
    )

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture
def browser() -> Iterator[Any]:
    """A headless Chromium controlled through chromedriver."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument("--window-size=1280,1000")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    """Where screenshots go: ``$EFFECTGUARD_ARTIFACTS`` or the test's temporary directory."""
    where = Path(os.environ.get("EFFECTGUARD_ARTIFACTS") or tmp_path / "screenshots")
    where.mkdir(parents=True, exist_ok=True)
    return where


def wait_for(driver: Any, element_id: str) -> Any:
    """The element with ``element_id``, once the page that has it is loaded."""
    located = expected_conditions.presence_of_element_located((By.ID, element_id))
    return WebDriverWait(driver, WAIT_S).until(located)


def snap(driver: Any, artifacts: Path, name: str) -> None:
    """Save the current page as ``NAME.png`` (the whole page, not just the window)."""
    driver.set_window_size(1280, 1000)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, max(1000, min(int(height) + 40, 4000)))
    assert driver.save_screenshot(str(artifacts / f"{name}.png"))


def test_operator_reconciles_an_unknown_call_in_a_browser(
    tmp_path: Path, browser: Any, artifacts: Path
) -> None:
    """Log in, find the unknown call, reconcile it not applied; the key may then go once more."""
    with operator_stack(tmp_path) as stack:
        key = "browser-k1"
        call_id = unknown_call(stack, key)
        assert len(stack.provider.effects()) == 1

        browser.get(stack.url + PAGE)
        wait_for(browser, "key").send_keys(ADMIN_KEY)
        snap(browser, artifacts, "01-login")
        browser.find_element(By.ID, "login").click()

        link = WebDriverWait(browser, WAIT_S).until(
            expected_conditions.element_to_be_clickable((By.LINK_TEXT, call_id))
        )
        assert "Unknown-effect calls" in browser.page_source
        snap(browser, artifacts, "02-unknown-calls")
        link.click()

        wait_for(browser, "note-not_applied").send_keys(
            "the provider's usage page shows no request at that time"
        )
        assert "Evidence" in browser.page_source and "attempt.interrupted" in browser.page_source
        snap(browser, artifacts, "03-call")
        browser.find_element(By.ID, "submit-not_applied").click()

        WebDriverWait(browser, WAIT_S).until(expected_conditions.url_contains("done="))
        assert "Recorded: reconciled_not_applied" in browser.page_source
        snap(browser, artifacts, "04-call-reconciled")

        [decision] = reconciliations(stack, call_id)
        assert decision["applied"] is False and decision["by"] == ADMIN_NAME
        assert ledger_view(stack, call_id)[0].stage == "reconciled_not_applied"

        resent = send_chat(stack, key)
        assert resent.status_code == 200 and resent.headers["effectguard-call-id"] == call_id
        assert len(stack.provider.effects()) == 2
        assert ledger_view(stack, call_id)[0].attempts == 2
        replayed = send_chat(stack, key)
        assert replayed.headers.get("effectguard-replayed") == "true"
        assert len(stack.provider.effects()) == 2
        for page in ("budgets", "spend"):  # now with the resent call's cost
            browser.get(stack.url + PAGE + page)
            snap(browser, artifacts, f"05-{page}")
        assert "openai/gpt-4o-mini" in browser.page_source
    assert sorted(p.name for p in artifacts.glob("*.png")) == [
        "01-login.png",
        "02-unknown-calls.png",
        "03-call.png",
        "04-call-reconciled.png",
        "05-budgets.png",
        "05-spend.png",
    ]
