"""The overlap scheduler on a GPU (Triton backend, CUDA graphs, pinned read-back behind an
event): the same tokens as the normal scheduler; skipped without one.

CI has no GPU: these run on the device machine (`pytest tests/test_overlap_gpu.py`). A small
fp32 dummy-weight Llama as in scripts/gpu/run_all.py's engine check (its greedy output does not
depend on the batch it shares a step with, so a finished request riding one more step in the
overlap mode changes nothing); scripts/gpu/engine_step.py checks the bf16 Llama-3-8B shape.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine import LLM, SamplingParams
from engine.overlap import OverlapScheduler
from scripts.tiny_models import SMALL_LLAMA, write_llama_config
from tests.test_overlap_schedule import _run, _same

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs a CUDA GPU and the triton package",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_llama_config(tmp_path_factory.mktemp("small-llama"), SMALL_LLAMA)


def _engines(model_dir, **kwargs) -> tuple[LLM, LLM]:
    common = dict(load_format="dummy", dtype="float32", device="cuda", attention_backend="triton")
    normal = LLM(str(model_dir), overlap_schedule=False, **common, **kwargs)
    overlap = LLM(str(model_dir), **common, **kwargs)  # auto: on for CUDA
    assert isinstance(overlap.scheduler, OverlapScheduler)
    assert not isinstance(normal.scheduler, OverlapScheduler)
    return normal, overlap


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n)
    lengths = [5 + (37 * i) % 300 for i in range(n)]
    return [torch.randint(0, 2048, (k,), generator=gen).tolist() for k in lengths]


@pytest.mark.parametrize("page_size", [1, 16])
def test_finishes_chunks_and_graph_buckets(model_dir, page_size: int) -> None:
    """Max tokens and stop tokens end requests at every step; the decode batch shrinks through
    several graph buckets; chunked prefill joins the running batch."""
    prompts = _prompts(24)
    normal, overlap = _engines(model_dir, page_size=page_size, chunked_prefill_size=256)
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    reference = _run(normal, prompts, greedy)
    params = [
        SamplingParams(
            max_new_tokens=3 + i,
            temperature=0.0,
            stop_token_ids=(reference[i].output_ids[2 + i % 30],) if i % 3 else (),
        )
        for i in range(len(prompts))
    ]
    for _ in range(2):  # the second round hits the prefix cache
        _same(_run(normal, prompts, params), _run(overlap, prompts, params))
    assert len(overlap.runner.graph_runner.graphs) > 2


def test_retraction_and_aborts(model_dir) -> None:
    prompts = _prompts(16)
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    normal, overlap = _engines(
        model_dir, page_size=16, chunked_prefill_size=512, max_total_tokens=1600
    )
    full = _run(normal, prompts, params)
    _same(full, _run(overlap, prompts, params))
    assert overlap.scheduler.num_retractions > 0
    aborts = {5: 3, 20: 7, 30: 11}
    reqs = _run(overlap, prompts, params, abort_at=aborts)
    for i, (req, ref) in enumerate(zip(reqs, full, strict=True)):
        n = len(req.output_ids)
        assert req.output_ids == ref.output_ids[:n] and (n < 48) == (i in aborts.values())


@pytest.mark.parametrize("overlap_schedule", [False, True])
def test_graph_step_prep_gives_the_same_tokens(model_dir, overlap_schedule: bool) -> None:
    """EngineConfig.graph_step_prep (engine/step_prep.py): prep and greedy argmax inside the
    captured graphs, one packed copy per step; the same tokens as today's graphs, through
    several buckets, prefill chunks joining, two seeded sampled requests (the logits path)."""
    prompts = _prompts(24)
    common = dict(load_format="dummy", dtype="float32", device="cuda", attention_backend="triton",
                  page_size=16, chunked_prefill_size=256,
                  overlap_schedule=overlap_schedule)  # fmt: skip
    today = LLM(str(model_dir), **common)
    prep = LLM(str(model_dir), graph_step_prep=True, **common)
    params = [SamplingParams(max_new_tokens=3 + i, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    params[3] = SamplingParams(max_new_tokens=20, temperature=0.7, seed=3, ignore_eos=True)
    params[7] = SamplingParams(max_new_tokens=20, temperature=0.7, seed=7, ignore_eos=True)
    _same(_run(today, prompts, params), _run(prep, prompts, params))
    graphs = prep.runner.graph_runner
    assert graphs is not None and graphs.step_prep and len(graphs.graphs) > 2
