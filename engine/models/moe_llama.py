"""Mixture-of-experts decoders with the Llama family's attention (llama.py) and, in the layers
`MoEConfig.layers` names, the sparse MLP of moe.py; the other layers keep a dense gated MLP.

- Qwen3MoeForCausalLM: Qwen3's attention (per-head q/k RMSNorm), softmax top-k routing;
  `decoder_sparse_step` / `mlp_only_layers` make dense layers.
- MixtralForCausalLM: Mistral's attention, softmax top-k renormalised; its checkpoint names
  (`block_sparse_moe`, experts' `w1`/`w3`/`w2`) are read as Qwen3-MoE's.
- Dots1ForCausalLM (dots.llm1): Qwen3's attention with DeepSeek-V3's MoE (grouped sigmoid
  routing, correction bias, shared experts, `first_k_dense_replace` dense layers): the DeepSeek
  MoE layer behind an attention this engine has (DeepSeek-V3's own attention is MLA).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from engine.models.llama import LlamaForCausalLM
from engine.models.moe import EXPERT_CHECKPOINT_NAMES, SparseMoEBlock


class MoEForCausalLM(LlamaForCausalLM):
    # For the loader: `...experts.<e>.<name>.weight` -> (stacked parameter, part of its rows).
    expert_params: ClassVar[dict[str, tuple[str, int | None]]] = EXPERT_CHECKPOINT_NAMES
    # The grouped expert compute reads the tokens per expert on the host: no CUDA graph.
    supports_cuda_graphs: ClassVar[bool] = False

    def make_mlp(self, layer_id: int) -> nn.Module:
        if self.config.moe is None or not self.config.is_sparse_layer(layer_id):
            return super().make_mlp(layer_id)
        layout = self.shard.expert_layout
        placement = None if layout is None else layout.for_layer(layer_id)
        moe, hidden = self.config.moe, self.config.hidden_size
        return SparseMoEBlock(moe, hidden, self.shard, self.group, placement)

    def local_expert_slots(self, layer_id: int, expert: int) -> tuple[int, ...]:
        """For the loader: the slots of this rank's stacked expert weights of layer `layer_id`
        that checkpoint expert `expert` fills; none under expert parallelism when other ranks
        hold it (the loader then never reads its tensors). Without it every expert has its own
        index."""
        layout = self.shard.expert_layout
        if layout is None or layer_id not in layout.layer_ids:
            return (expert,)  # a dense layer's experts find no place: the loader says so
        placement = layout.for_layer(layer_id)
        if expert >= placement.num_experts:
            return (expert,)  # an expert the model lacks: the same
        return placement.local_slots(self.shard.tp_rank, expert)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    pass


class MixtralForCausalLM(MoEForCausalLM):
    # (checkpoint name part, the engine's): applied to each tensor name before anything else.
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )


class Dots1ForCausalLM(MoEForCausalLM):
    pass
