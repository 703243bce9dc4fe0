"""The mixture-of-experts MLP: a router picks each token's `top_k` experts and their weights,
the routed experts run as stacked weights, and shared experts (DeepSeek-V3) see every token.

Weights: a layer's experts are two stacked tensors, `w13` [E, 2I, H] (each expert's gate rows,
then its up rows) and `w2` [E, H, I], filled at load from the checkpoint's per-expert tensors
(`EXPERT_CHECKPOINT_NAMES`, engine/models/loader.py). A tensor-parallel rank holds its block of
I for every expert (engine/tp/partition.py); under expert parallelism it holds whole experts,
the slots of the layer's `ExpertSlots` (dim 0 is then the rank's slots, not the E experts).

Routing (`ROUTERS`, keyed by `MoEConfig.router`) repeats HF's float operations one for one, so
ties and roundings fall the same way:
- softmax_topk (Qwen3MoeTopKRouter, MixtralTopKRouter): softmax of the logits in fp32, top-k,
  renormalised to sum 1 where `norm_topk_prob` (Mixtral: always).
- grouped_sigmoid_topk (DeepseekV3TopkRouter, Dots1TopkRouter): logits and sigmoid scores in
  fp32; for the choice only, `e_score_correction_bias` is added, each group of experts scores
  the sum of its best two, and the top-k comes from the best `topk_group` groups. The weights are
  the chosen experts' scores (no bias), renormalised where `norm_topk_prob`, then times
  `routed_scaling_factor`. Like HF, the router's weight and bias stay fp32 in a 16-bit model.

Expert compute: `grouped_experts` (engine/models/expert_compute.py) on one rank, or under expert
parallelism the same grouped GEMMs behind an all-to-all (engine/models/moe_dispatch.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import GROUPED_SIGMOID_TOPK, SOFTMAX_TOPK, MoEConfig
from engine.models.expert_compute import grouped_experts
from engine.models.layers import GatedMLP
from engine.models.moe_dispatch import ExpertDispatch
from engine.tp.expert_placement import ExpertSlots
from engine.tp.group import TPGroup
from engine.tp.partition import TPShard

# A checkpoint's per-expert tensor `...experts.<e>.<name>.weight` -> (stacked parameter of the
# `experts` module, part of its rows: 0 gate, 1 up; None: the whole expert).
EXPERT_CHECKPOINT_NAMES: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", None),
}

Routing = tuple[torch.Tensor, torch.Tensor]  # (weights [N, k] fp32, expert ids [N, k] int64)


def softmax_topk(router: TopKRouter, x: torch.Tensor) -> Routing:
    logits = F.linear(x, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, router.moe.top_k, dim=-1)
    if router.moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_sigmoid_topk(router: TopKRouter, x: torch.Tensor) -> Routing:
    moe, bias = router.moe, router.e_score_correction_bias
    assert bias is not None
    scores = F.linear(x.float(), router.weight.float()).sigmoid()
    choice = scores + bias
    per_group = moe.num_experts // moe.num_groups
    grouped = choice.view(-1, moe.num_groups, per_group)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    eligible = kept.unsqueeze(-1).expand(-1, moe.num_groups, per_group).reshape(-1, moe.num_experts)
    choice = choice.masked_fill(~eligible, float("-inf"))
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


ROUTERS: dict[str, Callable[[TopKRouter, torch.Tensor], Routing]] = {
    SOFTMAX_TOPK: softmax_topk,
    GROUPED_SIGMOID_TOPK: grouped_sigmoid_topk,
}


class TopKRouter(nn.Module):
    """HF's `gate`: the router's `weight` [E, H] (and DeepSeek-V3's correction bias [E])."""

    def __init__(self, moe: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.moe = moe
        self.route = ROUTERS[moe.router]
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(moe.num_experts)) if moe.has_correction_bias else None
        )
        # Kept in fp32 when the model is cast to 16 bits (engine/models/loader.py), as HF does.
        self.fp32_params = ("weight", "e_score_correction_bias") if moe.has_correction_bias else ()
        # Given each forward's expert ids: the expert-load counter (engine/eplb/recorder.py).
        self.record: Callable[[torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> Routing:
        weights, ids = self.route(self, x)
        if self.record is not None:
            self.record(ids)
        return weights, ids


class StackedExperts(nn.Module):
    """The routed experts' weights, one tensor per projection with the experts on dim 0."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return grouped_experts(x, self.w13, self.w2, weights, ids)


class SparseMoEBlock(nn.Module):
    """A layer's MLP as a mixture of experts: HF's `mlp` (Mixtral's `block_sparse_moe`). Its
    output is a TP rank's partial sum, like a dense MLP's; the layer all-reduces it. Under
    expert parallelism (`placement`: this layer's slots of `shard.expert_layout`) the rank
    holds the whole experts of its slots, and `dispatch` carries its tokens to their experts'
    ranks and back (engine/models/moe_dispatch.py)."""

    def __init__(
        self,
        moe: MoEConfig,
        hidden: int,
        shard: TPShard,
        group: TPGroup | None = None,
        placement: ExpertSlots | None = None,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(moe, hidden)
        slots = moe.num_experts if placement is None else placement.slots_per_rank
        self.experts = StackedExperts(slots, hidden, len(shard.expert_intermediate))
        self.dispatch = (
            None
            if placement is None
            else ExpertDispatch(placement, shard.tp_rank, group or TPGroup.single())
        )
        self.shared_experts = (
            GatedMLP(hidden, len(shard.shared_intermediate))
            if moe.shared_intermediate_size
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dispatch is None:
            out = self.experts(x, *self.gate(x))
        else:
            out = self.dispatch(x, self.gate, self.experts.w13, self.experts.w2)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
