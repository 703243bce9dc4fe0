"""Typed messages from a node's rank 0 (which runs the scheduler) to its other ranks.

On the wire a message is two broadcasts over the control group: a fixed-size int64 header
`[kind, n_arrays, len_0, ..., len_{n-1}]` and one int64 payload with the arrays end to end.
Each message kind is a dataclass with `to_arrays` / `from_arrays`; nothing is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from engine.forward_batch import ForwardMode
from engine.tp.group import TPGroup

_HEADER_LEN = 32


class MessageKind(IntEnum):
    STOP = 0
    FORWARD = 1
    # KV transfer on every rank (engine/node/tp_transfer.py on rank 0, tp_agent.py on the others)
    TRANSFER_SETUP = 2
    TRANSFER_CONNECT = 3
    TRANSFER_WRITE = 4
    TRANSFER_POLL = 5
    TRANSFER_RELEASE = 6


@dataclass
class ForwardStep:
    """One forward as rank 0 built it; the other ranks rebuild the batch from this."""

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64, CPU
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_slots: list[int]
    seq_lens: list[int]
    extend_lens: list[int]
    # req_to_token[slot, :seq_len] of each request, end to end: a rank's table then matches
    # rank 0's for these rows even where rank 0 filled it without a forward (prefix-cache
    # hits, pages a prefill node wrote).
    table_rows: torch.Tensor

    def to_arrays(self) -> list[torch.Tensor]:
        meta = torch.tensor([1 if self.mode is ForwardMode.DECODE else 0], dtype=torch.int64)
        lists = [
            torch.tensor(v, dtype=torch.int64)
            for v in (self.req_slots, self.seq_lens, self.extend_lens)
        ]
        return [meta, self.input_ids, self.positions, self.out_cache_loc, *lists, self.table_rows]

    @classmethod
    def from_arrays(cls, arrays: list[torch.Tensor]) -> ForwardStep:
        meta, ids, pos, locs, slots, seqs, exts, rows = arrays
        mode = ForwardMode.DECODE if int(meta[0]) else ForwardMode.EXTEND
        return cls(mode, ids, pos, locs, slots.tolist(), seqs.tolist(), exts.tolist(), rows)


def send(group: TPGroup, kind: MessageKind, arrays: list[torch.Tensor]) -> None:
    if len(arrays) > _HEADER_LEN - 2:
        raise ValueError(f"a TP message holds at most {_HEADER_LEN - 2} arrays, got {len(arrays)}")
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = int(kind), len(arrays)
    for i, a in enumerate(arrays):
        header[2 + i] = a.numel()
    group.broadcast_control(header)
    if arrays:
        payload = torch.cat([a.reshape(-1).to("cpu", torch.int64) for a in arrays])
        group.broadcast_control(payload)


def receive(group: TPGroup) -> tuple[MessageKind, list[torch.Tensor]]:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    group.broadcast_control(header)
    kind, count = MessageKind(int(header[0])), int(header[1])
    sizes = header[2 : 2 + count].tolist()
    if not count:
        return kind, []
    payload = torch.empty(sum(sizes), dtype=torch.int64)
    group.broadcast_control(payload)
    return kind, list(payload.split(sizes))


def bytes_to_array(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.int64)


def array_to_bytes(array: torch.Tensor) -> bytes:
    return bytes(array.to(torch.uint8).tolist())
