"""Layer groups of an extend forward: telling the caller when a group of layers wrote its KV.

A prefill node streams a chunk's KV to its decode node one layer group at a time while the chunk
still computes (prefill_node/layer_stream.py). The engine's part is small:

- `split_layers` cuts the decoder layers into G consecutive groups (sizes differ by one at most,
  the larger first);
- a `LayerStream` set on the runner (`ModelRunner.layer_stream`) is asked, for every extend
  batch it builds, for a callback (`begin`; None: nothing of this batch is streamed, no cost);
- `LayerGroupSignal` is the batch's `after_layer`: after the last layer of each group it calls
  that callback once, in group order, with a `GroupDone`.

On the CPU the layers have run when the callback runs: the group's KV is in memory. On a GPU
they only queued kernels: `GroupDone.event` is a CUDA event recorded on the compute stream after
the group's last layer, and whoever moves the KV waits on it (a side stream's `wait_event`, or
`synchronize` / `query` on the host). Decode batches (and so CUDA graphs) never get a signal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.request import Req


def split_layers(num_layers: int, groups: int) -> tuple[range, ...]:
    """`groups` consecutive ranges covering layers [0, num_layers), the larger ones first."""
    if not 1 <= groups <= num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {groups} groups: use 1..{num_layers}"
        )
    size, extra = divmod(num_layers, groups)
    bounds, start = [], 0
    for g in range(groups):
        stop = start + size + (1 if g < extra else 0)
        bounds.append(range(start, stop))
        start = stop
    return tuple(bounds)


@dataclass(frozen=True)
class GroupDone:
    """Layer group `index` (layers `layers`) of the current forward wrote its KV, or, with
    `event`, will have once the event has passed."""

    index: int
    layers: range
    event: torch.cuda.Event | None = None

    def ready(self) -> bool:
        """True once the group's KV is in memory (always on the CPU)."""
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        """Block the calling thread until the group's KV is in memory."""
        if self.event is not None:
            self.event.synchronize()


GroupCallback = Callable[[GroupDone], None]


@dataclass(frozen=True)
class LayerStream:
    """What a runner needs to signal layer groups: the groups, and per extend batch (its
    requests and their new tokens, KV lengths still those before the forward) the callback
    for its groups, or None when nothing of the batch is streamed."""

    groups: tuple[range, ...]
    begin: Callable[[Sequence[Req], Sequence[int]], GroupCallback | None]


class LayerGroupSignal:
    """A batch's `after_layer`: calls `on_group` after each group's last layer."""

    def __init__(
        self, groups: Sequence[range], on_group: GroupCallback, device: torch.device
    ) -> None:
        self.groups = tuple(groups)
        self.on_group = on_group
        self.on_gpu = device.type == "cuda"
        self._group_of_last = {g.stop - 1: i for i, g in enumerate(self.groups)}

    def __call__(self, layer: int) -> None:
        index = self._group_of_last.get(layer)
        if index is None:
            return
        event = None
        if self.on_gpu:
            event = torch.cuda.Event()
            event.record()  # on the current (compute) stream, after the group's kernels
        self.on_group(GroupDone(index, self.groups[index], event))
