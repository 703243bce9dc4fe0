"""An expert distribution: how many (token, expert) routings each logical expert of each MoE
layer received over a span of time, as a node records it (recorder.py) and the placement tool
reads it (balance.py, cli.py).

The dump is JSON (`write` / `read`):

    {"format": "pdserve-expert-distribution", "version": 1,
     "model": "Qwen3-30B-A3B", "num_layers": 48, "num_experts": 128, "top_k": 8,
     "layer_ids": [0, 1, ...],         the model's MoE layers (dense layers are not listed)
     "tokens": 91234,                  tokens routed: the first row's sum / top_k
     "started_at": 1764..., "ended_at": 1764..., "seconds": 61.2,   unix time of the window
     "counts": [[412, 37, ...], ...]}  [num_layers][num_experts] (token, expert) routings

A token counts once per MoE layer for each of its top-k experts, prefill and decode alike;
prompt tokens served from the prefix cache run no router and do not count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.eplb.files import EPLBFileError, dumps, field, int_list, read_json, write_json

FORMAT = "pdserve-expert-distribution"
VERSION = 1


@dataclass(frozen=True)
class ExpertDistribution:
    model: str
    layer_ids: tuple[int, ...]  # the model's MoE layers, in order
    num_experts: int
    top_k: int
    counts: tuple[tuple[int, ...], ...]  # [layer][logical expert]: (token, expert) routings
    started_at: float  # unix seconds
    ended_at: float

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 0 < self.top_k <= self.num_experts:
            raise EPLBFileError(
                f"num_experts {self.num_experts} and top_k {self.top_k}: need "
                "1 <= top_k <= num_experts"
            )
        if len(self.counts) != len(self.layer_ids):
            raise EPLBFileError(
                f"counts has {len(self.counts)} rows for {len(self.layer_ids)} layer_ids"
            )
        for layer, row in zip(self.layer_ids, self.counts, strict=True):
            if len(row) != self.num_experts or min(row, default=0) < 0:
                raise EPLBFileError(
                    f"counts of layer {layer}: need {self.num_experts} counts >= 0, got {row}"
                )

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def tokens(self) -> int:
        """Tokens routed: every token passes every MoE layer, each to top_k experts."""
        return sum(self.counts[0]) // self.top_k if self.counts else 0

    @property
    def seconds(self) -> float:
        return self.ended_at - self.started_at

    def skew(self) -> tuple[float, ...]:
        """Per layer, max / mean routings over the logical experts (1.0: even; a layer that
        saw no token counts as even)."""
        return tuple(max_over_mean(row) for row in self.counts)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "layer_ids": list(self.layer_ids),
            "tokens": self.tokens,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "seconds": round(self.seconds, 3),
            "counts": [list(row) for row in self.counts],
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str) -> ExpertDistribution:
        """`raw` as written by `to_json`; EPLBFileError names `where` and the field."""
        try:
            if raw.get("version") != VERSION:
                raise EPLBFileError(f"version {raw.get('version')!r}: this reads {VERSION}")
            rows = field(raw, "counts", list)
            return cls(
                model=field(raw, "model", str),
                layer_ids=int_list(raw.get("layer_ids"), "field 'layer_ids'"),
                num_experts=field(raw, "num_experts", int),
                top_k=field(raw, "top_k", int),
                counts=tuple(int_list(row, f"counts row {i}") for i, row in enumerate(rows)),
                started_at=float(field(raw, "started_at", (int, float))),
                ended_at=float(field(raw, "ended_at", (int, float))),
            )
        except EPLBFileError as exc:
            raise EPLBFileError(f"{where}: {exc}") from None

    def to_text(self) -> str:
        return dumps(self.to_json())

    def write(self, path: Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> ExpertDistribution:
        return cls.from_json(read_json(path, "expert distribution", FORMAT), str(path))


def merge(dists: Sequence[ExpertDistribution]) -> ExpertDistribution:
    """The sum of distributions of one model (several nodes, or several windows): counts add up,
    the span covers them all. EPLBFileError when their shapes differ."""
    first = dists[0]
    shape = (first.model, first.layer_ids, first.num_experts, first.top_k)
    for dist in dists[1:]:
        if (dist.model, dist.layer_ids, dist.num_experts, dist.top_k) != shape:
            raise EPLBFileError(
                f"cannot add a distribution of {dist.model!r} ({dist.num_layers} MoE layers "
                f"{list(dist.layer_ids)}, {dist.num_experts} experts, top-{dist.top_k}) to one of "
                f"{first.model!r} ({first.num_layers} MoE layers {list(first.layer_ids)}, "
                f"{first.num_experts} experts, top-{first.top_k})"
            )
    counts = tuple(
        tuple(sum(column) for column in zip(*rows, strict=True))
        for rows in zip(*(d.counts for d in dists), strict=True)
    )
    return ExpertDistribution(
        first.model,
        first.layer_ids,
        first.num_experts,
        first.top_k,
        counts,
        min(d.started_at for d in dists),
        max(d.ended_at for d in dists),
    )


def max_over_mean(values: Sequence[float]) -> float:
    """max / mean of `values` (1.0 where they are all 0: nothing to balance)."""
    total = sum(values)
    return max(values) * len(values) / total if total else 1.0
