"""Per-request KV sender on the prefill node.

Maps the request's prompt pages onto the destination pages D published for the room, along the
KV-head routes between the two nodes' TP ranks (kvtransfer/head_routes.py: one descriptor per
page run with equal TP sizes, per page and run of heads otherwise), and tracks every write it
started so the request's pages are released only after every rank's engine finished reading them.
Rank 0's writes go to its engine directly; the other ranks' through `write_remote`, which
only a TP node's engine (engine/node/tp_transfer.py) can do. Whole pages between two nodes of
one rank each (the common case) go by page ids, `write_pages`: no range object per page on the
host (for 256 scattered pages, building the ranges took longer than cuda_ipc's whole write).

With layer streaming (prefill_node/layer_stream.py) a chunk's pages go one layer group at a
time (`send_layers`, one call per group, the same pages each time) and count as sent once the
last group is out (`mark_sent`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtransfer.base import (
    KVTransferEngine,
    TransferHandle,
    TransferRange,
    TransferState,
    total_bytes,
)
from kvtransfer.head_routes import (
    HeadRoute,
    LayerSpan,
    WritePlan,
    route_pages,
)
from kvtransfer.room import RoomDestination


def page_runs(src: Sequence[int], dst: Sequence[int]) -> int:
    """Runs of pages contiguous on both sides: the ranges `coalesce_pages` would make."""
    if not len(src):
        return 0
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    return 1 + int(np.count_nonzero((np.diff(s) != 1) | (np.diff(d) != 1)))


@dataclass
class SenderStats:
    pages: int = 0
    bytes: int = 0
    descriptors: int = 0
    page_id_writes: int = 0  # writes issued by page ids (`write_pages`), not ranges


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

    @property
    def all_pages_sent(self) -> bool:
        """Every prompt page D lacks has been handed to the engine (maybe not landed yet)."""
        return self.next_page >= self.num_prompt_pages

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
        whole = self.routes[0] if len(self.routes) == 1 else None
        if whole is not None and whole.whole_pages and whole.src.tp_rank == 0:
            self._start_pages(whole, src, dst)
        else:
            self._start_plan(route_pages(self.routes, src, dst))
        self.stats.pages += upto_page - self.next_page
        self.next_page = upto_page

    def _start_pages(self, route: HeadRoute, src: Sequence[int], dst: Sequence[int]) -> None:
        """Whole pages from rank 0 into one decode rank: by page ids (`write_pages`), which a
        backend may plan without a range object per page (cuda_ipc does)."""
        src_kv, dst_kv = route.src, route.dst
        self._handles.append(
            self.engine.write_pages(
                dst_kv.peer_id, src, dst, src_kv.page_bytes, src_kv.kv_base, dst_kv.kv_base
            )
        )
        self.stats.descriptors += page_runs(src, dst)
        self.stats.page_id_writes += 1
        self.stats.bytes += len(src) * src_kv.page_bytes

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
                self.stats.bytes += total_bytes(ranges)

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
