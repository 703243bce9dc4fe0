"""The decoder's elementwise steps on CPU: the plain-torch references that the fused Triton kernels
(engine/models/elementwise_kernels.py) are checked against on a GPU, and the model's residual
stream, which carries each residual add into the next norm so that the GPU can fuse the two.
The kernels themselves run in tests/test_elementwise_gpu.py and scripts/gpu/run_all.py."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.attention.torch_native import TorchNativeBackend
from engine.model_config import ModelConfig
from engine.models import build_model
from engine.models import elementwise as ew
from tests.test_triton_reference import make_case

TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def test_rotary_reference_is_hf_rotate_half() -> None:
    """Half-width tables, rotated halves: the same as HF's q*cos + rotate_half(q)*sin with the
    tables repeated to full width."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 4, 16, generator=gen), torch.randn(7, 2, 16, generator=gen)
    positions = torch.tensor([0, 3, 9, 100, 5, 5, 511])
    angles = torch.rand(512, 8, generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    q_out, k_out = ew.rotary_reference(q, k, positions, cos, sin)

    def hf(x: torch.Tensor) -> torch.Tensor:
        full_cos = torch.cat((cos, cos), -1)[positions].unsqueeze(1)
        full_sin = torch.cat((sin, sin), -1)[positions].unsqueeze(1)
        x1, x2 = x.chunk(2, dim=-1)
        return x * full_cos + torch.cat((-x2, x1), dim=-1) * full_sin

    torch.testing.assert_close(q_out, hf(q))
    torch.testing.assert_close(k_out, hf(k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_references_equal_the_unfused_steps(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, r = (torch.randn(5, 64, generator=gen).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    normed, summed = ew.add_rms_norm_reference(x, r, w, 1e-5)
    assert torch.equal(summed, x + r)
    assert torch.equal(normed, ew.rms_norm_reference(x + r, w, 1e-5))
    gate_up = torch.randn(5, 2 * 96, generator=gen).to(dtype)
    assert torch.equal(
        ew.silu_and_mul_reference(gate_up), F.silu(gate_up[:, :96]) * gate_up[:, 96:]
    )


def test_torch_elementwise_blocks_do_not_nest() -> None:
    inner = ew.torch_elementwise()
    with ew.torch_elementwise(), pytest.raises(RuntimeError, match="do not nest"), inner:
        pass
    with ew.torch_elementwise():  # the failed nesting left no state behind
        pass


def plain_forward(model: Any, batch: Any) -> torch.Tensor:
    """The decoder written the textbook way: x += attn(norm(x)); x += mlp(norm(x))."""
    x = model.embed_tokens(batch.input_ids)
    for layer in model.layers:
        x = x + layer.self_attn(batch.positions, layer.input_layernorm(x), batch)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x[batch.last_token_index])).float()


@pytest.mark.parametrize("num_layers", [0, 1, 3])
def test_residual_stream_gives_the_textbook_logits_bit_for_bit(num_layers: int) -> None:
    torch.manual_seed(0)
    model = build_model(replace(TINY, num_layers=num_layers)).eval()
    for name, param in model.named_parameters():
        if "norm" in name:  # ones would hide a norm applied to the wrong tensor
            param.data.uniform_(0.5, 1.5)
    cache, pool, batch, *_ = make_case(4, [0, 3, 9], [6, 5, 1], num_kv_heads=2, group=2,
                                       head_dim=16, num_layers=max(num_layers, 1))  # fmt: skip
    batch = replace(batch, input_ids=torch.randint(0, 256, (batch.input_ids.numel(),)))
    batch.attn_backend = TorchNativeBackend(cache, pool)
    batch.attn_backend.init_metadata(batch)
    with torch.inference_mode():
        assert torch.equal(model(batch), plain_forward(model, batch))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_kernels_module_imports() -> None:
    from engine.models import elementwise_kernels

    assert callable(elementwise_kernels.add_rms_norm)
