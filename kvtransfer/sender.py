"""Per-request KV sender on the prefill node.

Maps the request's prompt pages onto the destination pages D published for the room, coalesces
contiguous runs into few descriptors, and tracks every write it started so the request's pages
are released only after the engine has finished reading them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtransfer.base import (
    KVTransferEngine,
    TransferHandle,
    TransferRange,
    TransferState,
    coalesce_pages,
)
from kvtransfer.room import RoomDestination


@dataclass
class SenderStats:
    pages: int = 0
    bytes: int = 0
    descriptors: int = 0


@dataclass
class KVSender:
    engine: KVTransferEngine
    dest: RoomDestination
    page_size: int
    page_bytes: int
    src_kv_base: int
    dst_kv_base: int
    next_page: int = -1  # next prompt page index to send
    stats: SenderStats = field(default_factory=SenderStats)
    _handles: list[TransferHandle] = field(default_factory=list)
    _failed: bool = False

    def __post_init__(self) -> None:
        self.next_page = self.first_page

    @property
    def first_page(self) -> int:
        """Prompt pages below this are already on the decode node (its prefix cache)."""
        return self.dest.cached_tokens // self.page_size

    @property
    def num_prompt_pages(self) -> int:
        return -(-self.dest.prompt_len // self.page_size)

    def send_pages(self, req_pages: Sequence[int], upto_page: int) -> None:
        """Send prompt pages [next_page, upto_page) from the request's page list."""
        upto_page = min(upto_page, self.num_prompt_pages)
        if upto_page <= self.next_page:
            return
        src = req_pages[self.next_page : upto_page]
        offset = self.first_page
        dst = self.dest.page_ids[self.next_page - offset : upto_page - offset]
        ranges = coalesce_pages(src, dst, self.page_bytes, self.src_kv_base, self.dst_kv_base)
        self._start(ranges)
        self.stats.pages += upto_page - self.next_page
        self.next_page = upto_page

    def send_aux(self, src_addr: int, dst_addr: int, length: int) -> None:
        self._start([TransferRange(src_addr, dst_addr, length)])

    def _start(self, ranges: list[TransferRange]) -> None:
        self._handles.append(self.engine.write(self.dest.decode_node_id, ranges))
        self.stats.descriptors += len(ranges)
        self.stats.bytes += sum(r.length for r in ranges)

    def poll(self) -> TransferState:
        """DONE when every write finished, FAILED once all settled and one failed."""
        pending = []
        for handle in self._handles:
            state = self.engine.poll(handle)
            if state is TransferState.PENDING:
                pending.append(handle)
                continue
            self._failed |= state is TransferState.FAILED
            self.engine.release(handle)
        self._handles = pending
        if pending:
            return TransferState.PENDING
        return TransferState.FAILED if self._failed else TransferState.DONE
