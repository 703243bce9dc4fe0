"""The aux slot: the first sampled token and its metadata, written by P next to the KV pages.

Each decode request owns one slot (its request-table slot). P fills a slot of its own staging
buffer and writes it into D's slot with the last transfer. D checks `magic` and `room` before
trusting the token: a slot that does not carry this room's id is a corrupted or stale write.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP = 20
AUX_MAGIC = 0x50445356  # "PDSV"

AUX_DTYPE = np.dtype(
    [
        ("magic", "<u4"),
        ("token", "<i4"),
        ("room", "<u8"),
        ("logprob", "<f4"),
        ("has_logprob", "<i4"),
        ("cached_tokens", "<i4"),
        ("num_top", "<i4"),
        ("top_ids", "<i4", (MAX_TOP,)),
        ("top_logprobs", "<f4", (MAX_TOP,)),
    ],
    align=True,
)


class AuxMismatchError(ValueError):
    """The aux slot does not hold this room's first token."""


@dataclass(frozen=True)
class FirstToken:
    room: int
    token: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    cached_tokens: int  # prefix-cache hits on the prefill node


class AuxBuffer:
    """A registered array of aux slots."""

    def __init__(self, num_slots: int) -> None:
        self.slots = np.zeros(num_slots, dtype=AUX_DTYPE)

    @property
    def addr(self) -> int:
        return int(self.slots.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.slots.nbytes)

    @staticmethod
    def slot_bytes() -> int:
        return AUX_DTYPE.itemsize

    def slot_addr(self, slot: int) -> int:
        return self.addr + slot * AUX_DTYPE.itemsize

    def write(self, slot: int, first: FirstToken) -> None:
        entry = self.slots[slot]
        entry["magic"] = AUX_MAGIC
        entry["room"] = first.room
        entry["token"] = first.token
        entry["has_logprob"] = first.logprob is not None
        entry["logprob"] = first.logprob or 0.0
        entry["cached_tokens"] = first.cached_tokens
        top = first.top_logprobs or []
        entry["num_top"] = len(top) if first.top_logprobs is not None else -1
        for i, (tid, lp) in enumerate(top[:MAX_TOP]):
            entry["top_ids"][i] = tid
            entry["top_logprobs"][i] = lp

    def clear(self, slot: int) -> None:
        self.slots[slot] = np.zeros((), dtype=AUX_DTYPE)

    def read(self, slot: int, room: int) -> FirstToken:
        entry = self.slots[slot]
        if int(entry["magic"]) != AUX_MAGIC or int(entry["room"]) != room:
            raise AuxMismatchError(
                f"aux slot {slot} holds room {int(entry['room'])} (magic {int(entry['magic']):#x}),"
                f" expected room {room}: corrupted or stale first-token write"
            )
        num_top = int(entry["num_top"])
        top = None
        if num_top >= 0:
            top = [
                (int(entry["top_ids"][i]), float(entry["top_logprobs"][i])) for i in range(num_top)
            ]
        return FirstToken(
            room=room,
            token=int(entry["token"]),
            logprob=float(entry["logprob"]) if int(entry["has_logprob"]) else None,
            top_logprobs=top,
            cached_tokens=int(entry["cached_tokens"]),
        )
