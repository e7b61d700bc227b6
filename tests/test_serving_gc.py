"""A started proxy sets the garbage collector up for serving (ingress/serving.settle_gc)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from effectguard.ingress import serving


@pytest.fixture
def restored_gc() -> Iterator[None]:
    """Give the test process its collector back as it was."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # never called
    raise AssertionError("no request is made")


def test_a_started_server_freezes_startup_objects_and_raises_the_young_threshold(
    restored_gc: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Once the server has started (the start line printed), what startup built is out of
    the collector's way and young collections wait for 10,000 net allocations."""
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    sock = serving.listen_socket("127.0.0.1", 0)
    config = uvicorn.Config(_app, lifespan="off", log_config=None, log_level="warning")
    server = serving._Server(config, "effectguard listening (test)")

    async def start_and_stop() -> None:
        config.load()  # what uvicorn's Server.serve does before its startup
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        assert server.started
        await server.shutdown()

    with sock:
        asyncio.run(start_and_stop())
    assert "effectguard listening (test)" in capsys.readouterr().out
    assert gc.get_threshold() == (serving.GC_YOUNG_THRESHOLD, 10, 10)
    assert gc.get_freeze_count() > 0
