"""The FlashInfer backend's kernels on a GPU against torch-native; skipped without a GPU and
flashinfer (CI has neither: scripts/gpu/check_flashinfer.py runs this and more on the device
machine, with the wheels scripts/gpu/flashinfer_wheels.py carries)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.attention.flashinfer_backend import FlashInferBackend
from engine.attention.torch_native import TorchNativeBackend
from tests.test_triton_reference import make_case, run_backend

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="needs a CUDA GPU and flashinfer-python (pip install pdserve[gpu])",
)

CASES = {
    "decode": ([5, 150, 0, 63, 64, 2047], [1] * 6),
    "extend": ([0, 0, 13, 40, 77], [7, 7, 20, 1, 300]),
}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_kernels_match_torch_native(kind: str, page_size: int) -> None:
    prefix, ext = CASES[kind]
    case = make_case(page_size, prefix, ext, num_kv_heads=2, group=4, head_dim=128,
                     device="cuda", dtype=torch.bfloat16)  # fmt: skip
    ref_outs, ref_cache = run_backend(TorchNativeBackend, *case)
    outs, new_cache = run_backend(FlashInferBackend, *case)
    assert torch.equal(new_cache, ref_cache)
    for out, ref in zip(outs, ref_outs, strict=True):
        assert torch.isfinite(out).all()
        err = (out.float() - ref.float()).norm() / ref.float().norm()
        assert err < 2e-2


@pytest.mark.parametrize("overlap_schedule", [False, True])
def test_graph_step_prep_gives_the_same_tokens(tmp_path, overlap_schedule: bool) -> None:
    """EngineConfig.graph_step_prep with FlashInfer (its plan stays on the host, the rest of
    the step's prep and the greedy argmax run in the graph): today's graphs' tokens, through
    several buckets, requests opening new pages as they decode."""
    from engine import LLM, SamplingParams
    from scripts.tiny_models import llama_config, write_llama_config

    # Head dim 128 (SMALL_LLAMA's 32 is not one of FlashInfer's prefill configurations).
    config = llama_config(hidden_size=512, num_attention_heads=4, num_key_value_heads=2)
    model_dir = write_llama_config(tmp_path / "small-llama", config)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2048, (5 + 29 * i,), generator=gen).tolist() for i in range(12)]
    params = [SamplingParams(max_new_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    outs = []
    for step_prep in (False, True):
        llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda",
                  attention_backend="flashinfer", page_size=16, chunked_prefill_size=256,
                  overlap_schedule=overlap_schedule, graph_step_prep=step_prep)  # fmt: skip
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        llm.check_integrity()
    assert outs[0] == outs[1]
