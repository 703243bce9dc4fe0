"""A prefill room's writes into its decode node's memory, apart from the room's phases.

`open` connects to every TP rank of D (from every rank of this node) and plans which of our KV
heads go to which of its ranks (`kvtransfer/head_routes.py`); `send_computed` writes the full
pages a chunk finished; `send_rest`, once the first token is sampled, the partial last page
and the aux slot (the first token, its logprobs and the cached-prefix length). Every call
returns at once: the transfer engine settles the writes later, and the room polls its sender.

With staging pages (`stager`, engine/memory/staging.py) a write whose pages form more runs
than the stager's threshold is gathered first into the room's staging span (taken at its first
staged write, for the rest of the prompt, and held until the room's writes settled:
`release_staging`), and written from there: one descriptor per run of destination pages.
Staging needs whole pages on both sides (TP size 1 here, and D's ranks holding every KV head).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.memory.staging import PageStager
from engine.metrics import PrefillMetrics
from engine.request import Req
from kvtransfer.aux import AuxBuffer, FirstToken
from kvtransfer.base import KVTransferEngine, TransferError
from kvtransfer.head_routes import HeadRouteError, NodeKV, peer_ranks, plan_routes
from kvtransfer.room import RoomDestination, RoomLink
from kvtransfer.sender import KVSender


class CannotWrite(Exception):
    """A room's writes cannot start; `kind` is its metrics label."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


class RoomWriter:
    def __init__(
        self,
        engine: KVTransferEngine,
        aux: AuxBuffer,
        kv: NodeKV,
        page_size: int,
        link: RoomLink,
        stager: PageStager | None = None,
        metrics: PrefillMetrics | None = None,
    ) -> None:
        self.metrics = metrics or PrefillMetrics()
        self.engine = engine
        self.aux = aux
        self.kv = kv  # this node's KV shards (one per TP rank)
        self.page_size = page_size
        self.link = link
        self.stager = stager if len(kv.ranks) == 1 else None  # gathers on rank 0 alone

    def open(self, dest: RoomDestination) -> KVSender:
        """A sender into `dest`; raises CannotWrite if D is not registered (decode_gone), the
        two KV layouts do not fit (layout_mismatch) or D is unreachable (decode_unreachable)."""
        peer = self.link.peer(dest.decode_node_id)
        if peer is None or "kv" not in peer.regions:
            raise CannotWrite("decode_gone", f"decode node {dest.decode_node_id} is not registered")
        try:
            ranks = peer_ranks(peer, self.kv.num_kv_heads, self.kv.head_page_bytes)
            routes = plan_routes(self.kv.ranks, ranks)
            for rank_peer in peer.rank_peers():
                self.engine.connect(rank_peer)
        except HeadRouteError as exc:
            raise CannotWrite("layout_mismatch", str(exc)) from exc
        except TransferError as exc:
            raise CannotWrite("decode_unreachable", f"cannot reach decode node: {exc}") from exc
        return KVSender(self.engine, dest, self.page_size, routes)

    def send_computed(self, req: Req, sender: KVSender) -> None:
        """Write the full pages computed so far (those not streamed by layer group already).
        Raises TransferError."""
        upto = req.kv_len // self.page_size
        sender.send_pages(self._source_pages(req, sender, upto), upto)

    def send_rest(self, req: Req, dest: RoomDestination, sender: KVSender) -> None:
        """First token sampled: the prompt's remaining pages, then the aux slot. Raises
        TransferError."""
        assert req.slot is not None
        first = FirstToken(
            room=req.room,
            token=req.output_ids[0],
            logprob=req.output_logprobs[0],
            top_logprobs=req.output_top_logprobs[0],
            cached_tokens=req.cached_tokens,
        )
        self.aux.write(req.slot, first)
        peer = self.link.peer(dest.decode_node_id)
        upto = sender.num_prompt_pages
        sender.send_pages(self._source_pages(req, sender, upto), upto)
        if peer is None:
            raise TransferError(f"decode node {dest.decode_node_id} left")
        dst_aux = peer.regions["aux"].addr + dest.aux_slot * self.aux.slot_bytes()
        sender.send_aux(self.aux.slot_addr(req.slot), dst_aux, self.aux.slot_bytes())

    def _source_pages(self, req: Req, sender: KVSender, upto: int) -> Sequence[int]:
        """The page list to send prompt pages [next_page, upto) from: the request's own, or
        with those pages gathered into its staging span (see the module docstring)."""
        lo, hi = sender.next_page, min(upto, sender.num_prompt_pages)
        stager = self.stager
        if stager is None or hi <= lo or not all(r.whole_pages for r in sender.routes):
            return req.pages
        src = req.pages[lo:hi]
        if not stager.worth_staging(src, sender.dest_pages(lo, hi)):
            return req.pages
        if req.staging is None:
            req.staging = stager.area.acquire(sender.num_prompt_pages - sender.first_page)
            if req.staging is None:  # every span in use: write from the pool pages
                self.metrics.staging_full.inc()
                return req.pages
        offset = lo - sender.first_page
        stager.gather(src, req.staging, offset)
        self.metrics.staged_pages.inc(len(src))
        staged = list(req.pages)
        staged[lo:hi] = req.staging.ids(offset, offset + hi - lo)
        return staged

    def release_staging(self, req: Req) -> None:
        """The room's writes settled: nothing reads its staging span any more."""
        if req.staging is not None and self.stager is not None:
            self.stager.area.release(req.staging)
            req.staging = None
