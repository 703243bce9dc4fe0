"""The collectives a tensor-parallel node needs, over torch.distributed.

Two process groups: `tensor` (gloo on CPU, NCCL on GPU) for the activations (all-reduce after
the row-parallel layers, all-gather of the vocabulary-parallel logits, all-to-all of the rows
that expert parallelism sends to the experts' ranks), and `control` (always
gloo, CPU tensors) for the scheduler's step messages and the MIN-reductions of transfer
states. `TPGroup.single()` is the TP=1 group: every collective is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInit:
    """How one rank joins its node's group (built by the process that spawns the ranks)."""

    tp_size: int
    rank: int
    init_method: str  # e.g. tcp://127.0.0.1:PORT, chosen by rank 0
    device: str  # "cpu" or "cuda:<rank>"
    timeout_s: float = 120.0


class TPGroup:
    def __init__(self, rank: int, size: int, tensor_group: Any = None, control: Any = None):
        self.rank = rank
        self.size = size
        self._tensor = tensor_group
        self._control = control

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @classmethod
    def join(cls, init: TPInit) -> TPGroup:
        """Blocks until every rank of the node has joined."""
        backend = "nccl" if init.device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(init.device)  # NCCL binds each rank to its current device
        timeout = timedelta(seconds=init.timeout_s)
        dist.init_process_group(
            backend,
            init_method=init.init_method,
            rank=init.rank,
            world_size=init.tp_size,
            timeout=timeout,
        )
        control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
        return cls(init.rank, init.tp_size, dist.group.WORLD, control or dist.group.WORLD)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the partial outputs of a row-parallel layer, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self._tensor)
        return x

    def gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's `x[..., :sizes[rank]]` along the last dimension (uneven
        splits are padded to the largest, as the collectives need equal shapes)."""
        if self.size == 1:
            return x
        width = max(sizes)
        if x.shape[-1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self._tensor)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)

    def all_to_all_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Block j of `counts` (`size` equal blocks) to rank j; returns block i of every rank i,
        in rank order (how many rows each rank will send here)."""
        if self.size == 1:
            return counts
        out = torch.empty_like(counts)
        dist.all_to_all_single(out, counts.contiguous(), group=self._tensor)
        return out

    def all_to_all_rows(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """`x`'s rows in consecutive runs of `send[j]` to rank j; returns the `recv[i]` rows from
        each rank i, in rank order (gloo has uneven all_to_all_single on CPU, NCCL on GPU)."""
        if self.size == 1:
            return x
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self._tensor)
        return out

    def broadcast_control(self, x: torch.Tensor) -> None:
        """Rank 0's CPU int64 tensor into every rank's `x` (same shape on all ranks)."""
        dist.broadcast(x, src=0, group=self._control)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order (over the control group)."""
        if self.size == 1:
            return [data]
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.size)]
        dist.all_gather(sizes, size, group=self._control)
        width = int(max(s.item() for s in sizes))
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self._control)
        return [bytes(p[: int(n.item())].tolist()) for p, n in zip(parts, sizes, strict=True)]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (ordered states agree by MIN)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control)
        return int(t.item())

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
