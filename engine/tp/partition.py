"""Which part of the model each tensor-parallel rank holds: the head rule, written once.

Attention is split by KV-head group: a rank holds some KV heads together with every query head
that reads them, so attention needs no communication. With `kv` KV heads, `g = q / kv` query
heads per group and TP size `t`:

- `t <= kv`: the KV heads are cut into `t` contiguous blocks as even as possible, the first
  `kv % t` ranks taking one more (SmolLM2-135M, 3 KV heads, TP=2: rank 0 KV heads {0, 1} with
  query heads 0-5, rank 1 KV head {2} with query heads 6-8).
- `t > kv`: `t` must be a multiple of `kv`; each KV head is replicated on `r = t / kv`
  consecutive ranks, and its `g` query heads are split over those replicas as evenly as possible
  (the first ones taking one more), so `r <= g` (no rank without a query head).
- Anything else is refused at start with the reason (`TPConfigError`): query heads not a
  multiple of KV heads, `t > kv` and not a multiple, more replicas than query heads per group.

The MLP intermediate dimension and the vocabulary are split into `t` contiguous blocks, evenly
where `t` divides them, else the first ranks take one more. So are a mixture-of-experts layer's
intermediate dimensions: each rank holds every expert, with its block of each expert's rows (and
of the shared experts'), so the experts need no communication beyond the MLP's all-reduce. The
router, norms and RoPE are replicated.

Expert parallelism (`ep_size` N > 1, N dividing `t` and the routed experts) instead gives each
rank whole routed experts, E/N of them, by an `ExpertLayout` (engine/tp/expert_placement.py);
with an expert-placement file (`--expert-placement`, N == `t` == the file's EP size) each MoE
layer's ranks hold the file's slots for them instead, redundant copies included. Tokens then
travel to their experts' ranks (engine/models/moe_dispatch.py). Attention, the dense layers'
MLPs and the shared experts stay split by the rule above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.model_config import ModelConfig
from engine.tp.expert_placement import ExpertLayout

if TYPE_CHECKING:
    from engine.eplb.placement import ExpertPlacement


class TPConfigError(ValueError):
    """The model cannot be split over this many tensor-parallel ranks."""


@dataclass(frozen=True)
class TPShard:
    """The slices of the model one rank holds (ranges of head / row indices)."""

    tp_rank: int
    tp_size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    expert_intermediate: range = range(0)  # of each routed expert (MoE models)
    shared_intermediate: range = range(0)  # of the shared experts' MLP (MoE models)
    # Expert parallelism: per MoE layer, the whole routed experts of each rank (None: every
    # expert, its rows `expert_intermediate`, on every rank).
    expert_layout: ExpertLayout | None = None

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` cut into `parts` contiguous sizes, the first `total % parts` one larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _blocks(total: int, parts: int) -> list[range]:
    out, start = [], 0
    for size in split_sizes(total, parts):
        out.append(range(start, start + size))
        start += size
    return out


def check_tp(
    config: ModelConfig,
    tp_size: int,
    ep_size: int = 1,
    placement: ExpertPlacement | None = None,
) -> None:
    """Raise TPConfigError with the reason when `config` cannot be split over `tp_size` ranks
    with routed experts sharded `ep_size` ways (by `placement`, if given)."""
    q, kv = config.num_heads, config.num_kv_heads
    where = f"{config.model_path or config.architecture} ({q} query heads, {kv} KV heads)"
    if tp_size < 1:
        raise TPConfigError(f"tp_size must be >= 1, got {tp_size}")
    check_ep(config, tp_size, ep_size, placement)
    if tp_size == 1:
        return  # the whole model on one rank: nothing to split
    if q % kv:
        raise TPConfigError(
            f"{where}: query heads are not a multiple of KV heads, so KV-head groups cannot be "
            "kept whole on a rank; use tp_size 1"
        )
    if tp_size > kv:
        if tp_size % kv:
            raise TPConfigError(
                f"{where}: tp_size {tp_size} exceeds the KV heads and is not a multiple of "
                f"{kv}, so KV heads cannot be replicated evenly; use tp_size <= {kv} or a "
                f"multiple of {kv}"
            )
        if tp_size // kv > q // kv:
            raise TPConfigError(
                f"{where}: tp_size {tp_size} would replicate each KV head on {tp_size // kv} "
                f"ranks but a group has only {q // kv} query heads; use tp_size <= {q}"
            )
    sizes = [("intermediate size", config.intermediate_size), ("vocabulary", config.vocab_size)]
    if config.moe is not None:
        if ep_size == 1:  # under EP a rank holds whole experts
            sizes.append(("expert intermediate size", config.moe.intermediate_size))
        if config.moe.shared_intermediate_size:
            sizes.append(("shared experts' size", config.moe.shared_intermediate_size))
    for name, size in sizes:
        if size < tp_size:
            raise TPConfigError(f"{where}: the {name} {size} is smaller than tp_size {tp_size}")


def check_ep(
    config: ModelConfig, tp_size: int, ep_size: int, placement: ExpertPlacement | None = None
) -> None:
    """Raise TPConfigError naming `--ep-size` (or `--expert-placement`) and its limit when the
    routed experts cannot be sharded `ep_size` ways over `tp_size` ranks (by `placement`). With
    ep_size 1 a placement is not laid out: every expert is on every rank."""
    if ep_size < 1:
        raise TPConfigError(f"ep_size (--ep-size) must be >= 1, got {ep_size}")
    if ep_size == 1:
        return
    where = config.model_path or config.architecture
    if config.moe is None:
        raise TPConfigError(
            f"ep_size {ep_size} (--ep-size) shards routed experts, and {where} is a dense "
            "model without any; use ep_size 1"
        )
    if tp_size % ep_size:
        raise TPConfigError(
            f"ep_size {ep_size} (--ep-size) must divide the node's {tp_size} ranks (tp_size, "
            "--tp-size): each expert block lives on the same number of ranks"
        )
    if placement is not None:
        _check_placement(tp_size, ep_size, placement)
    elif config.moe.num_experts % ep_size:
        raise TPConfigError(
            f"ep_size {ep_size} (--ep-size) must divide {where}'s {config.moe.num_experts} "
            "routed experts, so that every rank holds as many"
        )


def _check_placement(tp_size: int, ep_size: int, placement: ExpertPlacement) -> None:
    if placement.ep_size != ep_size:
        raise TPConfigError(
            f"--expert-placement places the experts over {placement.ep_size} EP ranks, but "
            f"--ep-size is {ep_size}: serve it with --ep-size {placement.ep_size}, or make a "
            f"placement for {ep_size} ranks (pdserve-eplb)"
        )
    if tp_size != ep_size:
        raise TPConfigError(
            f"--expert-placement over {ep_size} EP ranks needs a node of as many ranks: "
            f"--tp-size {tp_size} with --ep-size {ep_size} is not supported; use --tp-size "
            f"{ep_size} --ep-size {ep_size}"
        )


def plan_tp(
    config: ModelConfig,
    tp_size: int,
    ep_size: int = 1,
    placement: ExpertPlacement | None = None,
) -> list[TPShard]:
    """Every rank's shard, by the rule in the module docstring; under expert parallelism the
    experts laid out by `placement` where given (ep_size 1 leaves it unused)."""
    check_tp(config, tp_size, ep_size, placement)
    q, kv = config.num_heads, config.num_kv_heads
    group = q // kv
    inter = _blocks(config.intermediate_size, tp_size)
    vocab = _blocks(config.vocab_size, tp_size)
    moe = config.moe
    layout = None
    if moe is not None and ep_size > 1:
        experts = [range(moe.intermediate_size)] * tp_size
        layout = _expert_layout(config, tp_size, ep_size, placement)
    else:
        experts = _blocks(moe.intermediate_size if moe else 0, tp_size)
    shared = _blocks(moe.shared_intermediate_size if moe else 0, tp_size)
    shards = []
    for rank in range(tp_size):
        if tp_size <= kv:
            kv_heads = _blocks(kv, tp_size)[rank]
            q_heads = range(kv_heads.start * group, kv_heads.stop * group)
        else:
            replicas = tp_size // kv
            head, replica = divmod(rank, replicas)
            kv_heads = range(head, head + 1)
            part = _blocks(group, replicas)[replica]
            q_heads = range(head * group + part.start, head * group + part.stop)
        shards.append(
            TPShard(
                rank,
                tp_size,
                q_heads,
                kv_heads,
                inter[rank],
                vocab[rank],
                expert_intermediate=experts[rank],
                shared_intermediate=shared[rank],
                expert_layout=layout,
            )
        )
    return shards


def _expert_layout(
    config: ModelConfig, tp_size: int, ep_size: int, placement: ExpertPlacement | None
) -> ExpertLayout:
    moe = config.moe
    assert moe is not None
    if placement is None:
        return ExpertLayout.contiguous(sorted(moe.layers), moe.num_experts, ep_size, tp_size)
    return ExpertLayout.from_placement(
        placement.layer_ids, placement.num_experts, tp_size, placement.slot_experts
    )


def rank_parameters(
    config: ModelConfig,
    tp_size: int,
    ep_size: int = 1,
    placement: ExpertPlacement | None = None,
) -> int:
    """The weights one rank holds, for the memory planner: a 1/tp_size share of the model,
    but under expert parallelism the routed experts of its slots whole (E/ep_size of them, or
    the placement's slots per rank, redundant copies included)."""
    if config.moe is None or ep_size == 1:
        return config.num_parameters // tp_size
    routed = len(config.moe.layers) * config.moe.routed_parameters(config.hidden_size)
    slots = config.moe.num_experts // ep_size if placement is None else placement.slots_per_rank
    return (config.num_parameters - routed) // tp_size + routed // config.moe.num_experts * slots


def full_shard(config: ModelConfig) -> TPShard:
    """The whole model on one rank (TP=1)."""
    return plan_tp(config, 1)[0]
