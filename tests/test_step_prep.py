"""Step preparation inside the decode graph (engine/step_prep.py), checked on the CPU.

The graph needs CUDA; what it runs is plain torch, so these tests run it eagerly:
- `derive_decode_step` against the batch `ModelRunner.build_batch` builds on the host: the same
  positions, KV locations, req_to_token entries, input ids (future-token placeholders
  included) and Triton decode plan, padding rows harmless (read through the pad slot, write
  location 0, table write in the scratch column);
- the greedy-in-graph eligibility against `sample_tokens`' argmax fast path;
- whole engines (normal and overlap scheduler) whose `DecodeGraphRunner` records a step instead
  of capturing it (`EagerGraphRunner`): the step-prep path, graph argmax and future-token buffer
  included, gives the eager engine's tokens one for one, with the memory invariants checked.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graph import DecodeGraphRunner, _Graph
from engine.request import Req
from engine.sampling import is_plain_argmax, sample_tokens
from engine.scheduler import graph_samples
from engine.step_prep import (
    PACKED_ROWS,
    PackedDecodeStep,
    derive_decode_step,
    greedy_tokens,
    pack_decode_step,
)


class _EagerGraph:
    """Stands in for a captured graph: `replay` runs the recorded step again."""

    def __init__(self, run) -> None:  # type: ignore[no-untyped-def]
        self.run = run
        self.replays = 0

    def replay(self) -> None:
        self.run()
        self.replays += 1


class EagerGraphRunner(DecodeGraphRunner):
    """`DecodeGraphRunner` on the CPU: the step function runs at every replay, uncaptured. Its
    logits are written into the first run's tensor, as a replay would."""

    def _record(self, batch, run):  # type: ignore[no-untyped-def]
        logits = run()

        def again() -> None:
            logits.copy_(run())

        return _Graph(_EagerGraph(again), batch, logits)  # type: ignore[arg-type]


def _engine(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), attention_backend="triton", page_size=4,
               max_total_tokens=2048, chunked_prefill_size=64, **kwargs)  # fmt: skip


def _prefilled(llm: LLM, lengths: list[int]) -> list[Req]:
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
    reqs = [llm._make_req(torch.randint(1, 256, (n,), generator=gen).tolist(), params)
            for n in lengths]  # fmt: skip
    for req in reqs:
        llm.scheduler.add_request(req)
    while any(not r.output_ids for r in reqs):
        llm.scheduler.step()
    return reqs


@pytest.mark.parametrize("placeholders", [False, True])
def test_derived_inputs_match_host_built_batch(tiny_model_dir, placeholders: bool) -> None:
    llm = _engine(tiny_model_dir("llama"), overlap_schedule=False)
    runner, kv = llm.runner, llm.scheduler.kv
    reqs = _prefilled(llm, [5, 12, 3, 9, 30])[::-1]  # slots out of order
    for _ in range(3):  # a few decode steps: some requests cross a page boundary
        llm.scheduler.step()
    future = None
    if placeholders:  # as the overlap scheduler leaves them: row j of the step in flight
        future = torch.tensor([7, 11, 13, 17, 19], dtype=torch.int64)
        for j, req in enumerate(reqs[:3]):
            req.output_ids[-1] = -1 - (j + 1)
    assert kv.reserve_decodes(reqs)
    table = runner.req_to_token.table
    table_before, pending = table.clone(), dict(kv._pending)

    batch = runner.build_batch(reqs, [1] * len(reqs), future)  # the host-built reference
    table_ref = table.clone()
    table.copy_(table_before)
    kv._pending = pending
    step = runner._packed_step(reqs, future)
    assert isinstance(step, PackedDecodeStep) and not kv._pending

    bucket, pad_slot, size = 8, 0, len(reqs)
    packed = torch.empty(PACKED_ROWS, bucket, dtype=torch.int64)
    pack_decode_step(step, bucket, pad_slot, packed)
    future_buf = torch.zeros(16, dtype=torch.int64)
    if future is not None:
        future_buf[: future.shape[0]] = future
    inputs = derive_decode_step(packed, table, future_buf)

    assert torch.equal(inputs.input_ids[:size], batch.input_ids)
    assert torch.equal(inputs.positions[:size], batch.positions)
    assert torch.equal(inputs.out_cache_loc[:size], batch.out_cache_loc)
    assert torch.equal(table[:, :-1], table_ref[:, :-1]), "req_to_token differs"
    plan = batch.attn_metadata.decode
    assert torch.equal(inputs.slots[:size], plan.slots)
    assert torch.equal(inputs.seq_lens[:size], plan.seq_lens)
    if placeholders:
        assert inputs.input_ids[:3].tolist() == [11, 13, 17]
    # Padding rows: one key through the pad slot, position 0, K/V to the scratch location 0,
    # their table write in the last column (never a request's position).
    assert inputs.slots[size:].tolist() == [pad_slot] * (bucket - size)
    assert inputs.seq_lens[size:].tolist() == [1] * (bucket - size)
    assert inputs.positions[size:].tolist() == [0] * (bucket - size)
    assert inputs.out_cache_loc[size:].tolist() == [0] * (bucket - size)
    assert table[pad_slot, -1] == 0
    assert runner.req_to_token.max_context - 1 >= runner.context_length


def test_entries_stay_queued_when_the_backend_plan_reads_the_table(tiny_model_dir) -> None:
    """FlashInfer's host-side plan gathers page ids from req_to_token before the replay: the
    step's new entries are then flushed as usual (the graph writes the same values again)."""
    llm = _engine(tiny_model_dir("llama"), overlap_schedule=False)
    runner, kv = llm.runner, llm.scheduler.kv
    reqs = _prefilled(llm, [4, 8, 7])  # page size 4: two next tokens open a new page
    assert kv.reserve_decodes(reqs)
    expected = {
        (r.slot, r.kv_len): loc
        for (r, loc) in zip(reqs, kv.decode_locations(reqs, False), strict=True)
    }
    runner.attn_backend.plan_reads_table = True  # type: ignore[misc]
    step = runner._packed_step(reqs, None)
    assert not kv._pending
    table = runner.req_to_token.table
    assert {(s, p): int(table[s, p]) for (s, p) in expected} == expected
    assert step.out_cache_locs == list(expected.values())


def test_pack_rejects_a_step_larger_than_its_bucket() -> None:
    step = PackedDecodeStep([1, 2, 3], [0, 1, 2], [4, 4, 4], [8, 9, 10])
    with pytest.raises(ValueError, match="does not fit the bucket 2"):
        pack_decode_step(step, 2, 0, torch.empty(PACKED_ROWS, 2, dtype=torch.int64))


def _samplers(llm: LLM, params: list[SamplingParams]):  # type: ignore[no-untyped-def]
    return [llm.scheduler.new_sampler(p, [1, 2, 3]) for p in params]


CASES = {
    "greedy": [SamplingParams(temperature=0.0)] * 3,
    "top_k 1": [SamplingParams(temperature=0.8, top_k=1), SamplingParams(temperature=0.0)],
    "one sampled row": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=1)],
    "repetition penalty": [SamplingParams(temperature=0.0, repetition_penalty=1.3)],
    "presence penalty": [SamplingParams(temperature=0.0), SamplingParams(presence_penalty=0.5)],
    "logprobs": [SamplingParams(temperature=0.0, logprobs=True)],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_graph_argmax_eligibility_matches_sample_tokens_fast_path(
    tiny_model_dir, monkeypatch, case: str
) -> None:
    import engine.sampling as sampling

    llm = _engine(tiny_model_dir("llama"))
    samplers = _samplers(llm, CASES[case])
    took_slow_path = []
    real = sampling._sample_processed

    def spy(logits, samplers_):  # type: ignore[no-untyped-def]
        took_slow_path.append(True)
        return real(logits, samplers_)

    monkeypatch.setattr(sampling, "_sample_processed", spy)
    logits = torch.randn(len(samplers), samplers[0].vocab_size)
    logits[:, 5] = logits[:, 9] = logits.max() + 1  # a tie: the first index wins
    chosen = sample_tokens(logits, samplers)
    assert is_plain_argmax(samplers) == (not took_slow_path)
    if is_plain_argmax(samplers):
        assert torch.equal(greedy_tokens(logits), chosen)
        assert chosen.tolist() == [5] * len(samplers)
    # The scheduler's test adds what the graph cannot give: logprobs.
    reqs = [Req(rid=str(i), prompt_ids=[1, 2, 3], params=p, sampler=s)
            for i, (p, s) in enumerate(zip(CASES[case], samplers, strict=True))]  # fmt: skip
    step = PackedDecodeStep([1] * len(reqs), list(range(len(reqs))), [4] * len(reqs), [0] * 3)
    rows = list(range(len(reqs)))
    expected = is_plain_argmax(samplers) and case != "logprobs"
    assert graph_samples(step, reqs, rows) == expected
    assert not graph_samples(step, reqs, rows[:-1])  # a row that does not sample yet


def _generate(llm: LLM, prompts, params) -> list[list[int]]:  # type: ignore[no-untyped-def]
    outputs = []
    reqs = [llm._make_req(p, sp) for p, sp in zip(prompts, params, strict=True)]
    for req in reqs:
        llm.scheduler.add_request(req)
    while llm.scheduler.has_work:
        llm.scheduler.step()
        llm.check_integrity()
    for req in reqs:
        outputs.append(list(req.output_ids))
    return outputs


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_with_step_prep_graphs_matches_eager(tiny_model_dir, overlap: bool) -> None:
    """Decode batches shrink through several buckets (finishes at different steps) and mix
    with prefill chunks (eager steps whose tokens the next graph step reads); two requests
    sample (seeded), so some steps take the logits path."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist()
               for n in (3, 17, 40, 5, 64, 33, 9, 100, 21)]  # fmt: skip
    params = [SamplingParams(max_new_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    sampled = [SamplingParams(max_new_tokens=6, temperature=0.8, seed=i, ignore_eos=True)
               for i in range(2)]  # fmt: skip
    reference = _engine(tiny_model_dir("llama"), overlap_schedule=overlap)
    expected = _generate(reference, prompts, params)
    expected_sampled = _generate(reference, prompts[:2], sampled)

    llm = _engine(tiny_model_dir("llama"), overlap_schedule=overlap, graph_step_prep=True)
    runner = llm.runner
    graphs = EagerGraphRunner(runner.model, runner.context_length, pad_slot=0,
                              buckets=(1, 2, 4, 8, 16), step_prep=True)  # fmt: skip
    runner.graph_runner = graphs
    calls = {"tokens": 0}
    real = runner.forward_tokens

    def counted(step):  # type: ignore[no-untyped-def]
        calls["tokens"] += 1
        return real(step)

    runner.forward_tokens = counted  # type: ignore[method-assign]
    assert _generate(llm, prompts, params) == expected
    assert calls["tokens"] > 10, "the greedy steps did not take their tokens from the graph"
    assert len(graphs.graphs) >= 3
    before = calls["tokens"]
    assert _generate(llm, prompts[:2], sampled) == expected_sampled
    assert calls["tokens"] == before, "sampled rows must take the logits path"
    assert llm.scheduler.kv.allocator.num_used == 0
