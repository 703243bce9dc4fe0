"""Linear layers packed for oneDNN (engine/models/cpu_linear.py): same results as F.linear, the
plain weights released, the choice of kernel and its errors. The engine's HF-equality tests
(test_engine_correctness.py) run with packing on, the default on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models import build_model
from engine.models.cpu_linear import (
    PackedLinear,
    bucket_rows,
    onednn_dtype_supported,
    onednn_linear_available,
    pack_linears,
    wants_packed_linears,
)
from tests.test_elementwise import TINY

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="torch without oneDNN")
needs_onednn_bf16 = pytest.mark.skipif(
    not (onednn_linear_available() and onednn_dtype_supported(torch.bfloat16)),
    reason="this CPU lacks oneDNN's bf16 instructions (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)",
)
CPU = torch.device("cpu")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_equals_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    want = linear(x)
    got = PackedLinear(linear)(x)
    assert got.shape == want.shape == (rows, 160)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_buckets_are_few_and_pad_at_most_an_eighth() -> None:
    assert [bucket_rows(r) for r in (1, 17, 32)] == [1, 17, 32]  # decode batches: exact
    want = {33: 36, 36: 36, 37: 40, 64: 64, 65: 72, 1000: 1024, 2048: 2048}
    assert {r: bucket_rows(r) for r in want} == want
    padded = [bucket_rows(r) for r in range(1, 4097)]
    assert all(r <= p <= r * 1.125 for r, p in zip(range(1, 4097), padded, strict=True))
    assert len(set(padded)) == 32 + 8 * 7  # exact to 32, then 8 per power of two
    assert padded == sorted(padded)


@needs_onednn
@pytest.mark.parametrize("shape", [(45,), (3, 15)])
def test_padded_rows_do_not_leak_into_the_output(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    x = torch.randn(*shape, 24)
    got = PackedLinear(linear)(x)
    assert got.shape == (*shape, 40)
    torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)


@needs_onednn_bf16
def test_packed_linear_bfloat16() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    got = PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), linear(x).float(), rtol=2e-2, atol=2e-2)


@needs_onednn
def test_pack_linears_replaces_every_linear_and_keeps_the_logits() -> None:
    torch.manual_seed(0)
    model = build_model(TINY).eval()
    x = torch.randn(6, TINY.hidden_size)
    layer = model.layers[0]
    want = (layer.mlp(x), model.lm_head(x), layer.self_attn.qkv_proj(x))

    packed = pack_linears(model)

    # 4 per layer (qkv, o, gate_up, down) + the LM head
    assert packed == 4 * TINY.num_layers + 1
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # the plain matmul weights are gone: only the embedding and the norms remain as parameters
    names = {name for name, p in model.named_parameters() if p.dim() == 2}
    assert names == {"embed_tokens.weight"}
    got = (layer.mlp(x), model.lm_head(x), layer.self_attn.qkv_proj(x))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_engine_greedy_is_the_same_with_either_kernel(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen2")  # a bias on the QKV projection
    prompts = [[1, 5, 9, 200, 31, 7] * k for k in (1, 3, 7)]
    params = SamplingParams(max_new_tokens=12, temperature=0)
    outs = {}
    for kernel in ("onednn", "aten"):
        llm = LLM(str(model_dir), page_size=4, max_total_tokens=2048, linear_kernel=kernel)
        packed = [m for m in llm.runner.model.modules() if isinstance(m, PackedLinear)]
        assert bool(packed) == (kernel == "onednn")
        outs[kernel] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["onednn"] == outs["aten"]


def test_kernel_choice() -> None:
    fp32, fp16 = torch.float32, torch.float16
    assert not wants_packed_linears("aten", CPU, fp32)
    assert wants_packed_linears("auto", CPU, fp32) == onednn_linear_available()
    assert not wants_packed_linears("auto", CPU, fp16)
    assert not wants_packed_linears("auto", torch.device("cuda"), fp32)
    with pytest.raises(ValueError, match=r"float16.*use 'auto' or 'aten'"):
        wants_packed_linears("onednn", CPU, fp16)
    with pytest.raises(ValueError, match="linear_kernel must be one of"):
        wants_packed_linears("mkl", CPU, fp32)
    # bf16 packs only where the CPU has oneDNN's bf16 instructions; elsewhere auto falls back
    # and an explicit 'onednn' is refused, naming the missing instructions.
    bf16_ok = onednn_linear_available() and onednn_dtype_supported(torch.bfloat16)
    assert wants_packed_linears("auto", CPU, torch.bfloat16) == bf16_ok
    if onednn_linear_available() and not bf16_ok:
        with pytest.raises(ValueError, match="bf16 instructions missing"):
            wants_packed_linears("onednn", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match=r"linear_kernel must be one of .* got 'mkl'"):
        EngineConfig(model_path="x", linear_kernel="mkl")
