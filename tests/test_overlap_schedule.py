"""The overlap scheduler (engine/overlap.py) on CPU: the same tokens as the normal scheduler.

Every case runs the same requests through an engine with and without `overlap_schedule` and
compares token for token, finish reasons included; each step's streamed outputs are collected
(a request's streamed tokens must be its final output: a token computed after its finish is
never emitted) and the memory invariants are checked after every step.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.overlap import OverlapScheduler
from engine.request import FinishReason, Req

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def _engines(model_dir, **kwargs) -> tuple[LLM, LLM]:
    normal = LLM(str(model_dir), overlap_schedule=False, **kwargs)
    overlap = LLM(str(model_dir), overlap_schedule=True, **kwargs)
    assert type(normal.scheduler).__name__ == "Scheduler"
    assert isinstance(overlap.scheduler, OverlapScheduler)
    return normal, overlap


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]


def _run(llm: LLM, prompts, params, abort_at: dict[int, int] | None = None) -> list[Req]:
    """Step until done, checking integrity and the streamed tokens; `abort_at`: {step: index}."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [llm._make_req(p, sp) for p, sp in zip(prompts, plist, strict=True)]
    for req in reqs:
        llm.scheduler.add_request(req)
    streamed: dict[str, list[int]] = {r.rid: [] for r in reqs}
    finished: dict[str, int] = {r.rid: 0 for r in reqs}
    steps = 0
    while llm.scheduler.has_work:
        for out in llm.scheduler.step():
            assert all(t >= 0 for t in out.new_token_ids), "a placeholder was emitted"
            assert out.start == len(streamed[out.req.rid]), "tokens out of order"
            streamed[out.req.rid].extend(out.new_token_ids)
            finished[out.req.rid] += out.finished
        llm.check_integrity()
        steps += 1
        if abort_at and steps in abort_at:
            assert llm.scheduler.abort(reqs[abort_at[steps]].rid) is not None
            llm.check_integrity()
        assert steps < 1000
    for req in reqs:
        assert req.finished and all(t >= 0 for t in req.output_ids)
        if req.finish_reason is not FinishReason.ABORT:
            assert finished[req.rid] == 1 and streamed[req.rid] == req.output_ids
        assert len(req.output_logprobs) == len(req.output_ids)
    assert llm.scheduler.kv.allocator.num_used == 0
    return reqs


def _same(normal: list[Req], overlap: list[Req]) -> None:
    assert [r.output_ids for r in overlap] == [r.output_ids for r in normal]
    assert [r.finish_reason for r in overlap] == [r.finish_reason for r in normal]
    assert [r.finish_detail for r in overlap] == [r.finish_detail for r in normal]


@pytest.mark.parametrize("page_size", [1, 16])
def test_finishes_mid_batch_match_normal_mode(tiny_model_dir, page_size: int) -> None:
    """max_new_tokens of 1..12 and stop tokens finish requests at different steps; the second
    round hits the prefix cache the finished requests left behind."""
    prompts = _prompts(1, [3, 17, 40, 5, 64, 33, 9, 100])
    normal, overlap = _engines(
        tiny_model_dir("llama"), page_size=page_size, chunked_prefill_size=48, max_total_tokens=4096
    )
    reference = _run(normal, prompts, GREEDY)
    params = [
        SamplingParams(max_new_tokens=1 + i, temperature=0.0, ignore_eos=True)
        if i % 2
        else SamplingParams(
            max_new_tokens=12,
            temperature=0.0,
            stop_token_ids=(reference[i].output_ids[2 + i // 2],),
        )
        for i in range(len(prompts))
    ]
    for _ in range(2):
        expected = _run(normal, prompts, params)
        _same(expected, _run(overlap, prompts, params))
    assert any(r.finish_reason is FinishReason.STOP for r in expected)
    assert len({len(r.output_ids) for r in expected}) > 4


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_joining_a_running_batch(tiny_model_dir, page_size: int) -> None:
    """Two requests run at a time: each finish admits a long prompt whose chunks share steps
    with the other request's decoding (mixed prefill + decode batches)."""
    prompts = _prompts(2, [5, 90, 7, 150, 33, 120])
    normal, overlap = _engines(
        tiny_model_dir("llama"),
        page_size=page_size,
        chunked_prefill_size=24,
        max_running_requests=2,
        max_total_tokens=4096,
    )
    params = [
        SamplingParams(max_new_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(6)
    ]
    _same(_run(normal, prompts, params), _run(overlap, prompts, params))


@pytest.mark.parametrize("page_size", [1, 16])
def test_retraction_with_a_small_pool(tiny_model_dir, page_size: int) -> None:
    gen = torch.Generator().manual_seed(9)
    base = torch.randint(1, 256, (48,), generator=gen).tolist()
    prompts = [base[: 16 + 8 * (i % 4)] + [i + 1] * (i % 5 + 1) for i in range(12)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    normal, overlap = _engines(
        tiny_model_dir("llama"), page_size=page_size, chunked_prefill_size=64, max_total_tokens=320
    )
    _same(_run(normal, prompts, params), _run(overlap, prompts, params))
    assert overlap.scheduler.num_retractions > 0


def test_aborts_drop_the_token_in_flight(tiny_model_dir) -> None:
    """Aborted requests keep a prefix of their full output and never stream a token computed
    after the abort; the others are unaffected."""
    prompts = _prompts(3, [9, 30, 12, 50, 4])
    normal, overlap = _engines(
        tiny_model_dir("llama"), page_size=16, chunked_prefill_size=32, max_total_tokens=4096
    )
    full = _run(normal, prompts, GREEDY)
    aborts = {1: 0, 3: 2, 6: 4}  # at step 1 the first request is still prefilling
    reqs = _run(overlap, prompts, GREEDY, abort_at=aborts)
    for i, (req, ref) in enumerate(zip(reqs, full, strict=True)):
        if i in aborts.values():
            assert req.finish_reason is FinishReason.ABORT
            assert req.output_ids == ref.output_ids[: len(req.output_ids)]
            assert len(req.output_ids) < len(ref.output_ids)
        else:
            assert req.output_ids == ref.output_ids


def test_stop_strings_are_checked_on_resolved_tokens(tiny_model_dir) -> None:
    """A stop checker sees only real tokens and ends the request one step later on the host,
    after the next step was launched: the extra token is dropped."""
    prompts = _prompts(4, [8, 20, 13])
    normal, overlap = _engines(tiny_model_dir("llama"), page_size=1, max_total_tokens=4096)
    reference = _run(normal, prompts, GREEDY)
    stops = {tuple(r.output_ids[3:5]) for r in reference}

    def checker(req: Req) -> str | None:
        assert all(t >= 0 for t in req.output_ids)
        return "stop" if tuple(req.output_ids[-2:]) in stops else None

    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, stop=("stop",))
    normal.scheduler.stop_checker = overlap.scheduler.stop_checker = checker
    expected = _run(normal, prompts, params)
    assert all(r.finish_detail == "stop" and len(r.output_ids) <= 5 for r in expected)
    _same(expected, _run(overlap, prompts, params))


def test_host_value_requests_fall_back_and_sampling_matches(tiny_model_dir) -> None:
    """Logprobs and penalties run the normal step while such a request is alive (same
    logprobs); seeded sampling without them overlaps and draws the same tokens."""
    prompts = _prompts(5, [6, 25, 14, 40])
    params = [
        SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, top_logprobs=3),
        SamplingParams(max_new_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_new_tokens=4, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_new_tokens=14, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
    ]
    normal, overlap = _engines(tiny_model_dir("qwen2"), page_size=16, max_total_tokens=4096)
    expected = _run(normal, prompts, params)
    got = _run(overlap, prompts, params)
    _same(expected, got)
    assert got[0].output_top_logprobs == expected[0].output_top_logprobs
    assert got[0].output_logprobs == expected[0].output_logprobs


def test_auto_mode_is_off_on_cpu(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), max_total_tokens=1024)
    assert not llm.config.use_overlap_schedule and not isinstance(llm.scheduler, OverlapScheduler)
    outs = LLM(str(tiny_model_dir("llama")), max_total_tokens=1024, overlap_schedule=True).generate(
        [[1, 2, 3]], GREEDY
    )
    assert outs[0].token_ids == llm.generate([[1, 2, 3]], GREEDY)[0].token_ids


def _stream_through_loop(model_dir, overlap: bool, prompts, params, abort_rid: str):
    """{rid: (streamed tokens, finish reason)} of requests served by an EngineLoop; `abort_rid`
    is aborted from this thread once its third token has streamed."""
    import threading

    from engine.builder import build_engine
    from engine.config import EngineConfig
    from engine.engine_loop import EngineLoop, LoopConfig
    from engine.sampling import RequestSampler
    from tests.loop_output import LoopOutput

    engine = build_engine(EngineConfig(str(model_dir), overlap_schedule=overlap))
    assert isinstance(engine.scheduler, OverlapScheduler) == overlap
    loop = EngineLoop(engine.scheduler, LoopConfig())
    third_token = threading.Event()

    def watch(out: LoopOutput) -> None:
        if len(out.tokens[abort_rid]) >= 3:
            third_token.set()

    output = LoopOutput(loop, watch)
    loop.start()
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, sp in zip(rids, prompts, params, strict=True):
        sampler = RequestSampler(sp, prompt, 256, "cpu")
        loop.submit(Req(rid=rid, prompt_ids=prompt, params=sp, sampler=sampler))
    assert third_token.wait(60)
    assert loop.abort(abort_rid).result(10) is True
    assert output.wait_finished(rids)
    assert loop.call(lambda s: s.check_integrity()).result(10) is None
    loop.stop()
    streams = {}
    for rid in rids:
        tokens, finish = output.tokens[rid], output.finishes[rid]
        assert finish.completion_tokens == len(tokens)
        order = [kind for kind, r in output.events if r == rid]
        assert order[-1] == "finish" and order.count("finish") == 1
        streams[rid] = (tokens, finish.reason)
    return streams


def test_engine_loop_streams_the_same_tokens(tiny_model_dir) -> None:
    """Through the engine thread: streamed tokens and finish events, with and without overlap;
    an abort from another thread ends its request with what was streamed."""
    prompts = _prompts(6, [7, 31, 12, 44, 5, 9])
    params = [
        SamplingParams(max_new_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts) - 1)
    ] + [SamplingParams(max_new_tokens=900, temperature=0.0, ignore_eos=True)]
    model_dir = tiny_model_dir("llama")
    normal = _stream_through_loop(model_dir, False, prompts, params, abort_rid="r5")
    overlap = _stream_through_loop(model_dir, True, prompts, params, abort_rid="r5")
    aborted = overlap.pop("r5"), normal.pop("r5")
    assert overlap == normal
    for tokens, reason in aborted:
        assert reason == "abort" and 3 <= len(tokens) < 900
    short = min(aborted, key=lambda a: len(a[0]))[0]
    assert all(a[0][: len(short)] == short for a in aborted)
