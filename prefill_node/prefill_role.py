"""The prefill node's PD life cycle, run on the engine thread around each scheduler step.

Queues of a prefill request (one bootstrap room each):

    bootstrap   waiting for the decode node's destination (pages + aux slot) via bootstrap;
                failed after `bootstrap_timeout_s`
    (scheduler) waiting -> running: chunked extend batches; after every chunk the finished
                full pages are written into D's pages (the partial last page waits for the
                last chunk); tokens D already caches are not sent
    inflight    first token sampled and written to D's aux slot; waiting until every write is
                confirmed, then the room is reported DONE to bootstrap and the Prefill call
                answered, and at the next step boundary the pages are released into the
                prefix cache

The writes are polled before every step and, while a step computes, between the model's layers
(`during_forward`): a request whose last writes end early in a long prefill step is reported
then, not when the step ends (on one CPU at 3 req/s the step's end came up to 3.9 s later).

KV pools in GPU memory: a step's kernels may still run when `after_step` sees it (a non-final
chunk samples nothing, so nothing waited for them), and a transfer engine copies on its own
streams (NIXL's UCX cuda_ipc), unordered with the compute stream: without a wait it sends pages
the chunk has not written yet (seen on one H200: prompts of 3+ chunks decoded wrongly from the
2nd token on, scripts/gpu/check_pd.py). `kv_ready` (the server passes a device synchronize for
CUDA) is called once per step before the first page of that step is handed to the engine.

A request that fails (D cancelled the room, D died, a write failed, the client aborted) leaves
the scheduler with its pages still held, waits in `inflight` until every write it started has
settled (a late write must not read pages handed to another request), then reports FAILED.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.metrics import PrefillMetrics
from engine.request import FinishReason, Req, TransferSummary
from engine.scheduler import Scheduler, StepOutput
from kvtransfer.aux import AuxBuffer, FirstToken
from kvtransfer.base import KVTransferEngine, PeerInfo, TransferError, TransferState
from kvtransfer.head_routes import HeadRouteError, NodeKV, RankKV, peer_ranks, plan_routes
from kvtransfer.room import RoomDestination, RoomLink, RoomMessage, RoomState, RoomStatus
from kvtransfer.sender import KVSender

logger = logging.getLogger("pdserve.prefill")


@dataclass(frozen=True)
class PrefillRoleConfig:
    bootstrap_timeout_s: float = 30.0  # wait this long for D's destination
    transfer_timeout_s: float = 300.0  # a started transfer must settle within this


@dataclass
class PrefillEntry:
    req: Req
    created: float = field(default_factory=time.monotonic)
    dest: RoomDestination | None = None
    sender: KVSender | None = None
    failure: str = ""  # set once the room is doomed; reported after writes settle
    failure_kind: str = ""  # metrics label: write_failed, transfer_timeout, lease_lost, ...
    inflight_since: float = 0.0
    epoch: int = 0  # the link's registration epoch when the room started
    reported: bool = False  # its end posted and answered; pages released at the step boundary

    def fail(self, kind: str, reason: str) -> None:
        """Doom the room (the first failure is the one reported)."""
        if not self.failure:
            self.failure, self.failure_kind = reason, kind


class PrefillRole:
    def __init__(
        self,
        config: PrefillRoleConfig,
        link: RoomLink,
        engine: KVTransferEngine,
        aux: AuxBuffer,
        kv: NodeKV,
        page_size: int,
        clock: Callable[[], float] = time.monotonic,
        metrics: PrefillMetrics | None = None,
        kv_ready: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.kv_ready = kv_ready  # waits until the last step's KV is in memory (GPU pools)
        self.metrics = metrics or PrefillMetrics()
        self.link = link
        self.engine = engine
        self.aux = aux
        self.kv = kv  # this node's KV shards (one per TP rank)
        self.page_size = page_size
        self.clock = clock
        self.inbox: queue.Queue[RoomMessage] = queue.Queue()
        self._wake: Callable[[], None] = lambda: None  # the engine loop's, once bound
        self.bootstrap: dict[int, PrefillEntry] = {}
        self.active: dict[int, PrefillEntry] = {}
        self.inflight: dict[int, PrefillEntry] = {}
        self._early: dict[int, tuple[RoomDestination, float]] = {}  # dest before the request

    # ---- engine-thread hooks -----------------------------------------------------------
    def accepts(self, req: Req) -> bool:
        return req.stop_after_prefill

    @property
    def has_work(self) -> bool:
        return bool(self.bootstrap or self.active or self.inflight or not self.inbox.empty())

    @property
    def needs_polling(self) -> bool:
        return bool(self.inflight)  # KV writes: only polling the engine sees them end

    def bind_wakeup(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def deliver(self, message: RoomMessage) -> None:
        """Called by the bootstrap link's thread: queue the message, wake the engine loop."""
        self.inbox.put(message)
        self._wake()

    def submit(self, scheduler: Scheduler, req: Req) -> None:
        entry = PrefillEntry(req, created=self.clock())
        self.bootstrap[req.room] = entry
        early = self._early.pop(req.room, None)
        if early is not None:
            self._on_destination(scheduler, early[0])

    def before_step(self, scheduler: Scheduler) -> list[StepOutput]:
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(message, RoomDestination):  # P gets no statuses or answers
                self._on_destination(scheduler, message)
        outputs = self._expire_bootstrap()
        outputs += self._poll_inflight(scheduler)
        return outputs

    def after_step(self, scheduler: Scheduler) -> None:
        finishing = {id(r) for r in scheduler.prefilled}
        if self.active:
            self.kv_ready()  # this step's KV is written before any of it is sent
        for entry in list(self.active.values()):
            if entry.failure or id(entry.req) in finishing:  # sent whole by _finish_prefill
                continue
            if self._fenced(entry):
                self._doom(scheduler, entry, "lease_lost", self._fence_reason())
                continue
            assert entry.sender is not None
            started = entry.sender.stats.pages > 0
            try:
                entry.sender.send_pages(entry.req.pages, entry.req.kv_len // self.page_size)
            except TransferError as exc:
                self._doom(scheduler, entry, "write_failed", f"KV write failed: {exc}")
                continue
            if not started and entry.sender.stats.pages:  # first pages out: D resets its timer
                self._post(entry.req, RoomState.TRANSFERRING, "")
        for req in list(scheduler.prefilled):
            done = self.active.get(req.room)
            if done is not None and done.req is req:
                self._finish_prefill(scheduler, done)
        self.metrics.observe_queues(len(self.bootstrap), len(self.active), len(self.inflight))

    def during_forward(self, scheduler: Scheduler) -> list[StepOutput]:
        """Report the rooms whose writes all landed; their pages stay held until the step
        ends (`before_step` releases them). Failures wait for `before_step` too."""
        outputs = []
        for entry in self.inflight.values():
            if entry.reported or entry.failure or entry.sender is None:
                continue
            if entry.sender.poll() is TransferState.DONE and not self._fenced(entry):
                outputs.append(self._report(entry))
        return outputs

    def queue_summary(self) -> str:
        return f"#bootstrap-req {len(self.bootstrap)}, #inflight-req {len(self.inflight)}"

    def abort(self, scheduler: Scheduler, rid: str) -> Req | None:
        for entries in (self.bootstrap, self.active):
            for entry in entries.values():
                if entry.req.rid == rid:
                    self._fail_entry(scheduler, entry, "aborted", "aborted by the client")
                    return entry.req
        return None

    # ---- destinations ------------------------------------------------------------------
    def _on_destination(self, scheduler: Scheduler, dest: RoomDestination) -> None:
        entry = self.bootstrap.get(dest.room) or self.active.get(dest.room)
        if dest.cancelled:
            self._on_cancel(scheduler, dest, entry)
            return
        if dest.room in self.active or dest.room in self.inflight:
            return  # a replay: bootstrap delivers destinations at least once
        if entry is None:
            self._early[dest.room] = (dest, self.clock())
            return
        if dest.decode_node_id != entry.req.peer_node_id:
            self._fail_entry(
                scheduler,
                entry,
                "wrong_decode_node",
                f"destination from decode node {dest.decode_node_id}, "
                f"expected {entry.req.peer_node_id}",
            )
            return
        self._start(scheduler, entry, dest)

    def _on_cancel(
        self, scheduler: Scheduler, dest: RoomDestination, entry: PrefillEntry | None
    ) -> None:
        reason = f"decode node {dest.decode_node_id} gave the room up"
        if entry is not None:
            self._fail_entry(scheduler, entry, "decode_cancelled", reason)
        elif dest.room in self.inflight:  # writes may be pending: report after they settle
            self.inflight[dest.room].fail("decode_cancelled", reason)
        else:  # never started: confirm at once that nothing will be written
            self._early.pop(dest.room, None)
            self._confirm_unused(dest, "cancelled before the prefill request arrived")

    def _start(self, scheduler: Scheduler, entry: PrefillEntry, dest: RoomDestination) -> None:
        peer = self.link.peer(dest.decode_node_id)
        if peer is None or "kv" not in peer.regions:
            self._fail_entry(
                scheduler,
                entry,
                "decode_gone",
                f"decode node {dest.decode_node_id} is not registered",
            )
            return
        try:
            routes = plan_routes(self.kv.ranks, self._peer_kv(peer))
            for rank_peer in peer.rank_peers():  # every TP rank of D, from every rank of ours
                self.engine.connect(rank_peer)
        except HeadRouteError as exc:
            self._fail_entry(scheduler, entry, "layout_mismatch", str(exc))
            return
        except TransferError as exc:
            self._fail_entry(
                scheduler, entry, "decode_unreachable", f"cannot reach decode node: {exc}"
            )
            return
        entry.dest = dest
        entry.epoch = self.link.epoch
        entry.sender = KVSender(self.engine, dest, self.page_size, routes)
        del self.bootstrap[dest.room]
        self.active[dest.room] = entry
        timing = entry.req.timing
        timing.mark("destination")
        self.metrics.bootstrap_wait.observe(timing.span("arrived", "destination"))
        scheduler.add_request(entry.req)

    def _peer_kv(self, peer: PeerInfo) -> list[RankKV]:
        return peer_ranks(peer, self.kv.num_kv_heads, self.kv.head_page_bytes)

    # ---- finishing ---------------------------------------------------------------------
    def _finish_prefill(self, scheduler: Scheduler, entry: PrefillEntry) -> None:
        """First token sampled: send the rest of the pages and the aux slot."""
        req, dest, sender = entry.req, entry.dest, entry.sender
        assert dest is not None and sender is not None and req.slot is not None
        scheduler.prefilled.remove(req)
        scheduler.parked.append(req)
        req.timing.mark("first_token")
        if self._fenced(entry):
            entry.fail("lease_lost", self._fence_reason())
            self._to_inflight(entry)
            return
        first = FirstToken(
            room=req.room,
            token=req.output_ids[0],
            logprob=req.output_logprobs[0],
            top_logprobs=req.output_top_logprobs[0],
            cached_tokens=req.cached_tokens,
        )
        self.aux.write(req.slot, first)
        peer = self.link.peer(dest.decode_node_id)
        try:
            sender.send_pages(req.pages, sender.num_prompt_pages)
            if peer is None:
                raise TransferError(f"decode node {dest.decode_node_id} left")
            dst_aux = peer.regions["aux"].addr + dest.aux_slot * self.aux.slot_bytes()
            sender.send_aux(self.aux.slot_addr(req.slot), dst_aux, self.aux.slot_bytes())
        except TransferError as exc:
            entry.fail("write_failed", f"KV write failed: {exc}")
        self._to_inflight(entry)

    def _to_inflight(self, entry: PrefillEntry) -> None:
        self.active.pop(entry.req.room, None)
        self.bootstrap.pop(entry.req.room, None)
        entry.inflight_since = self.clock()
        self.inflight[entry.req.room] = entry

    def _poll_inflight(self, scheduler: Scheduler) -> list[StepOutput]:
        outputs = []
        for room, entry in list(self.inflight.items()):
            if not entry.reported:
                if not self._writes_settled(entry):
                    continue
                outputs.append(self._report(entry))
            del self.inflight[room]
            req = entry.req
            if req in scheduler.parked:
                scheduler.parked.remove(req)
            scheduler.kv.release(req, cache=not entry.failure)
        return outputs

    def _writes_settled(self, entry: PrefillEntry) -> bool:
        """False while a write is pending (past the timeout the room is doomed, pages held)."""
        state = entry.sender.poll() if entry.sender else TransferState.DONE
        if state is TransferState.FAILED:
            entry.fail("write_failed", "KV write to the decode node failed")
        if state is not TransferState.PENDING:
            return True
        overdue = self.clock() - entry.inflight_since >= self.config.transfer_timeout_s
        if overdue and not entry.failure:
            entry.fail("transfer_timeout", "KV transfer timed out")
            room = entry.req.room
            logger.error("room %d: transfer pending past the timeout; holding pages", room)
        return False

    def _report(self, entry: PrefillEntry) -> StepOutput:
        """Every write settled: post the room's end to bootstrap, finish the request (pages
        still held)."""
        req = entry.req
        if not entry.failure and self._fenced(entry):  # D may have freed the pages meanwhile
            entry.fail("lease_lost", self._fence_reason())
        if entry.sender is not None:
            stats = entry.sender.stats
            req.transfer = TransferSummary(stats.pages, stats.bytes, stats.descriptors)
        self._count(entry)
        self._post(req, RoomState.FAILED if entry.failure else RoomState.DONE, entry.failure)
        entry.reported = True
        if entry.failure:
            req.finish_reason = FinishReason.ABORT
            req.finish_detail = self._describe(req, entry.failure)
            logger.warning("%s", req.finish_detail, extra={"room": req.room})
        else:
            req.finish_reason = FinishReason.PREFILLED
        return StepOutput(req, [], True)

    def _count(self, entry: PrefillEntry) -> None:
        req, m = entry.req, self.metrics
        req.timing.mark("transfer_done")
        if entry.failure:
            m.rooms.labels("failed").inc()
            m.failures.labels(entry.failure_kind or "other").inc()
            return
        m.rooms.labels("done").inc()
        m.transfer_seconds.observe(req.timing.span("first_token", "transfer_done"))
        if req.transfer is not None:
            m.transfer_bytes.inc(req.transfer.bytes)
            m.transfer_pages.inc(req.transfer.pages)
            m.transfer_descriptors.inc(req.transfer.descriptors)
        logger.debug(
            "room %d: %d prompt tokens (%d cached) prefilled, KV sent to decode node %s",
            req.room,
            len(req.prompt_ids),
            req.cached_tokens,
            req.peer_node_id,
            extra={"room": req.room},
        )

    def _fenced(self, entry: PrefillEntry) -> bool:
        return entry.epoch != self.link.epoch or not self.link.lease_ok()

    @staticmethod
    def _fence_reason() -> str:
        return "this prefill node lost its bootstrap lease (missed heartbeats): writes stopped"

    def _post(self, req: Req, state: RoomState, reason: str) -> None:
        self.link.post_status(
            RoomStatus(req.room, self.link.node_id, req.peer_node_id, state, reason)
        )

    def _describe(self, req: Req, failure: str) -> str:
        nodes = f"prefill node {self.link.node_id} -> decode node {req.peer_node_id}"
        return f"room {req.room} ({nodes}): {failure}"

    def _doom(self, scheduler: Scheduler, entry: PrefillEntry, kind: str, reason: str) -> None:
        """Stop computing for a room whose writes may still be in flight."""
        entry.fail(kind, reason)
        req = scheduler.detach(entry.req.rid)
        if req is not None:
            scheduler.parked.append(req)
        self._to_inflight(entry)

    def _fail_entry(
        self, scheduler: Scheduler, entry: PrefillEntry, kind: str, reason: str
    ) -> None:
        if entry.req.room in self.bootstrap:  # nothing computed, nothing written
            del self.bootstrap[entry.req.room]
            entry.fail(kind, reason)
            self.inflight[entry.req.room] = entry
            entry.inflight_since = self.clock()
            return
        self._doom(scheduler, entry, kind, reason)

    def _expire_bootstrap(self) -> list[StepOutput]:
        now = self.clock()
        for room, entry in list(self.bootstrap.items()):
            if now - entry.created > self.config.bootstrap_timeout_s:
                del self.bootstrap[room]
                entry.fail(
                    "bootstrap_timeout",
                    f"no destination from decode node {entry.req.peer_node_id} within "
                    f"{self.config.bootstrap_timeout_s:.1f} s (bootstrap timeout)",
                )
                entry.inflight_since = now
                self.inflight[room] = entry
        for room, (dest, seen) in list(self._early.items()):
            if now - seen > self.config.bootstrap_timeout_s:
                del self._early[room]
                self._confirm_unused(dest, "no prefill request for this room arrived")
        return []

    def _confirm_unused(self, dest: RoomDestination, reason: str) -> None:
        """Tell D that this node will never write into the room's pages, so it may free them."""
        self.link.post_status(
            RoomStatus(dest.room, self.link.node_id, dest.decode_node_id, RoomState.FAILED, reason)
        )
