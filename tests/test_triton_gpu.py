"""The Triton kernels and decode CUDA graphs on a GPU, against torch-native; skipped without one.

CI has no GPU: these run on the device machine (`pytest tests/test_triton_gpu.py`), and
scripts/gpu/run_all.py runs the same comparisons on Llama-3-8B shapes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.attention.torch_native import TorchNativeBackend
from engine.attention.triton_backend import TritonBackend
from tests.test_triton_reference import make_case, run_backend

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs a CUDA GPU and the triton package",
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


CASES = {
    "decode": ([5, 150, 0, 63, 64, 2047], [1] * 6),
    "extend": ([0, 0, 13, 40, 77], [7, 7, 20, 1, 300]),
}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_match_torch_native(kind: str, page_size: int, dtype: torch.dtype) -> None:
    prefix, ext = CASES[kind]
    cache, pool, batch, q, k, v = make_case(
        page_size, prefix, ext, num_kv_heads=2, group=4, head_dim=128, device="cuda", dtype=dtype
    )
    ref_outs, ref_cache = run_backend(TorchNativeBackend, cache, pool, batch, q, k, v)
    outs, new_cache = run_backend(TritonBackend, cache, pool, batch, q, k, v)
    assert torch.equal(new_cache, ref_cache)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for out, ref in zip(outs, ref_outs, strict=True):
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < tol


def test_engine_greedy_with_graphs_equals_torch_native(tiny_model_dir) -> None:
    from engine import LLM, SamplingParams

    model = str(tiny_model_dir("llama"))
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 120, 9, 70)]
    params = [
        SamplingParams(max_new_tokens=6 + 4 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = {}
    for backend in ("torch_native", "triton"):
        llm = LLM(model, load_format="safetensors", device="cuda", page_size=16,
                  chunked_prefill_size=64, attention_backend=backend)  # fmt: skip
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.check_integrity()
    assert outputs["triton"] == outputs["torch_native"]
