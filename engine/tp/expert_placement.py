"""Which routed experts each rank of a node holds under expert parallelism (`--ep-size N`).

An `ExpertLayout` gives each MoE layer its `ExpertSlots`: physical expert slots -> logical
experts (the ids the router picks). Rank r holds `slots_per_rank` slots of the layer's stacked
weights; its slot s is physical slot `r * slots_per_rank + s`, holding logical expert
`physical_to_logical[r * slots_per_rank + s]` whole (every row). A logical expert may have
several slots, on one rank or several (the copies of a hot expert that an expert-load balancer
places): a (token, expert) pair goes to copy `token % copies` of the expert, so its copies
share its tokens (engine/models/moe_dispatch.py).

`ExpertLayout.contiguous(layers, E, N, T)` is what `--ep-size N` gives a node of T ranks, every
layer alike: the experts cut into N blocks of E/N, rank r holding block r mod N. With N == T
every rank holds its own block (rank r: experts [r*E/N, (r+1)*E/N)); with N < T each block lives
on T/N ranks, one copy each. `ExpertLayout.from_placement` lays each layer out by an
expert-placement file (`--expert-placement`, engine/eplb/placement.py: per layer its own slots,
redundant copies included), on a node of as many ranks as the file's EP ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertSlots:
    """One MoE layer's physical slots -> logical experts."""

    num_experts: int  # logical experts, the router's
    num_ranks: int
    physical_to_logical: tuple[int, ...]  # rank-major: rank r's slots, then rank r+1's

    def __post_init__(self) -> None:
        slots = len(self.physical_to_logical)
        if self.num_ranks < 1 or slots % self.num_ranks:
            raise ValueError(
                f"an expert placement of {slots} physical slots cannot give {self.num_ranks} "
                "ranks the same number of slots each"
            )
        outside = [e for e in self.physical_to_logical if not 0 <= e < self.num_experts]
        if outside:
            raise ValueError(
                f"expert placement names experts {outside[:5]} outside [0, {self.num_experts})"
            )
        missing = sorted(set(range(self.num_experts)) - set(self.physical_to_logical))
        if missing:
            raise ValueError(f"expert placement gives experts {missing[:5]} no slot")

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int, num_ranks: int) -> ExpertSlots:
        """`--ep-size ep_size` over `num_ranks` ranks (the module docstring's blocks); the caller
        has checked that `ep_size` divides both."""
        block = num_experts // ep_size
        slots = (
            (rank % ep_size) * block + slot for rank in range(num_ranks) for slot in range(block)
        )
        return cls(num_experts, num_ranks, tuple(slots))

    @property
    def slots_per_rank(self) -> int:
        return len(self.physical_to_logical) // self.num_ranks

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """The logical expert in each of `rank`'s slots, in slot order."""
        start = rank * self.slots_per_rank
        return self.physical_to_logical[start : start + self.slots_per_rank]

    def local_slots(self, rank: int, expert: int) -> tuple[int, ...]:
        """`rank`'s slots that hold logical `expert` (none: only other ranks hold it)."""
        return tuple(s for s, e in enumerate(self.local_experts(rank)) if e == expert)

    def copies(self) -> tuple[tuple[int, ...], ...]:
        """Each logical expert's physical slots, in slot order."""
        slots: list[list[int]] = [[] for _ in range(self.num_experts)]
        for physical, expert in enumerate(self.physical_to_logical):
            slots[expert].append(physical)
        return tuple(tuple(s) for s in slots)


@dataclass(frozen=True)
class ExpertLayout:
    """Every MoE layer's slots on a node: `layers[i]` is MoE layer `layer_ids[i]`'s."""

    layer_ids: tuple[int, ...]
    layers: tuple[ExpertSlots, ...]

    def for_layer(self, layer_id: int) -> ExpertSlots:
        return self.layers[self.layer_ids.index(layer_id)]

    @property
    def slots_per_rank(self) -> int:
        """The most slots a rank holds in one layer (the memory planner's count)."""
        return max(slots.slots_per_rank for slots in self.layers)

    @classmethod
    def contiguous(
        cls, layer_ids: Sequence[int], num_experts: int, ep_size: int, num_ranks: int
    ) -> ExpertLayout:
        slots = ExpertSlots.contiguous(num_experts, ep_size, num_ranks)
        return cls(tuple(layer_ids), tuple(slots for _ in layer_ids))

    @classmethod
    def from_placement(
        cls,
        layer_ids: Sequence[int],
        num_experts: int,
        num_ranks: int,
        slot_experts: Sequence[Sequence[int]],
    ) -> ExpertLayout:
        """Per layer, the physical slots an expert-placement file lists (rank-major, as
        `ExpertPlacement.slot_experts` holds them)."""
        layers = (ExpertSlots(num_experts, num_ranks, tuple(s)) for s in slot_experts)
        return cls(tuple(layer_ids), tuple(layers))
