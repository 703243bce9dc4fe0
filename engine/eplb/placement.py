"""Where the experts live under expert parallelism: per MoE layer, the logical expert held in
each physical slot. The slots are split evenly over the EP ranks, rank-major (slot s is on rank
s // slots_per_rank); slots beyond the experts hold redundant copies of hot experts, among
which the tokens routed to such an expert are split.

The file (JSON; balance.py writes it, a node reads it with `--expert-placement FILE`):

    {"format": "pdserve-expert-placement", "version": 1, "model": "Qwen3-30B-A3B",
     "num_experts": 128, "ep_size": 8, "slots_per_rank": 18,
     "layers": [{"layer": 0, "ranks": [[0, 5, 17, ...], [1, 2, 40, ...], ...]}, ...]}

`ranks[r][i]` is the logical expert in rank r's slot i. A node checks the placement against its
model at start (`check_model`): every MoE layer placed, every logical expert in at least one
slot, as many slots on every rank. The expert-parallel code (`--ep-size`) lays the experts out
by it; with EP size 1 every expert is on the one rank and a placement changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.eplb.files import EPLBFileError, field, int_list, read_json, write_json
from engine.model_config import ModelConfig

FORMAT = "pdserve-expert-placement"
VERSION = 1


class PlacementError(EPLBFileError):
    """A placement that cannot be served; the message names the layer, rank or slot."""


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int  # logical experts of each MoE layer
    ep_size: int  # EP ranks
    slots_per_rank: int  # physical expert slots on each rank, redundant copies included
    layer_ids: tuple[int, ...]  # the model's MoE layers, in order
    slot_experts: tuple[tuple[int, ...], ...]  # per layer: the logical expert of each slot
    model: str = ""  # the model it was made for (informational)

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.slots_per_rank < 1:
            raise PlacementError(
                f"ep_size {self.ep_size} and slots_per_rank {self.slots_per_rank} must be >= 1"
            )
        if self.num_slots < self.num_experts:
            raise PlacementError(
                f"ep_size {self.ep_size} x slots_per_rank {self.slots_per_rank} = "
                f"{self.num_slots} slots for {self.num_experts} experts: every expert needs one"
            )
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise PlacementError(f"layer ids {list(self.layer_ids)} repeat a layer")
        if len(self.slot_experts) != len(self.layer_ids):
            raise PlacementError(
                f"{len(self.slot_experts)} slot lists for {len(self.layer_ids)} layers"
            )
        for layer, slots in zip(self.layer_ids, self.slot_experts, strict=True):
            self._check_layer(layer, slots)

    def _check_layer(self, layer: int, slots: tuple[int, ...]) -> None:
        if len(slots) != self.num_slots:
            raise PlacementError(
                f"layer {layer} has {len(slots)} slots, ep_size x slots_per_rank is "
                f"{self.num_slots}"
            )
        for slot, expert in enumerate(slots):
            if not 0 <= expert < self.num_experts:
                rank, index = divmod(slot, self.slots_per_rank)
                raise PlacementError(
                    f"layer {layer} rank {rank} slot {index}: expert {expert} is outside "
                    f"[0, {self.num_experts})"
                )
        missing = sorted(set(range(self.num_experts)) - set(slots))
        if missing:
            raise PlacementError(
                f"layer {layer}: logical experts {missing} have no slot; every expert needs "
                "at least one"
            )

    @property
    def num_slots(self) -> int:
        return self.ep_size * self.slots_per_rank

    @property
    def num_redundant(self) -> int:
        """Slots per layer that hold a second (or further) copy of an expert."""
        return self.num_slots - self.num_experts

    @property
    def slot_ranks(self) -> tuple[int, ...]:
        """The EP rank holding each physical slot (the same for every layer)."""
        return tuple(slot // self.slots_per_rank for slot in range(self.num_slots))

    def ranks(self, layer_index: int) -> tuple[tuple[int, ...], ...]:
        """Layer `layer_index`'s (an index into layer_ids) logical experts, per rank."""
        slots, size = self.slot_experts[layer_index], self.slots_per_rank
        return tuple(slots[r * size : (r + 1) * size] for r in range(self.ep_size))

    def copies(self, layer_index: int) -> tuple[int, ...]:
        """Per logical expert, its slots in layer `layer_index`."""
        held = [0] * self.num_experts
        for expert in self.slot_experts[layer_index]:
            held[expert] += 1
        return tuple(held)

    def check_model(self, config: ModelConfig, flag: str = "--expert-placement") -> None:
        """Refuse a placement made for another shape of model (PlacementError names `flag`,
        the model and what differs)."""
        moe = config.moe
        where = f"{flag}: model {config.model_path or config.architecture}"
        if moe is None:
            raise PlacementError(f"{where} has no mixture-of-experts layers to place")
        if moe.num_experts != self.num_experts:
            raise PlacementError(
                f"{where} has {moe.num_experts} experts per layer; the placement places "
                f"{self.num_experts}"
            )
        layers = sorted(moe.layers)
        if sorted(self.layer_ids) != layers:
            raise PlacementError(
                f"{where} has MoE layers {layers}; the placement places layers "
                f"{sorted(self.layer_ids)}"
            )

    @classmethod
    def contiguous(
        cls, layer_ids: Sequence[int], num_experts: int, ep_size: int, model: str = ""
    ) -> ExpertPlacement:
        """The default: rank r holds experts [r * E / ep_size, (r + 1) * E / ep_size), no
        copies."""
        if ep_size < 1 or num_experts % ep_size:
            raise PlacementError(
                f"ep_size {ep_size} must divide the {num_experts} experts to place them "
                "contiguously"
            )
        slots = tuple(range(num_experts))
        return cls(num_experts, ep_size, num_experts // ep_size, tuple(layer_ids),
                   tuple(slots for _ in layer_ids), model)  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "num_experts": self.num_experts,
            "ep_size": self.ep_size,
            "slots_per_rank": self.slots_per_rank,
            "layers": [
                {"layer": layer, "ranks": [list(r) for r in self.ranks(i)]}
                for i, layer in enumerate(self.layer_ids)
            ],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str) -> ExpertPlacement:
        """`raw` as `to_json` writes it; PlacementError names `where` and the layer or rank."""
        try:
            if raw.get("version") != VERSION:
                raise PlacementError(f"version {raw.get('version')!r}: this reads {VERSION}")
            ep_size = field(raw, "ep_size", int)
            slots_per_rank = field(raw, "slots_per_rank", int)
            layer_ids, slot_experts = [], []
            for i, entry in enumerate(field(raw, "layers", list)):
                if not isinstance(entry, dict):
                    raise PlacementError(f"layers[{i}] must be an object, got {entry!r}")
                layer = field(entry, "layer", int)
                ranks = _rank_slots(entry, layer, ep_size, slots_per_rank)
                layer_ids.append(layer)
                slot_experts.append(tuple(e for r in ranks for e in r))
            return cls(
                num_experts=field(raw, "num_experts", int),
                ep_size=ep_size,
                slots_per_rank=slots_per_rank,
                layer_ids=tuple(layer_ids),
                slot_experts=tuple(slot_experts),
                model=str(raw.get("model", "")),
            )
        except EPLBFileError as exc:
            raise PlacementError(f"{where}: {exc}") from None

    def write(self, path: Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> ExpertPlacement:
        return cls.from_json(read_json(path, "expert placement", FORMAT), str(path))


def _rank_slots(
    entry: dict[str, Any], layer: int, ep_size: int, slots_per_rank: int
) -> list[tuple[int, ...]]:
    """One layer's `ranks` lists: `ep_size` of them, `slots_per_rank` experts each."""
    ranks = field(entry, "ranks", list)
    if len(ranks) != ep_size:
        raise PlacementError(f"layer {layer} lists {len(ranks)} ranks, ep_size is {ep_size}")
    out = []
    for rank, slots in enumerate(ranks):
        experts = int_list(slots, f"layer {layer} rank {rank}")
        if len(experts) != slots_per_rank:
            raise PlacementError(
                f"layer {layer} rank {rank} has {len(experts)} slots, slots_per_rank is "
                f"{slots_per_rank}: every rank holds as many"
            )
        out.append(experts)
    return out
