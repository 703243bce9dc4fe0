"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) and the Qwen2/Qwen3 variants.

Qwen2 differs only by a bias on the QKV projection and Qwen3 by a per-head RMSNorm on q and k,
so one implementation covers all of them, switched by `ModelConfig.attention_bias` / `qk_norm`.
The attention itself (and the paged KV cache write) belongs to the attention backend.

Tensor parallelism (engine/tp/partition.py holds the rule): the model is built for one rank's
`TPShard`. The QKV and gate/up projections are column-parallel (the rank's heads / intermediate
rows), o_proj and down_proj row-parallel (their partial outputs are all-reduced), the embedding
and LM head vocabulary-parallel (the embedding's partial rows are all-reduced, the logits
all-gathered). With TP=1 the shard is the whole model and every collective is the identity.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.model_config import ModelConfig
from engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from engine.tp.group import TPGroup
from engine.tp.partition import TPShard, full_shard, split_sizes


class DecoderAttention(nn.Module):
    """The rank's query heads and the KV heads they read (column-parallel QKV); the caller
    all-reduces the row-parallel o_proj output."""

    def __init__(
        self, config: ModelConfig, layer_id: int, rope: RotaryEmbedding, shard: TPShard
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
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
        attn = batch.attn_backend
        out = attn.rotary_forward((q, k, v), positions, self.rope, self.layer_id, batch)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    """Attention then `mlp` (the model's choice for this layer: dense, or a mixture of experts),
    each after its RMSNorm; both outputs are a TP rank's partial sums, all-reduced here."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rope: RotaryEmbedding,
        shard: TPShard,
        group: TPGroup,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.group = group
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, layer_id, rope, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added): each residual add
        is fused with the norm after it (one kernel on GPU), the last one in the next layer.
        `residual` None: `x` is the embedding, the start of the stream."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.group.all_reduce(self.self_attn(positions, h, batch))
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.group.all_reduce(self.mlp(h)), residual


class LlamaForCausalLM(nn.Module):
    """Returns logits only for each request's last token (all a sampler needs)."""

    def __init__(
        self, config: ModelConfig, shard: TPShard | None = None, group: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.shard = shard or full_shard(config)
        self.group = group or TPGroup.single()
        self.vocab_sizes = split_sizes(config.vocab_size, self.shard.tp_size)
        self.embed_tokens = nn.Embedding(len(self.shard.vocab), config.hidden_size)
        rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rope, self.shard, self.group, self.make_mlp(i))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, len(self.shard.vocab), bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_mlp(self, layer_id: int) -> nn.Module:
        """Layer `layer_id`'s MLP: dense here; a mixture-of-experts family overrides this."""
        return GatedMLP(self.config.hidden_size, len(self.shard.intermediate))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x, residual = self._embed(batch.input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(batch.positions, x, residual, batch)
            if batch.after_layer is not None:
                batch.after_layer(i)
            if batch.interlude is not None:
                batch.interlude()
        for row in batch.all_logits_of:
            batch.token_logits[row] = self._logits(x, residual, batch.token_rows(row))
        return self._logits(x, residual, batch.last_token_index)

    def _logits(
        self, x: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor | range
    ) -> torch.Tensor:
        # An index tensor, never a slice: the fused norm may write into its input (GPU).
        index = (
            rows
            if isinstance(rows, torch.Tensor)
            else torch.arange(rows.start, rows.stop, device=x.device)
        )
        if residual is None:
            last = self.norm(x[index])
        else:
            last, _ = self.norm.add_forward(x[index], residual[index])
        logits = self.lm_head(last).float()
        return self.group.gather_last_dim(logits, self.vocab_sizes)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.embed_tokens(ids)
        vocab = self.shard.vocab
        mine = (ids >= vocab.start) & (ids < vocab.stop)
        rows = self.embed_tokens(torch.where(mine, ids - vocab.start, 0))
        return self.group.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))

    # HF checkpoint names that map onto one fused parameter: (fused name, shard index).
    stacked_params: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def shard_sizes(self, param: str) -> list[int]:
        """The rows of each checkpoint tensor fused into parameter `param` (qkv, gate/up)."""
        hd = self.config.head_dim
        if ".qkv_proj." in param:
            kv = self.shard.num_kv_heads * hd
            return [self.shard.num_heads * hd, kv, kv]
        return [len(mlp_rows(self.shard, param))] * 2

    def tp_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (HF naming, `model.` prefix removed)."""
        if self.shard.tp_size == 1:
            return tensor
        s, hd = self.shard, self.config.head_dim
        module = name.rsplit(".", 2)[-2] if "." in name else ""
        rows: dict[str, range] = {
            "q_proj": range(s.q_heads.start * hd, s.q_heads.stop * hd),
            "k_proj": range(s.kv_heads.start * hd, s.kv_heads.stop * hd),
            "v_proj": range(s.kv_heads.start * hd, s.kv_heads.stop * hd),
            "gate_proj": mlp_rows(s, name),
            "up_proj": mlp_rows(s, name),
            "embed_tokens": s.vocab,
            "lm_head": s.vocab,
        }
        cols: dict[str, range] = {
            "o_proj": range(s.q_heads.start * hd, s.q_heads.stop * hd),
            "down_proj": mlp_rows(s, name),
        }
        if module in rows:  # weights and biases alike: dim 0 is the output row
            span = rows[module]
            return tensor.narrow(0, span.start, len(span))
        if module in cols and name.endswith("weight"):
            span = cols[module]
            return tensor.narrow(1, span.start, len(span))
        return tensor


def mlp_rows(shard: TPShard, name: str) -> range:
    """The rank's intermediate rows of the MLP that tensor `name` belongs to: a routed expert's
    (`...experts.<e>...` and the stacked `experts.w13`/`w2`), the shared experts' or the dense
    MLP's."""
    if ".shared_experts." in name:
        return shard.shared_intermediate
    if ".experts." in name:
        return shard.expert_intermediate
    return shard.intermediate


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


class MistralForCausalLM(LlamaForCausalLM):
    pass
