"""Cluster shapes of a node budget: P prefill nodes and D decode nodes, or colocated nodes."""

from __future__ import annotations

from dataclasses import dataclass


class SplitError(ValueError):
    """Split options that name no cluster shape; the message names the flag."""


@dataclass(frozen=True)
class Split:
    prefill: int  # 0: colocated (every decode node prefills its own requests)
    decode: int

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        return f"colocated x{self.decode}" if self.colocated else f"{self.prefill}P{self.decode}D"


def parse_splits(text: str, budget: int) -> tuple[Split, ...]:
    """'1:1,1:2,2:1,colocated' (or 'all': every P:D of the budget plus colocated).

    'colocated' has `budget` nodes; '0:N' is a colocated cluster of N nodes.
    """
    if budget < 1:
        raise SplitError(f"--budget must be >= 1 node, got {budget}")
    if text == "all":
        shapes = [Split(p, budget - p) for p in range(1, budget)]
        return (*shapes, Split(0, budget))
    splits = []
    for item in text.split(","):
        item = item.strip()
        if item == "colocated":
            splits.append(Split(0, budget))
            continue
        try:
            p, d = (int(x) for x in item.split(":"))
        except ValueError:
            raise SplitError(f"--splits: {item!r} is not P:D (e.g. 1:2) or 'colocated'") from None
        if p < 0 or d < 1:
            raise SplitError(f"--splits: {item!r} needs P >= 0 (0: colocated) and D >= 1")
        splits.append(Split(p, d))
    return tuple(splits)
