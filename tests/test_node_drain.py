"""`engine.node.server.drain`'s last step, the KV page check, on a stand-in service: an engine
loop too busy to answer in time is said as an unchecked drain (a warning), a failed check as an
error; neither stops the drain."""

from __future__ import annotations

import asyncio
import logging
from typing import cast

import pytest

from engine.node import server
from engine.node.service import NodeService


class StandIn:
    """What `drain` uses of a NodeService: nothing in flight, and a page check."""

    inflight = 0

    def __init__(self, check: str) -> None:
        self.check = check

    def start_draining(self, why: str) -> None:
        """Refuse new requests: none come to a stand-in."""

    async def pages_in_use(self) -> int:
        if self.check == "busy":
            await asyncio.sleep(60)  # the engine loop inside a long step
        if self.check == "broken":
            raise AssertionError("page 7 is free and in use")
        return 0


def _drain(check: str) -> int:
    service = cast(NodeService, StandIn(check))
    return asyncio.run(server.drain(service, 0.1, None, why="a test"))


def test_a_busy_engine_loop_leaves_the_pages_unchecked_not_failed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(server, "ABORT_WAIT_S", 0.2)
    with caplog.at_level(logging.INFO, logger="pdserve.node"):
        assert _drain("busy") == 0
    [record] = [r for r in caplog.records if "pages in use not checked" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_failed_page_check_is_an_error(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pdserve.node"):
        assert _drain("broken") == 0
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "KV integrity check failed" in record.getMessage()
    assert "page 7" in record.getMessage()


def test_a_clean_drain_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pdserve.node"):
        assert _drain("clean") == 0
    assert any("no page in use" in r.getMessage() for r in caplog.records)
