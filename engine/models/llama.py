"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) and the Qwen2/Qwen3 variants.

Qwen2 differs only by a bias on the QKV projection and Qwen3 by a per-head RMSNorm on q and k,
so one implementation covers all of them, switched by `ModelConfig.attention_bias` / `qk_norm`.
The attention itself (and the paged KV cache write) belongs to the attention backend.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.model_config import ModelConfig
from engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rope = rope
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        out = batch.attn_backend.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, layer_id, rope)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Returns logits only for each request's last token (all a sampler needs)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i, rope) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(batch.positions, x, batch)
        last = x[batch.last_token_index]
        return self.lm_head(self.norm(last)).float()

    # HF checkpoint names that map onto one fused parameter: (fused name, shard index).
    stacked_params: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            return [c.q_size, c.kv_size, c.kv_size]
        return [c.intermediate_size, c.intermediate_size]


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


class MistralForCausalLM(LlamaForCausalLM):
    pass
