"""Counting what the routers choose: per MoE layer, per logical expert, the (token, expert)
routings of every forward, prefill and decode.

`ExpertLoadCounter` hooks each MoE layer's router (`TopKRouter.record`, engine/models/moe.py):
the chosen expert ids are added into a [layers, experts] int64 tensor on the model's device
with one scatter-add per layer, so counting costs no host sync and no kernel beyond that one;
`read` copies the table to the host when someone asks (a metrics scrape, an admin call). The
counts only grow, from the model's load on. A CUDA graph that captures a router would count its
padding rows too: MoE models run no decode graphs yet (engine/models/moe.py).

`ExpertDistributionRecorder` is a window over the counter: `start` notes the counts and the
time, `dump` (or `stop`) returns what the counts gained since, as an `ExpertDistribution`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from engine.eplb.distribution import ExpertDistribution
from engine.models.moe import SparseMoEBlock


class ExpertLoadCounter:
    """Monotonic (token, expert) routings per MoE layer and logical expert of one model."""

    def __init__(
        self, layer_ids: tuple[int, ...], num_experts: int, top_k: int, device: torch.device
    ) -> None:
        self.layer_ids = layer_ids
        self.num_experts = num_experts
        self.top_k = top_k
        self.counts = torch.zeros(len(layer_ids), num_experts, dtype=torch.int64, device=device)
        self._one = torch.ones(1, dtype=torch.int64, device=device)

    @classmethod
    def attach(cls, model: nn.Module) -> ExpertLoadCounter | None:
        """A counter fed by every MoE layer's router of `model` (None: no MoE layer)."""
        blocks = [
            (layer_id, layer.mlp)
            for layer_id, layer in enumerate(getattr(model, "layers", ()))
            if isinstance(layer.mlp, SparseMoEBlock)
        ]
        if not blocks:
            return None
        moe = blocks[0][1].gate.moe
        device = blocks[0][1].gate.weight.device
        counter = cls(tuple(i for i, _ in blocks), moe.num_experts, moe.top_k, device)
        for row, (_, block) in zip(counter.counts, blocks, strict=True):
            block.gate.record = counter._recorder(row)
        return counter

    def _recorder(self, row: torch.Tensor) -> Callable[[torch.Tensor], None]:
        one = self._one

        def record(ids: torch.Tensor) -> None:
            flat = ids.flatten()
            row.scatter_add_(0, flat, one.expand(flat.numel()))

        return record

    def read(self) -> list[list[int]]:
        """The counts now, [layer][expert], on the host (waits for the device's queued work
        when called on the thread that runs the model)."""
        return self.counts.cpu().tolist()  # type: ignore[no-any-return]


class RecordingError(RuntimeError):
    """A recorder asked for a window it does not have."""


class ExpertDistributionRecorder:
    """Windows over an `ExpertLoadCounter`: one at a time, started and stopped at will."""

    def __init__(
        self, counter: ExpertLoadCounter, model: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.counter = counter
        self.model = model
        self._clock = clock
        self._start: tuple[list[list[int]], float] | None = None  # (counts, time) at start
        self._last: ExpertDistribution | None = None  # the last stopped window

    @property
    def recording(self) -> bool:
        return self._start is not None

    def start(self) -> None:
        """Begin a new window (one under way is dropped)."""
        self._start = (self.counter.read(), self._clock())

    def stop(self) -> ExpertDistribution:
        """End the window; `dump` returns it until the next `start`."""
        self._last = self._window()
        self._start = None
        return self._last

    def dump(self) -> ExpertDistribution:
        """The window so far (recording), or the last one stopped."""
        if self._start is not None:
            return self._window()
        if self._last is None:
            raise RecordingError("nothing recorded yet: start a recording first")
        return self._last

    def _window(self) -> ExpertDistribution:
        if self._start is None:
            raise RecordingError("not recording: start a recording first")
        base, started_at = self._start
        now = self.counter.read()
        counter = self.counter
        counts = tuple(
            tuple(n - b for n, b in zip(row, base_row, strict=True))
            for row, base_row in zip(now, base, strict=True)
        )
        return ExpertDistribution(self.model, counter.layer_ids, counter.num_experts,
                                  counter.top_k, counts, started_at, self._clock())  # fmt: skip
