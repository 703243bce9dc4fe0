"""The engine loop's output: one `OutputBatch` per step for all requests, not a message per
request per token (engine/engine_loop.py)."""

from __future__ import annotations

from pathlib import Path

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, LoopConfig
from engine.request import Req
from engine.sampling import RequestSampler, SamplingParams
from tests.loop_output import LoopOutput


def _req(rid: str, prompt: list[int], new_tokens: int, logprobs: bool = False) -> Req:
    params = SamplingParams(
        max_new_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=logprobs
    )
    return Req(rid, prompt, params, RequestSampler(params, prompt, 256, "cpu"))


def test_each_step_emits_one_batch_for_all_its_requests(tiny_model_dir) -> None:
    engine = build_engine(EngineConfig(str(Path(tiny_model_dir("llama"))), max_total_tokens=1024))
    loop = EngineLoop(engine.scheduler, LoopConfig())
    output = LoopOutput(loop)
    rids = ["a", "b", "c", "d"]
    # Queued before the loop starts: one step prefills all four, four more decode them.
    for i, rid in enumerate(rids):
        loop.submit(_req(rid, list(range(5 + i, 15 + i)), 5, logprobs=rid == "b"))
    loop.start()
    try:
        assert output.wait_finished(rids)
    finally:
        loop.stop()
    assert len(output.batches) == 5
    for batch in output.batches:
        assert batch.rids == rids and all(len(ids) == 1 for ids in batch.token_ids)
        assert list(batch.logprobs) == ["b"]  # only the request that asked for them
        assert len(batch.logprobs["b"].logprobs) == 1
    assert [f.rid for f in output.batches[-1].finishes] == rids
    assert not any(b.finishes for b in output.batches[:-1])
    for rid in rids:
        assert output.finishes[rid].completion_tokens == len(output.tokens[rid]) == 5


def test_a_refused_request_ends_in_a_batch_of_its_own(tiny_model_dir) -> None:
    engine = build_engine(EngineConfig(str(Path(tiny_model_dir("llama"))), max_total_tokens=1024))
    loop = EngineLoop(engine.scheduler, LoopConfig())
    output = LoopOutput(loop)
    loop.start()
    try:
        loop.submit(_req("empty", [], 4))
        assert output.wait_finished(["empty"])
    finally:
        loop.stop()
    finish = output.finishes["empty"]
    assert finish.reason == "abort" and "empty" in finish.detail
    assert output.tokens["empty"] == []
