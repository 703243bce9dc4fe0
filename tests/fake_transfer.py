"""A transfer engine without peers, and the poll loop the real-engine tests wait with.

Kept apart from tests/helpers.py so that the processes the transfer tests spawn import no
more than the transfer layer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvtransfer.base import (
    KVTransferEngine,
    MemoryRegion,
    PeerInfo,
    TransferConfig,
    TransferHandle,
    TransferRange,
    TransferState,
)


class RecordingEngine(KVTransferEngine):
    """Remembers every write (`peer_ids`, and `writes`: its ranges) and says DONE at once."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__(TransferConfig(backend="recording", node_name="p"))
        self.peer_ids: list[str] = []
        self.writes: list[list[TransferRange]] = []

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        pass

    def local_endpoint(self) -> bytes:
        return b""

    def connect(self, peer: PeerInfo) -> None:
        pass

    def write(self, peer_id: str, ranges: Sequence[TransferRange]) -> TransferHandle:
        self.peer_ids.append(peer_id)
        self.writes.append(list(ranges))
        return TransferHandle()

    def poll(self, handle: TransferHandle) -> TransferState:
        return TransferState.DONE

    def release(self, handle: TransferHandle) -> None:
        pass

    def close(self) -> None:
        pass


def wait_settled(
    engine: KVTransferEngine, handle: TransferHandle, timeout: float = 30.0
) -> TransferState:
    """Poll `handle` until its write is DONE or FAILED (TimeoutError after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while (state := engine.poll(handle)) is TransferState.PENDING:
        if time.monotonic() > deadline:
            raise TimeoutError(f"write still pending after {timeout} s")
        time.sleep(0.001)
    return state
