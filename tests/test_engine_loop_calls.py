"""EngineLoop.call: work handed to the engine thread by the node's RPC handlers.

A handler awaits the call's future; when its RPC passes the client's deadline, gRPC cancels the
handler and with it the future. The soak test (scripts/soak.py) found that the engine thread then
died setting the result of the cancelled future (InvalidStateError), and the node exited: a
GetLoad with a 5 s deadline during a long prefill step killed a decode node. The loop must run
the call, drop its answer, and keep serving.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, LoopConfig
from engine.request import Req
from engine.sampling import RequestSampler, SamplingParams
from tests.loop_output import LoopOutput


@pytest.fixture
def loop(tiny_model_dir, monkeypatch: pytest.MonkeyPatch):
    exits: list[int] = []

    def no_exit(code: int) -> None:  # a crashed loop would end the test process
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", no_exit)
    engine = build_engine(EngineConfig(model_path=str(Path(tiny_model_dir("llama")))))
    loop = EngineLoop(engine.scheduler, LoopConfig())
    loop.start()
    yield loop
    loop.stop()
    assert not exits, f"the engine loop exited with {exits}"


def test_a_call_whose_caller_gave_up_does_not_kill_the_loop(loop: EngineLoop) -> None:
    release = threading.Event()
    busy = loop.call(lambda s: release.wait(10))  # the engine thread is in a long step
    ran = threading.Event()
    abandoned = loop.call(lambda s: ran.set())
    assert abandoned.cancel()  # the RPC's deadline passed while it waited
    release.set()
    assert busy.result(10) is True
    assert loop.call(lambda s: "still serving").result(10) == "still serving"
    assert ran.is_set()  # the abandoned call ran anyway (an abort must still happen)
    assert loop.fatal_error is None


def test_a_failing_call_whose_caller_gave_up_is_logged(
    loop: EngineLoop, caplog: pytest.LogCaptureFixture
) -> None:
    release = threading.Event()
    loop.call(lambda s: release.wait(10))

    def fail(scheduler: object) -> None:
        raise RuntimeError("broken admin call")

    abandoned = loop.call(fail)
    assert abandoned.cancel()
    release.set()
    assert loop.call(lambda s: 1).result(10) == 1
    assert "broken admin call" in caplog.text
    assert loop.fatal_error is None


def test_a_request_queued_behind_a_long_step_counts_its_wait(loop: EngineLoop) -> None:
    """`arrived` is when the node got the request, not when the engine thread took it: the
    time it waited for a step to end is queueing (timelines showed it as transfer time)."""
    release = threading.Event()
    loop.call(lambda s: release.wait(10))  # the engine thread is in a long step
    output = LoopOutput(loop)
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    prompt = list(range(5, 25))
    loop.submit(Req("r", prompt, params, RequestSampler(params, prompt, 256, "cpu")))
    time.sleep(0.3)
    release.set()
    assert output.wait_finished(["r"], 30)
    finish = output.finishes["r"]
    assert finish.timing is not None
    assert finish.timing.span("arrived", "scheduled") >= 0.3
