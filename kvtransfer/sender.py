"""Per-request KV sender on the prefill node.

Maps the request's prompt pages onto the destination pages D published for the room, along the
KV-head routes between the two nodes' TP ranks (kvtransfer/head_routes.py: one descriptor per
page run with equal TP sizes, per page and run of heads otherwise), and tracks every write it
started so the request's pages are released only after every rank's engine finished reading them.
Rank 0's writes go to its engine directly; the other ranks' through `write_remote`, which
only a TP node's engine (engine/node/tp_transfer.py) can do.

With layer streaming (prefill_node/layer_stream.py) a chunk's pages go one layer group at a
time (`send_layers`, one call per group, the same pages each time) and count as sent once the
last group is out (`mark_sent`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtransfer.base import (
    KVTransferEngine,
    TransferHandle,
    TransferRange,
    TransferState,
)
from kvtransfer.head_routes import (
    HeadRoute,
    LayerSpan,
    WritePlan,
    route_pages,
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
    routes: list[HeadRoute]
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

    def dest_pages(self, lo: int, hi: int) -> Sequence[int]:
        """D's pages for prompt pages [lo, hi)."""
        return self.dest.page_ids[lo - self.first_page : hi - self.first_page]

    def send_pages(self, req_pages: Sequence[int], upto_page: int) -> None:
        """Send prompt pages [next_page, upto_page) from the request's page list."""
        upto_page = min(upto_page, self.num_prompt_pages)
        if upto_page <= self.next_page:
            return
        src = req_pages[self.next_page : upto_page]
        dst = self.dest_pages(self.next_page, upto_page)
        self._start_plan(route_pages(self.routes, src, dst))
        self.stats.pages += upto_page - self.next_page
        self.next_page = upto_page

    def send_layers(self, req_pages: Sequence[int], upto_page: int, span: LayerSpan) -> None:
        """Send layer span `span` of prompt pages [next_page, upto_page); `next_page` stays
        until `mark_sent`."""
        upto_page = min(upto_page, self.num_prompt_pages)
        if upto_page <= self.next_page:
            return
        src = req_pages[self.next_page : upto_page]
        dst = self.dest_pages(self.next_page, upto_page)
        self._start_plan(route_pages(self.routes, src, dst, span))

    def mark_sent(self, upto_page: int) -> None:
        """Every layer of prompt pages [next_page, upto_page) is out (`send_layers`)."""
        upto_page = min(upto_page, self.num_prompt_pages)
        if upto_page > self.next_page:
            self.stats.pages += upto_page - self.next_page
            self.next_page = upto_page

    def send_aux(self, src_addr: int, dst_addr: int, length: int) -> None:
        """Rank 0's aux slot into D rank 0's."""
        self._start_plan(
            {0: {self.dest.decode_node_id: [TransferRange(src_addr, dst_addr, length)]}}
        )

    def _start_plan(self, plan: WritePlan) -> None:
        for peer_id, ranges in plan.get(0, {}).items():
            self._handles.append(self.engine.write(peer_id, ranges))
        if any(rank != 0 for rank in plan):
            self._handles.append(self.engine.write_remote(plan))
        for by_peer in plan.values():
            for ranges in by_peer.values():
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
