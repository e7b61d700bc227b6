"""The operator page and a call in flight whose worker is gone, as the CLI sees it.

A running ``serve`` takes dead workers over in its sweeper, but until that sweep runs
(another replica killed a moment ago, a worker of another host whose lease just lapsed)
a dead worker's call is still ``in_flight``. The page said "next operation wait" and
offered no decision for it: an operator was told to wait for a process that is gone.
It now names the gone owner as ``show`` does, offers the decision, and a decision posted
takes the worker over first, exactly as ``effectguard reconcile`` does: decided at once
when the process is proved gone, only taken over (409, nothing decided) when the owner
is gone by its lease alone and may still receive the provider's answer.

Here the page's ``serve`` sweeps once an hour, so only the page can take the worker over.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import html
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from operatorkit import ADMIN_KEY, ADMIN_NAME, PAGE, config_text
from test_dead_owner import call_under_way
from test_reconcile_auto import SEND, crash, email, upstreams
from toolkit import cli_json as cli

from effectguard.ledger import Ledger, Writer, operations
from effectguard.testing import FakeProvider, Proxy, fake_provider, running_proxy

pytestmark = pytest.mark.slow

BEARER = {"authorization": f"Bearer {ADMIN_KEY}"}


@contextlib.contextmanager
def page_serve(tmp_path: Path, fake: FakeProvider) -> Iterator[Proxy]:
    """A ``serve`` with the operator page on ``tmp_path/ledger.db`` whose sweeper runs
    at its start only (an hour apart): a worker that dies later stays untaken by it."""
    config = tmp_path / "page.toml"
    config.write_text(config_text(extra="[server]\nsweep_s = 3600\n"))
    with running_proxy(
        tmp_path / "ledger.db", upstreams=upstreams(fake), args=["--config", str(config)]
    ) as proxy:
        yield proxy


def call_page(proxy: Proxy, call_id: str) -> str:
    """The call's page, its text unescaped."""
    response = httpx.get(f"{proxy.url}{PAGE}calls/{call_id}", headers=BEARER)
    assert response.status_code == 200, response.text
    return html.unescape(response.text)


def decide(proxy: Proxy, call_id: str, page: str) -> httpx.Response:
    """Post the page's not-applied form as the browser would (its hidden fields too)."""
    form = re.search(r'<form[^>]*id="reconcile-not_applied".*?</form>', page, re.S)
    assert form, "no not-applied form on the call's page"
    hidden = re.findall(r'type="hidden" name="(\w+)" value="([^"]*)"', form[0])
    data = dict(hidden) | {"note": "nothing at the provider"}
    url = f"{proxy.url}{PAGE}calls/{call_id}/reconcile"
    return httpx.post(url, data=data, headers=BEARER)


def test_a_dead_replicas_call_is_decided_from_the_page(tmp_path: Path) -> None:
    """Another ``serve`` on the ledger killed mid-call: the page names its gone owner and
    offers the decision; the decision takes the worker over and is recorded at once."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        page_serve(tmp_path, fake) as proxy,
    ):
        crash(ledger, fake, "after:dispatch", SEND, email("a@x"), {"Idempotency-Key": "a"})
        (call,) = cli("calls", *where, "--state", "in_flight")
        page = call_page(proxy, call["call_id"])
        assert "reconcile (owner gone: process gone)" in page, page
        assert "is gone (process gone)" in page
        decided = decide(proxy, call["call_id"], page)
        assert decided.status_code == 303, decided.text
        shown = cli("show", call["call_id"], *where)
        assert shown["stage"] == "reconciled_not_applied", shown
        kinds = [e["kind"] for e in shown["events"]]
        assert kinds.index("attempt.interrupted") < kinds.index("call.reconciled"), kinds
        (note,) = [e["data"] for e in shown["events"] if e["kind"] == "call.reconciled"]
        assert note["by"] == ADMIN_NAME
        assert cli("verify", *where)["ok"] is True


def test_an_owner_gone_by_its_lease_is_taken_over_from_the_page_but_not_decided(
    tmp_path: Path,
) -> None:
    """An owner whose lock this host cannot see (another host's: here its lock file is
    removed) is gone once its lease lapses: the first decision takes it over and answers
    409 with nothing decided (it may still receive the provider's answer), as does the
    form shown before the takeover; a decision from the page as it now stands decides."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    short = tmp_path / "short.toml"
    short.write_text("[server]\nlease_s = 2\nheartbeat_s = 0.5\n")
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        page_serve(tmp_path, fake) as proxy,
    ):
        crash(ledger, fake, "after:dispatch", SEND, email("b@x"), args=("--config", str(short)))
        for lock in Path(f"{ledger}.workers").glob("*.lock"):
            if _free(lock):
                lock.unlink()
        (call,) = cli("calls", *where, "--state", "in_flight")
        call_id = call["call_id"]
        deadline = time.monotonic() + 20
        page = call_page(proxy, call_id)
        while "owner gone" not in page and time.monotonic() < deadline:
            assert "Nothing to decide" in page  # alive by its lease: wait, no forms
            time.sleep(0.5)
            page = call_page(proxy, call_id)
        assert "reconcile (owner gone: lease expired)" in page, page
        first = decide(proxy, call_id, page)
        assert first.status_code == 409, first.text
        assert "nothing was decided" in html.unescape(first.text)
        assert cli("show", call_id, *where)["stage"] == "effect_unknown"
        # The same form once more (a second operator's, or a resubmit): the page said the
        # decision records nothing else, and the call was taken over since it was shown.
        stale = decide(proxy, call_id, page)
        assert stale.status_code == 409, stale.text
        assert cli("show", call_id, *where)["stage"] == "effect_unknown"
        again = decide(proxy, call_id, call_page(proxy, call_id))
        assert again.status_code == 303, again.text
        assert cli("show", call_id, *where)["stage"] == "reconciled_not_applied"
        assert cli("verify", *where)["ok"] is True


def _free(lock: Path) -> bool:
    """Whether nobody holds ``lock`` (the page's own serve holds its own)."""
    with lock.open("ab") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


def test_a_live_owners_call_is_not_taken_over_from_the_page(tmp_path: Path) -> None:
    """While another ``serve`` works on the call, the page says wait and offers nothing,
    and a decision posted anyway is refused (409) with nothing written."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        page_serve(tmp_path, fake) as proxy,
        call_under_way(ledger, fake, "d@x", {"x-fake-delay": "4"}) as call,
    ):
        before = cli("show", call.call_id, *where)["events"]
        page = call_page(proxy, call.call_id)
        assert "next operation wait" in " ".join(re.sub(r"<[^>]+>", " ", page).split())
        assert "owner gone" not in page and 'id="reconcile-not_applied"' not in page
        data = {"decision": "not_applied", "note": "n", "attempt": "1"}
        url = f"{proxy.url}{PAGE}calls/{call.call_id}/reconcile"
        refused = httpx.post(url, data=data, headers=BEARER)
        assert refused.status_code == 409, refused.text
        assert cli("show", call.call_id, *where)["events"] == before
        call.client.join(30)
        assert call.answers and call.answers[0].status_code == 200, call.answers
        assert cli("show", call.call_id, *where)["stage"] == "completed"
        assert len(fake.effects()) == 1


def test_the_start_page_lists_calls_whose_worker_is_gone_but_not_a_live_ones(
    tmp_path: Path,
) -> None:
    """A dead replica's call in flight is on the start page, with why its owner is gone and
    a link to its page, before any sweep; a call a live ``serve`` is working on is not."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        page_serve(tmp_path, fake) as proxy,
    ):
        # The live call first: a replica started later would take the dead one over.
        with call_under_way(ledger, fake, "f@x", {"x-fake-delay": "4"}) as live:
            crash(ledger, fake, "after:dispatch", SEND, email("e@x"), {"Idempotency-Key": "e"})
            (dead,) = [
                c
                for c in cli("calls", *where, "--state", "in_flight")
                if c["call_id"] != live.call_id
            ]
            response = httpx.get(f"{proxy.url}{PAGE}", headers=BEARER)
            assert response.status_code == 200, response.text
            start = html.unescape(response.text)
            live.client.join(30)
        assert "In flight, worker gone" in start, start
        row = re.search(rf'<tr>(?:(?!</tr>).)*calls/{dead["call_id"]}".*?</tr>', start, re.S)
        assert row, start
        assert "process gone" in row[0]
        assert live.call_id not in start
        assert cli("show", dead["call_id"], *where)["stage"] == "in_flight"  # only listed


async def _fence_only(ledger: Path, worker: str) -> None:
    """Take ``worker`` over as a sweep whose one transaction failed, and then each call's
    own marking too, leaves it: fenced (``worker.taken_over``), its calls still in flight."""
    async with Ledger.open(str(ledger)) as opened:
        fencer = await opened.store.write(
            Writer("boot", 0),
            lambda tx: operations.register_worker(
                tx, worker="test-fencer", host="elsewhere", pid=1, lease_s=3600
            ),
        )
        await opened.store.write(
            fencer,
            lambda tx: operations.sweep(tx, fencer, frozenset({worker}), interrupt_calls=False),
        )


def test_a_fenced_workers_call_left_in_flight_is_listed_and_decided_from_the_page(
    tmp_path: Path,
) -> None:
    """A dead replica taken over by a sweep that could not mark its call (fenced, the call
    still in flight, no sweep since): the start page lists the call (owner ``taken
    over``), its page offers the decision, and the decision takes the call over and is
    recorded. Before, the start page read only the workers not fenced: the call was not
    listed anywhere an operator looks until a sweep, up to ``sweep_s`` later."""
    ledger = tmp_path / "ledger.db"
    where = ("--ledger", str(ledger))
    with (
        fake_provider(tmp_path / "receipts.jsonl", idempotent=True) as fake,
        page_serve(tmp_path, fake) as proxy,
    ):
        crash(ledger, fake, "after:dispatch", SEND, email("g@x"), {"Idempotency-Key": "g"})
        (call,) = cli("calls", *where, "--state", "in_flight")
        call_id = call["call_id"]
        events = cli("show", call_id, *where)["events"]
        (owner,) = [e["data"]["worker"] for e in events if e["kind"] == "attempt.started"]
        asyncio.run(_fence_only(ledger, owner))
        assert cli("show", call_id, *where)["stage"] == "in_flight"
        response = httpx.get(f"{proxy.url}{PAGE}", headers=BEARER)
        assert response.status_code == 200, response.text
        start = html.unescape(response.text)
        assert "In flight, worker gone" in start, start
        row = re.search(rf'<tr>(?:(?!</tr>).)*calls/{call_id}".*?</tr>', start, re.S)
        assert row and "taken over" in row[0], start
        page = call_page(proxy, call_id)
        assert "reconcile (owner gone: taken over)" in page, page
        decided = decide(proxy, call_id, page)
        assert decided.status_code == 303, decided.text
        shown = cli("show", call_id, *where)
        assert shown["stage"] == "reconciled_not_applied", shown
        kinds = [e["kind"] for e in shown["events"]]
        assert kinds.index("attempt.interrupted") < kinds.index("call.reconciled"), kinds
        assert len(fake.effects()) == 1  # decided, never sent again
        assert cli("verify", *where)["ok"] is True
