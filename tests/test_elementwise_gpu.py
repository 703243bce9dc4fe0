"""The fused elementwise kernels on a GPU against their plain-torch references; skipped without
one. CI has no GPU: these run on the device machine, and scripts/gpu/run_all.py runs the same
comparisons on Llama-3-8B shapes and through the whole model."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from engine.attention.triton_backend import TritonBackend
from engine.models import build_model
from engine.models import elementwise as ew
from tests.test_elementwise import TINY
from tests.test_triton_reference import make_case

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs a CUDA GPU and the triton package",
)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def tol(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [576, 4096])
def test_norms_and_silu(dtype: torch.dtype, hidden: int) -> None:
    x, r = (torch.randn(33, hidden, device="cuda", dtype=dtype) for _ in range(2))
    w = 1 + 0.1 * torch.randn(hidden, device="cuda", dtype=dtype)
    assert rel_err(ew.rms_norm(x, w, 1e-5), ew.rms_norm_reference(x, w, 1e-5)) < tol(dtype)
    normed, summed = ew.add_rms_norm(x, r, w, 1e-5)
    ref_normed, ref_summed = ew.add_rms_norm_reference(x, r, w, 1e-5)
    assert torch.equal(summed, ref_summed)
    assert rel_err(normed, ref_normed) < tol(dtype)
    gate_up = torch.randn(33, 2 * hidden, device="cuda", dtype=dtype)
    out = ew.silu_and_mul(gate_up)
    assert out.shape == (33, hidden)
    assert rel_err(out, ew.silu_and_mul_reference(gate_up)) < tol(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])
def test_rotary_on_strided_qkv_views(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    hq, hk, hd = heads
    qkv = torch.randn(40, (hq + 2 * hk) * hd, device="cuda", dtype=dtype)
    q, k = qkv[:, : hq * hd].view(40, hq, hd), qkv[:, hq * hd : (hq + hk) * hd].view(40, hk, hd)
    positions = torch.randint(0, 4096, (40,), device="cuda")
    angles = torch.rand(4096, hd // 2, device="cuda") * 6.3
    outs = ew.rotary(q, k, positions, angles.cos(), angles.sin())
    refs = ew.rotary_reference(q, k, positions, angles.cos(), angles.sin())
    for out, ref in zip(outs, refs, strict=True):
        assert out.shape == ref.shape and torch.isfinite(out).all()
        assert rel_err(out, ref) < tol(dtype)


def test_model_logits_fused_vs_torch_elementwise() -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(replace(TINY, num_layers=2)).eval()
    case = make_case(4, [0, 3, 9], [6, 5, 1], num_kv_heads=2, group=2, head_dim=16, device="cuda")
    cache, pool, batch, *_ = case
    ids = torch.randint(0, 256, (batch.input_ids.numel(),), device="cuda")
    batch = replace(batch, input_ids=ids, attn_backend=TritonBackend(cache, pool))
    batch.attn_backend.init_metadata(batch)
    with torch.inference_mode():
        fused = model(batch)
        with ew.torch_elementwise():
            ref = model(batch)
    assert rel_err(fused, ref) < 1e-5


def test_decode_logits_with_both_fusions_vs_torch_elementwise() -> None:
    """A bf16 decode batch takes both fusions (gate_up + SiLU in one kernel, rotary written
    into the cache by the decode kernel); under torch_elementwise() it takes neither."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(replace(TINY, num_layers=2)).to(torch.bfloat16).eval()
    case = make_case(4, [7, 3, 20], [1, 1, 1], num_kv_heads=2, group=2, head_dim=16,
                     device="cuda", dtype=torch.bfloat16)  # fmt: skip
    cache, pool, batch, *_ = case
    ids = torch.randint(0, 256, (batch.input_ids.numel(),), device="cuda")
    batch = replace(batch, input_ids=ids, attn_backend=TritonBackend(cache, pool))
    batch.attn_backend.init_metadata(batch)
    with torch.inference_mode():
        before = cache.buffer.clone()
        fused = model(batch)
        fused_cache = cache.buffer.clone()
        cache.buffer.copy_(before)
        with ew.torch_elementwise():
            ref = model(batch)
    assert rel_err(fused, ref) < 2e-2
    assert rel_err(fused_cache, cache.buffer) < 2e-2
