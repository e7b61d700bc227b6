"""A call admitted by a host whose clock is ahead of this one's (or on this host before
its clock was stepped back) is not shown as admitted "0s" ago.

Its admission time is what the admitting replica's clock said; here it is in the future.
``calls`` shows its age as negative (``-2m``), ``show`` and the operator page say how far
ahead of this host's clock it is, rather than pretending it was admitted just now.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from operatorkit import ADMIN_KEY, PAGE, config_text, write_unknown_calls

from effectguard.ops.cli import main as cli_main
from effectguard.testing import running_proxy

AHEAD_S = 150


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``effectguard ARGV``'s stdout (it must succeed)."""
    capsys.readouterr()
    assert cli_main(list(argv)) == 0
    return capsys.readouterr().out


def test_calls_and_show_say_a_call_is_ahead_of_this_hosts_clock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``calls`` prints the negative age (``-2m``), not ``0s``; ``show`` says the call's
    admission is ahead of this host's clock, not "0s ago"."""
    ledger = tmp_path / "l.db"
    ahead = time.time() + AHEAD_S
    (call_id,) = write_unknown_calls(ledger, 1, first_at=ahead, rest_at=ahead)
    listing = run(capsys, "calls", "--ledger", str(ledger))
    row = next(line for line in listing.splitlines() if call_id in line)
    assert re.search(r"\s-2m\d*s?\s", row), row
    text = run(capsys, "show", call_id, "--ledger", str(ledger))
    created = next(line for line in text.splitlines() if line.strip().startswith("created"))
    assert "ahead of this host's clock" in created and "ago" not in created, created
    assert re.search(r"\(2m\d+s ahead", created), created


def test_an_age_in_the_past_reads_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A call admitted 3 minutes ago still reads ``3m..`` in ``calls`` and "ago" in ``show``."""
    ledger = tmp_path / "l.db"
    past = time.time() - 185
    (call_id,) = write_unknown_calls(ledger, 1, first_at=past, rest_at=past)
    listing = run(capsys, "calls", "--ledger", str(ledger))
    row = next(line for line in listing.splitlines() if call_id in line)
    assert re.search(r"\s3m\d+s\s", row), row
    text = run(capsys, "show", call_id, "--ledger", str(ledger))
    assert re.search(r"created .*\(3m\d+s ago\)", text), text


@pytest.mark.slow
def test_the_operator_page_says_a_call_is_ahead(tmp_path: Path) -> None:
    """The start page's age column and the call's page say "ahead", not "0 s" / "0 s ago"."""
    ledger = tmp_path / "ledger.db"
    ahead = time.time() + AHEAD_S
    (call_id,) = write_unknown_calls(ledger, 1, first_at=ahead, rest_at=ahead)
    config = tmp_path / "effectguard.toml"
    config.write_text(config_text())
    bearer = {"authorization": f"Bearer {ADMIN_KEY}"}
    upstreams = {"openai": "http://127.0.0.1:9"}
    with running_proxy(ledger, upstreams=upstreams, args=["--config", str(config)]) as proxy:
        start = httpx.get(proxy.url + PAGE, headers=bearer, timeout=30)
        page = httpx.get(f"{proxy.url}{PAGE}calls/{call_id}", headers=bearer, timeout=30)
    row = start.text.split(call_id, 1)[1].split("</tr>", 1)[0]
    assert "ahead" in row and ">0 s<" not in row, row
    assert "ahead of this host" in page.text, page.text.split("<table>", 1)[-1][:1500]
    assert "0 s ago" not in page.text
