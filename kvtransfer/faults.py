"""Fault injection for the transfer layer (off by default, testing only).

A wrapper engine chosen by `TransferConfig.fail_rate` / `aux_corrupt_rate` (the node flags
`--inject-transfer-failures` and `--inject-aux-corruption`):

- a write fails with probability `fail_rate`, so tests can show every request either completes
  correctly or ends with a clear error, and that no page leaks;
- a write into the peer's aux region (the first token and the room id, `kvtransfer.aux`) is
  corrupted with probability `aux_corrupt_rate`: the source slot is overwritten just before the
  real engine carries it to the decode node, alternately with another room's id (a mismatched,
  stale slot) and with random bytes (garbage). The decode node must refuse it.
"""

from __future__ import annotations

import ctypes
import os
import random
from collections.abc import Callable, Sequence

from kvtransfer.aux import AUX_DTYPE
from kvtransfer.base import (
    KVTransferEngine,
    MemoryRegion,
    PeerInfo,
    TransferHandle,
    TransferRange,
    TransferState,
)

_ROOM_OFFSET: int = AUX_DTYPE.fields["room"][1]  # type: ignore[index]
_ROOM_MASK = (1 << 63) - 1


class _FailedHandle(TransferHandle):
    pass


def corrupt_aux_slot(addr: int, length: int, garbage: bool) -> None:
    """Overwrite the aux slot at `addr` in this process's memory: random bytes, or the same
    slot naming another room (the room id + 1)."""
    if garbage:
        ctypes.memmove(addr, os.urandom(length), length)
        return
    room = ctypes.c_uint64.from_address(addr + _ROOM_OFFSET)
    room.value = (room.value + 1) & _ROOM_MASK or 1


class FaultInjectingEngine(KVTransferEngine):
    def __init__(
        self,
        inner: KVTransferEngine,
        fail_rate: float = 0.0,
        seed: int | None = None,
        aux_corrupt_rate: float = 0.0,
    ) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.stream_ordered = inner.stream_ordered
        self.notifies_completion = inner.notifies_completion
        self.cheap_poll = inner.cheap_poll
        self.concurrent_writes = inner.concurrent_writes
        self.fail_rate = fail_rate
        self.aux_corrupt_rate = aux_corrupt_rate
        self.injected = 0  # failed writes
        self.corrupted = 0  # corrupted aux slots
        self._rng = random.Random(seed)
        self._aux_regions: dict[str, MemoryRegion] = {}  # peer id -> its aux region

    def bind_completion(self, callback: Callable[[], None]) -> None:
        self.inner.bind_completion(callback)  # an injected failure is FAILED at once

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self.inner.register(regions)

    def local_endpoint(self) -> bytes:
        return self.inner.local_endpoint()

    def connect(self, peer: PeerInfo) -> None:
        self.inner.connect(peer)
        if "aux" in peer.regions:
            self._aux_regions[peer.node_id] = peer.regions["aux"]

    def write(self, peer_id: str, ranges: Sequence[TransferRange]) -> TransferHandle:
        if self._rng.random() < self.fail_rate:
            self.injected += 1
            return _FailedHandle()
        if self.aux_corrupt_rate > 0:
            self._maybe_corrupt_aux(peer_id, ranges)
        return self.inner.write(peer_id, ranges)

    def _maybe_corrupt_aux(self, peer_id: str, ranges: Sequence[TransferRange]) -> None:
        aux = self._aux_regions.get(peer_id)
        if aux is None:
            return
        for r in ranges:
            into_aux = aux.addr <= r.dst_addr < aux.addr + aux.length
            if into_aux and self._rng.random() < self.aux_corrupt_rate:
                corrupt_aux_slot(r.src_addr, r.length, garbage=self.corrupted % 2 == 1)
                self.corrupted += 1

    def poll(self, handle: TransferHandle) -> TransferState:
        if isinstance(handle, _FailedHandle):
            return TransferState.FAILED
        return self.inner.poll(handle)

    def release(self, handle: TransferHandle) -> None:
        if not isinstance(handle, _FailedHandle):
            self.inner.release(handle)

    def close(self) -> None:
        self.inner.close()
