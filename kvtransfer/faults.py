"""Fault injection for the transfer layer (off by default): a wrapper engine whose writes fail
with a set probability, so tests can show every request either completes correctly or ends with
a clear error, and that no page leaks. Chosen by `TransferConfig.fail_rate`."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvtransfer.base import (
    KVTransferEngine,
    MemoryRegion,
    PeerInfo,
    TransferHandle,
    TransferRange,
    TransferState,
)


class _FailedHandle(TransferHandle):
    pass


class FaultInjectingEngine(KVTransferEngine):
    def __init__(self, inner: KVTransferEngine, fail_rate: float, seed: int | None = None) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.fail_rate = fail_rate
        self.injected = 0
        self._rng = random.Random(seed)

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self.inner.register(regions)

    def local_endpoint(self) -> bytes:
        return self.inner.local_endpoint()

    def connect(self, peer: PeerInfo) -> None:
        self.inner.connect(peer)

    def write(self, peer_id: str, ranges: Sequence[TransferRange]) -> TransferHandle:
        if self._rng.random() < self.fail_rate:
            self.injected += 1
            return _FailedHandle()
        return self.inner.write(peer_id, ranges)

    def poll(self, handle: TransferHandle) -> TransferState:
        if isinstance(handle, _FailedHandle):
            return TransferState.FAILED
        return self.inner.poll(handle)

    def release(self, handle: TransferHandle) -> None:
        if not isinstance(handle, _FailedHandle):
            self.inner.release(handle)

    def close(self) -> None:
        self.inner.close()
