"""An idle engine loop's wait between steps (`NodeRole.poll_pause_s`).

A prefill node's KV writes in flight are seen ending only by a poll: its loop waits at most the
role's pause between two steps (a pause that grows with the writes' age, so that the last
write of a room is noticed soon after it lands), and a wakeup (a message, or a transfer engine
that says a write ended) ends the wait at once. With nothing to poll the loop must not spin.
Real loop, scheduler and model; a role that only counts its steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, LoopConfig
from engine.request import Req
from engine.scheduler import Scheduler, StepOutput
from tests.loop_output import LoopOutput


class PollingRole:
    """Counts the loop's steps; `pause` is what it answers as its poll pause."""

    def __init__(self) -> None:
        self.pause: float | None = None
        self.steps = 0
        self.stepped = threading.Condition()
        self.wake: Callable[[], None] = lambda: None
        self.layer_stream = None
        self.closed = threading.Event()

    @property
    def has_work(self) -> bool:
        return False

    @property
    def poll_pause_s(self) -> float | None:
        return self.pause

    def bind_wakeup(self, wake: Callable[[], None]) -> None:
        self.wake = wake

    def accepts(self, req: Req) -> bool:
        return False

    def submit(self, scheduler: Scheduler, req: Req) -> None:
        raise AssertionError("accepts nothing")

    def before_step(self, scheduler: Scheduler) -> list[StepOutput]:
        with self.stepped:
            self.steps += 1
            self.stepped.notify_all()
        return []

    def after_step(self, scheduler: Scheduler) -> list[StepOutput]:
        return []

    def during_forward(self, scheduler: Scheduler) -> list[StepOutput]:
        return []

    def abort(self, scheduler: Scheduler, rid: str) -> Req | None:
        return None

    def queue_summary(self) -> str:
        return ""

    def close(self) -> None:
        self.closed.set()

    def wait_steps(self, count: int, timeout_s: float) -> bool:
        """Whether `count` more steps ran within `timeout_s`."""
        with self.stepped:
            target = self.steps + count
            return self.stepped.wait_for(lambda: self.steps >= target, timeout_s)


@pytest.fixture
def loop(tiny_model_dir) -> Iterator[EngineLoop]:
    engine = build_engine(EngineConfig(str(Path(tiny_model_dir("llama"))), max_total_tokens=256))
    loop = EngineLoop(engine.scheduler, LoopConfig(idle_poll_s=0.05), role=PollingRole())  # type: ignore[arg-type]
    LoopOutput(loop)
    loop.start()
    yield loop
    loop.stop()
    assert loop.fatal_error is None


@pytest.fixture
def role(loop: EngineLoop) -> PollingRole:
    return loop.role  # type: ignore[return-value]


def test_nothing_to_poll_waits_for_a_command(role: PollingRole) -> None:
    role.wait_steps(1, 5)
    before = role.steps
    time.sleep(0.5)
    # idle_poll_s 0.05: ~10 turns in 0.5 s to check timeouts; a spinning loop makes thousands
    assert role.steps - before <= 30


def test_writes_in_flight_are_polled_at_the_roles_pace(role: PollingRole) -> None:
    role.pause = 0.002
    role.wake()  # end the current idle wait (up to idle_poll_s)
    assert role.wait_steps(50, timeout_s=10)  # ~0.1 s at 2 ms a turn; not idle_poll_s each


def test_a_wakeup_ends_a_long_pause(role: PollingRole) -> None:
    role.pause = 30.0
    role.wake()
    role.wait_steps(1, 5)  # now waiting its 30 s pause
    role.wake()  # e.g. Mooncake's waiter: a write ended
    assert role.wait_steps(1, timeout_s=5)


def test_a_replaced_role_and_the_last_one_are_closed(loop: EngineLoop) -> None:
    """A role's threads (a prefill role's group poster) stop when a switch replaces it, and the
    role bound when the loop ends is closed too."""
    first, second = loop.role, PollingRole()
    loop.replace_role(second).result(timeout=10)  # type: ignore[arg-type]
    assert first.closed.wait(5) and not second.closed.is_set()  # type: ignore[union-attr]
    loop.stop()
    assert second.closed.is_set()
