"""A placement from a recorded distribution: DeepSeek's EPLB (its global policy), per MoE layer.

1. Replicate: the redundant slots (`ep_size * slots_per_rank - E`) go one at a time to the
   expert whose copies each carry the most tokens (load / copies; at most one copy per rank),
   so the heaviest copy is as light as it can be. A replicated expert's tokens are split evenly
   among its copies.
2. Pack: the copies, heaviest first, each onto the least loaded rank that has a free slot and
   does not hold that expert yet (a second copy on the same rank would balance nothing): the
   greedy largest-first bin packing, with `slots_per_rank` items per bin.
3. Refine: while moving one copy of the busiest rank to another rank, in exchange for one of
   that rank's, lowers the busier of the two, the best such swap is made.

Ties go to the lower expert and rank ids: the same distribution gives the same placement.

Balance is a layer's max / mean rank load (its MoE step lasts as long as its busiest rank);
over the model, the sum of the layers' max rank loads over the sum of their means.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.eplb.distribution import ExpertDistribution
from engine.eplb.placement import ExpertPlacement, PlacementError

MAX_SWAPS_PER_LAYER = 1000  # the refinement ends well before on any real shape


@dataclass(frozen=True)
class LayerBalance:
    layer: int
    before: float  # max / mean rank load under the placement compared with
    after: float  # ... and under the new one
    replicated: tuple[int, ...]  # logical experts given more than one slot


@dataclass(frozen=True)
class BalanceReport:
    layers: tuple[LayerBalance, ...]
    before: float  # the model's: sum of the layers' max rank loads / sum of their means
    after: float


def rebalance(dist: ExpertDistribution, ep_size: int, slots_per_rank: int) -> ExpertPlacement:
    """A placement of `dist`'s model over `ep_size` ranks of `slots_per_rank` slots that balances
    `dist`'s load (PlacementError when the shape cannot hold every expert)."""
    experts = dist.num_experts
    if not experts <= ep_size * slots_per_rank <= experts * ep_size:
        raise PlacementError(
            f"--ep-size {ep_size} x --slots-per-rank {slots_per_rank} = "
            f"{ep_size * slots_per_rank} slots: need between the {experts} experts (one slot "
            f"each) and {experts * ep_size} (a copy of every expert on every rank)"
        )
    layers = []
    for load in dist.counts:
        copies = replicate(load, ep_size * slots_per_rank, ep_size)
        ranks = pack(load, copies, ep_size, slots_per_rank)
        refine(ranks, load, copies)
        layers.append(tuple(e for rank in ranks for e in sorted(rank)))
    return ExpertPlacement(experts, ep_size, slots_per_rank, dist.layer_ids, tuple(layers),
                           dist.model)  # fmt: skip


def replicate(load: Sequence[int], num_slots: int, max_copies: int) -> list[int]:
    """Copies per expert: one each, then each redundant slot to the expert with the heaviest
    copies (fewer copies, then the lower id, on a tie) that has fewer than `max_copies`."""
    copies = [1] * len(load)
    for _ in range(num_slots - len(load)):
        open_ = [e for e in range(len(load)) if copies[e] < max_copies]
        hottest = max(open_, key=lambda e: (load[e] / copies[e], -copies[e], -e))
        copies[hottest] += 1
    return copies


def pack(
    load: Sequence[int], copies: Sequence[int], ep_size: int, slots_per_rank: int
) -> list[list[int]]:
    """Each rank's experts: the copies, heaviest first, onto the least loaded rank with a free
    slot, preferring ranks without that expert."""
    items = sorted(
        ((load[e] / copies[e], e) for e in range(len(load)) for _ in range(copies[e])),
        key=lambda item: (-item[0], item[1]),
    )
    ranks: list[list[int]] = [[] for _ in range(ep_size)]
    rank_load = [0.0] * ep_size
    for weight, expert in items:
        free = [r for r in range(ep_size) if len(ranks[r]) < slots_per_rank]
        fresh = [r for r in free if expert not in ranks[r]] or free
        rank = min(fresh, key=lambda r: (rank_load[r], r))
        ranks[rank].append(expert)
        rank_load[rank] += weight
    return ranks


def refine(ranks: list[list[int]], load: Sequence[int], copies: Sequence[int]) -> None:
    """Swap copies between the busiest rank and another while that lowers the busier of the
    two; in place."""
    weight = [load[e] / copies[e] for e in range(len(load))]
    for _ in range(MAX_SWAPS_PER_LAYER):
        totals = [sum(weight[e] for e in rank) for rank in ranks]
        busiest = max(range(len(ranks)), key=lambda r: (totals[r], -r))
        best: tuple[float, int, int, int] | None = None  # (new max of the pair, rank, i, j)
        for other, rank in enumerate(ranks):
            if other == busiest:
                continue
            for i, a in enumerate(ranks[busiest]):
                for j, b in enumerate(rank):
                    if a == b or b in ranks[busiest] or a in rank:
                        continue
                    delta = weight[a] - weight[b]
                    pair_max = max(totals[busiest] - delta, totals[other] + delta)
                    if pair_max < totals[busiest] - 1e-9 and (best is None or pair_max < best[0]):
                        best = (pair_max, other, i, j)
        if best is None:
            return
        _, other, i, j = best
        ranks[busiest][i], ranks[other][j] = ranks[other][j], ranks[busiest][i]


def rank_loads(placement: ExpertPlacement, layer_index: int, load: Sequence[int]) -> list[float]:
    """Tokens each rank computes in one layer, a replicated expert's split among its copies."""
    copies = placement.copies(layer_index)
    loads = [0.0] * placement.ep_size
    for slot, expert in enumerate(placement.slot_experts[layer_index]):
        loads[slot // placement.slots_per_rank] += load[expert] / copies[expert]
    return loads


def compare(
    dist: ExpertDistribution, before: ExpertPlacement, after: ExpertPlacement
) -> BalanceReport:
    """Rank balance of `dist`'s load under both placements, per layer and over the model."""
    layers = []
    sums = {"before": [0.0, 0.0], "after": [0.0, 0.0]}  # [sum of max, sum of mean]
    for i, (layer, load) in enumerate(zip(dist.layer_ids, dist.counts, strict=True)):
        ratio = {}
        for name, placement in (("before", before), ("after", after)):
            loads = rank_loads(placement, i, load)
            mean = sum(loads) / len(loads)
            sums[name][0] += max(loads)
            sums[name][1] += mean
            ratio[name] = max(loads) / mean if mean else 1.0
        replicated = tuple(e for e, n in enumerate(after.copies(i)) if n > 1)
        layers.append(LayerBalance(layer, ratio["before"], ratio["after"], replicated))
    overall = {name: top / mean if mean else 1.0 for name, (top, mean) in sums.items()}
    return BalanceReport(tuple(layers), overall["before"], overall["after"])
