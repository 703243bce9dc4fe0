"""A node role's `during_forward`: work answered while a step's forward runs, not after it.

A prefill node reports finished KV writes from there (prefill_node/prefill_role.py); with a
multi-second prefill step on a CPU, waiting for the step's end held every hand-off up to one
step. This drives the real loop, scheduler and model with a role that finishes a request of its
own from inside a forward.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from engine.builder import Engine, build_engine
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, LoopConfig
from engine.request import FinishReason, Req
from engine.sampling import RequestSampler, SamplingParams
from engine.scheduler import Scheduler, StepOutput
from tests.loop_output import LoopOutput


class InterludeRole:
    """Holds the requests it accepts (`held`) and finishes them from `during_forward`."""

    def __init__(self) -> None:
        self.held: list[Req] = []
        self.calls_in_step: list[bool] = []  # per call: did a step's forward run?
        self.loop: EngineLoop | None = None
        self.layer_stream = None  # no KV streamed by layer group

    @property
    def has_work(self) -> bool:
        return bool(self.held)

    @property
    def poll_pause_s(self) -> float | None:
        return None

    def bind_wakeup(self, wake: Callable[[], None]) -> None:
        pass

    def accepts(self, req: Req) -> bool:
        return req.rid.startswith("held")

    def submit(self, scheduler: Scheduler, req: Req) -> None:
        self.held.append(req)

    def before_step(self, scheduler: Scheduler) -> list[StepOutput]:
        return []

    def after_step(self, scheduler: Scheduler) -> list[StepOutput]:
        return []

    def during_forward(self, scheduler: Scheduler) -> list[StepOutput]:
        assert self.loop is not None
        self.calls_in_step.append(self.loop._step_started is not None)
        done, self.held = self.held, []
        for req in done:
            req.finish_reason = FinishReason.PREFILLED
        return [StepOutput(req, [], True) for req in done]

    def abort(self, scheduler: Scheduler, rid: str) -> Req | None:
        return None

    def queue_summary(self) -> str:
        return ""

    def close(self) -> None:
        pass


def _req(rid: str, prompt_len: int) -> Req:
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    prompt = list(range(5, 5 + prompt_len))
    return Req(rid, prompt, params, RequestSampler(params, prompt, 256, "cpu"))


def _engine(tiny_model_dir) -> Engine:  # type: ignore[no-untyped-def]
    return build_engine(EngineConfig(str(Path(tiny_model_dir("llama"))), max_total_tokens=1024))


def _run_until_computed(
    engine: Engine, interlude_s: float, reqs: list[Req]
) -> tuple[InterludeRole, LoopOutput]:
    """Queues `reqs` before the loop starts, runs it until the request "computed" finished."""
    role = InterludeRole()
    loop = EngineLoop(engine.scheduler, LoopConfig(interlude_s=interlude_s), role=role)
    role.loop = loop
    output = LoopOutput(loop)
    for req in reqs:
        loop.submit(req)
    loop.start()
    try:
        assert output.wait_finished(["computed"])
    finally:
        loop.stop()
    return role, output


def test_a_role_finishes_a_request_from_inside_a_forward(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir)
    # Both are queued before the loop starts: the first step computes one and holds the other.
    role, output = _run_until_computed(engine, 0.0, [_req("held", 8), _req("computed", 40)])
    layers = engine.scheduler.runner.model_config.num_layers
    assert len(role.calls_in_step) == layers  # once per layer of the one forward, interval 0
    assert all(role.calls_in_step)
    # The held request finished before the step that ran during its answer produced a token.
    assert output.events == [("finish", "held"), ("tokens", "computed"), ("finish", "computed")]
    assert len(output.batches) == 2  # the interlude's hand-off, then the step's output


def test_a_role_is_called_at_most_every_interlude_interval(tiny_model_dir) -> None:
    role, _ = _run_until_computed(_engine(tiny_model_dir), 3600.0, [_req("computed", 40)])
    assert len(role.calls_in_step) == 1  # the first layer; the rest fall inside the hour


def test_a_tensor_parallel_node_gets_no_interlude(tiny_model_dir) -> None:
    """Rank 0 of a TP node calls the interlude while its other ranks wait in the layer's
    all-reduce; a TP prefill node's poll broadcasts to them (engine/node/tp_transfer.py), so the
    two would wait for each other until gloo's timeout (seen: `make test-tp`, PD 3->1). The
    TP engine itself is covered by tests/test_tp_disagg.py; here only the rule."""
    engine = _engine(tiny_model_dir)
    runner = engine.scheduler.runner
    runner.group = SimpleNamespace(size=2)  # type: ignore[assignment]  # rank 0 of two
    EngineLoop(engine.scheduler, LoopConfig(), role=InterludeRole())
    assert runner.interlude is None
    runner.group = SimpleNamespace(size=1)  # type: ignore[assignment]
    EngineLoop(engine.scheduler, LoopConfig(), role=InterludeRole())
    assert runner.interlude is not None
