"""The prefill node's PD life cycle, run on the engine thread around each scheduler step.

A room moves through the phases of `prefill_node/rooms.py` (BOOTSTRAP -> ACTIVE -> SETTLING ->
REPORTED -> gone); this module makes the moves. The scheduler sees the request only while it is
ACTIVE (waiting/running there) and holds it parked, pages kept, from its first token (or its
failure) until the room is released.

The writes are polled before every step, at the end of each step (`after_step`: a room whose
last writes landed while its first token was written is reported in the step that sampled it)
and, while a step computes, between the model's layers (`during_forward`): a request whose last
writes end early in a long prefill step is reported then, not when the step ends (on one CPU at
3 req/s the step's end came up to 3.9 s later). An idle loop with writes in flight polls after
a pause that grows with the youngest settling room's age (50 us to 1 ms, `poll_pause_s`), or
sooner when a transfer engine that says when a write ends (Mooncake) wakes it.

KV pools in GPU memory: a step's kernels may still run when `after_step` sees it (a non-final
chunk samples nothing, so nothing waited for them), and a transfer engine copies on its own
streams (NIXL's UCX cuda_ipc), unordered with the compute stream: without a wait it sends pages
the chunk has not written yet (seen on one H200: prompts of 3+ chunks decoded wrongly from the
2nd token on, scripts/gpu/check_pd.py). `kv_ready` (the server passes a device synchronize for
CUDA) is called once per step before the first page of that step is handed to the engine; a
room whose pages all went out during the forward (layer streaming) posts its aux slot (host
memory) before that wait.

With `stream` (`--kv-stream-layers G`), a chunk's pages are written layer group by layer group
while the chunk computes (prefill_node/layer_stream.py), from inside the forward; `after_step`
then finds them sent, and dooms the rooms whose streamed write could not start.

A request that fails (D cancelled the room, D died, a write failed, the client aborted) stays
parked with its pages until every write it started has settled (a late write must not read
pages handed to another request), then reports FAILED.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.memory.staging import PageStager
from engine.metrics import PrefillMetrics
from engine.node.phases import RoomRole
from engine.request import FinishReason, Req, TransferSummary
from engine.scheduler import Scheduler, StepOutput
from kvtransfer.aux import AuxBuffer
from kvtransfer.base import KVTransferEngine, TransferError, TransferState
from kvtransfer.head_routes import NodeKV
from kvtransfer.room import RoomDestination, RoomLink, RoomState, RoomStatus
from kvtransfer.sender import KVSender
from prefill_node.layer_stream import LayerStreamer, StreamConfig
from prefill_node.rooms import PREFILL_MOVES, EarlyDestinations, PrefillEntry, PrefillPhase
from prefill_node.writes import CannotWrite, RoomWriter

logger = logging.getLogger("pdserve.prefill")

BOOTSTRAP, ACTIVE, SETTLING, REPORTED = PrefillPhase
FENCED = "this prefill node lost its bootstrap lease (missed heartbeats): writes stopped"


@dataclass(frozen=True)
class PrefillRoleConfig:
    bootstrap_timeout_s: float = 30.0  # wait this long for D's destination
    transfer_timeout_s: float = 300.0  # a started transfer must settle within this
    # Polling writes in flight (an engine that does not say when a write ends): the pause
    # grows with the youngest settling room's age (`poll_growth` of it), from `poll_min_s` to
    # `poll_max_s`: a room's last writes are seen ending within ~a quarter of their time,
    # with ~12 polls per room before the pause reaches 1 ms.
    poll_min_s: float = 50e-6
    poll_max_s: float = 1e-3
    poll_growth: float = 0.25


class PrefillRole(RoomRole[PrefillPhase, PrefillEntry]):
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
        stager: PageStager | None = None,
        stream: StreamConfig | None = None,
    ) -> None:
        super().__init__(PREFILL_MOVES, clock)
        self.config = config
        self.kv_ready = kv_ready  # waits until the last step's KV is in memory (GPU pools)
        self.metrics = metrics or PrefillMetrics()
        self.link = link
        self.writer = RoomWriter(engine, aux, kv, page_size, link, stager, self.metrics)
        self.early = EarlyDestinations()
        # Layer-group streaming of a chunk's KV; the engine loop sets `layer_stream` on the
        # runner while this role is bound.
        self.streamer = LayerStreamer(stream, self._streamable) if stream else None
        self.layer_stream = self.streamer.layer_stream() if self.streamer else None

    # ---- engine-thread hooks -----------------------------------------------------------
    def accepts(self, req: Req) -> bool:
        return req.stop_after_prefill

    def bind_wakeup(self, wake: Callable[[], None]) -> None:
        super().bind_wakeup(wake)
        self.writer.engine.bind_completion(wake)  # an engine that says when a write ends

    @property
    def poll_pause_s(self) -> float | None:
        """KV writes in flight: only polling the engine sees them end (see PrefillRoleConfig);
        a REPORTED room's pages go back at the next step."""
        config, settling = self.config, self.rooms.in_phase(SETTLING)
        if not settling:
            return config.poll_min_s if self.rooms.in_phase(REPORTED) else None
        engine = self.writer.engine
        if engine.notifies_completion or not engine.cheap_poll:  # woken, or polls cost
            return config.poll_max_s
        youngest = self.clock() - max(e.since for e in settling)
        return min(max(youngest * config.poll_growth, config.poll_min_s), config.poll_max_s)

    def submit(self, scheduler: Scheduler, req: Req) -> None:
        self.rooms.add(PrefillEntry(req, BOOTSTRAP, self.clock()))
        early = self.early.take(req.room)
        if early is not None:
            self._on_destination(scheduler, early)

    def before_step(self, scheduler: Scheduler) -> list[StepOutput]:
        for message, _ in self.received():
            if isinstance(message, RoomDestination):  # P gets no statuses or answers
                self._on_destination(scheduler, message)
        self._expire_bootstrap()
        return self._release_settled(scheduler)

    def after_step(self, scheduler: Scheduler) -> list[StepOutput]:
        """Write what the step computed; report at once the rooms whose writes all landed
        already (a first token's aux slot written by the time it returns, the KV streamed
        during the forward)."""
        if self.streamer is not None:
            self.streamer.finish()  # a forward's last group, held back on a GPU (layer_stream.py)
        self._take_stream_failures()
        finished = scheduler.take_prefilled()
        for req in finished:  # the prompt's last forward ended (sampled), before `kv_ready`
            req.timing.mark("first_token")  # waits for KV copies streamed on other streams
        sampled = self._active_rooms(finished)
        # A streamed prompt's pages all went out during the forward: its aux slot (the first
        # token, in host memory) needs no wait for the GPU and goes at once.
        for entry in sampled:
            if entry.sender is not None and entry.sender.all_pages_sent:
                self._finish_prefill(entry)
        active = self.rooms.in_phase(ACTIVE)
        if active:
            self.kv_ready()  # this step's KV is written before any of it is sent
        finishing = {id(e.req) for e in sampled}
        for entry in active:
            if id(entry.req) not in finishing:  # those are sent whole by _finish_prefill
                self._send_chunk(scheduler, entry)
        for entry in sampled:
            if entry.phase is ACTIVE:
                self._finish_prefill(entry)
        landed = self._report_landed()
        counts = self.rooms.counts()
        inflight = counts[SETTLING] + counts[REPORTED]
        self.metrics.observe_queues(counts[BOOTSTRAP], counts[ACTIVE], inflight)
        return landed

    def during_forward(self, scheduler: Scheduler) -> list[StepOutput]:
        return self._report_landed()

    def _active_rooms(self, reqs: list[Req]) -> list[PrefillEntry]:
        """The rooms of `reqs` that are still ACTIVE (not failed meanwhile)."""
        found = [(req, self.rooms.get(req.room)) for req in reqs]
        return [e for req, e in found if e is not None and e.req is req and e.phase is ACTIVE]

    def _report_landed(self) -> list[StepOutput]:
        """Report the rooms whose writes all landed; their pages stay held until the next
        `before_step` releases them (not during a forward, nor before the step's end).
        Failures wait for `before_step` too."""
        outputs = []
        for entry in self.rooms.in_phase(SETTLING):
            if entry.failure or entry.sender is None:
                continue
            if entry.sender.poll() is TransferState.DONE and not self._fenced(entry):
                outputs.append(self._report(entry))
        return outputs

    def load_queues(self) -> tuple[int, int]:
        """(rooms whose writes are in flight, rooms waiting for a destination): the load
        the node reports in its heartbeats (called from the node's event loop)."""
        counts = self.rooms.counts()
        return counts[SETTLING] + counts[REPORTED], counts[BOOTSTRAP]

    def queue_summary(self) -> str:
        inflight, waiting = self.load_queues()
        return f"#bootstrap-req {waiting}, #inflight-req {inflight}"

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()

    def abort(self, scheduler: Scheduler, rid: str) -> Req | None:
        entry = self.rooms.find(rid)
        if entry is None or entry.phase not in (BOOTSTRAP, ACTIVE):
            return None
        self._fail_entry(scheduler, entry, "aborted", "aborted by the client")
        return entry.req

    # ---- BOOTSTRAP -> ACTIVE -------------------------------------------------------------
    def _on_destination(self, scheduler: Scheduler, dest: RoomDestination) -> None:
        entry = self.rooms.get(dest.room)
        if dest.cancelled:
            self._on_cancel(scheduler, dest, entry)
        elif entry is None:
            self.early.hold(dest, self.clock())
        elif entry.phase is not BOOTSTRAP:
            return  # a replay: bootstrap delivers destinations at least once
        elif dest.decode_node_id != entry.req.peer_node_id:
            reason = (
                f"destination from decode node {dest.decode_node_id}, "
                f"expected {entry.req.peer_node_id}"
            )
            self._fail_entry(scheduler, entry, "wrong_decode_node", reason)
        else:
            self._start(scheduler, entry, dest)

    def _on_cancel(
        self, scheduler: Scheduler, dest: RoomDestination, entry: PrefillEntry | None
    ) -> None:
        reason = f"decode node {dest.decode_node_id} gave the room up"
        if entry is None:  # never started: confirm at once that nothing will be written
            self.early.take(dest.room)
            self._confirm_unused(dest, "cancelled before the prefill request arrived")
        elif entry.phase in (BOOTSTRAP, ACTIVE):
            self._fail_entry(scheduler, entry, "decode_cancelled", reason)
        else:  # writes may be pending: report after they settle
            entry.fail("decode_cancelled", reason)

    def _start(self, scheduler: Scheduler, entry: PrefillEntry, dest: RoomDestination) -> None:
        try:
            sender = self.writer.open(dest)
        except CannotWrite as exc:
            self._fail_entry(scheduler, entry, exc.kind, str(exc))
            return
        entry.dest, entry.sender, entry.epoch = dest, sender, self.link.epoch
        self.rooms.move(entry, ACTIVE)
        timing = entry.req.timing
        timing.mark("destination")
        self.metrics.bootstrap_wait.observe(timing.span("arrived", "destination"))
        scheduler.add_request(entry.req)

    # ---- ACTIVE -> SETTLING ----------------------------------------------------------------
    def _send_chunk(self, scheduler: Scheduler, entry: PrefillEntry) -> None:
        """After a non-final chunk: write the full pages computed so far."""
        assert entry.sender is not None
        if self._fenced(entry):
            self._doom(scheduler, entry, "lease_lost", FENCED)
            return
        if entry.failure:  # a streamed write could not start
            self._doom(scheduler, entry, entry.failure_kind, entry.failure)
            return
        try:
            self.writer.send_computed(entry.req, entry.sender)
        except TransferError as exc:
            self._doom(scheduler, entry, "write_failed", f"KV write failed: {exc}")
            return
        if not entry.announced and entry.sender.stats.pages > 0:  # D restarts its timer
            entry.announced = True
            self._post(entry.room, entry.req.peer_node_id, RoomState.TRANSFERRING, "")

    def _finish_prefill(self, entry: PrefillEntry) -> None:
        """First token sampled (the scheduler parked the request): send the rest."""
        assert entry.dest is not None and entry.sender is not None
        entry.req.timing.mark("first_token")
        if self._fenced(entry):
            entry.fail("lease_lost", FENCED)
        elif not entry.failure:  # a streamed write that could not start failed it already
            try:
                self.writer.send_rest(entry.req, entry.dest, entry.sender)
            except TransferError as exc:
                entry.fail("write_failed", f"KV write failed: {exc}")
        self.rooms.move(entry, SETTLING)

    def _streamable(self, req: Req) -> KVSender | None:
        """The sender of `req`'s room while its pages may be streamed (layer_stream.py)."""
        entry = self.rooms.get(req.room)
        if entry is None or entry.req is not req or entry.phase is not ACTIVE:
            return None
        if entry.failure or self._fenced(entry):
            return None
        return entry.sender

    def _take_stream_failures(self) -> None:
        if self.streamer is None:
            return
        for room, reason in self.streamer.take_failures().items():
            entry = self.rooms.get(room)
            if entry is not None:
                entry.fail("write_failed", reason)

    def _doom(self, scheduler: Scheduler, entry: PrefillEntry, kind: str, reason: str) -> None:
        """Stop computing for a room whose writes may still be in flight: park its pages."""
        entry.fail(kind, reason)
        scheduler.park(entry.req)
        self.rooms.move(entry, SETTLING)

    def _fail_entry(
        self, scheduler: Scheduler, entry: PrefillEntry, kind: str, reason: str
    ) -> None:
        if entry.phase is BOOTSTRAP:  # nothing computed, nothing written
            entry.fail(kind, reason)
            self.rooms.move(entry, SETTLING)
        else:
            self._doom(scheduler, entry, kind, reason)

    # ---- SETTLING -> REPORTED -> gone ------------------------------------------------------
    def _release_settled(self, scheduler: Scheduler) -> list[StepOutput]:
        outputs = []
        for entry in self.rooms.in_phase(SETTLING, REPORTED):
            if entry.phase is SETTLING:
                if not self._writes_settled(entry):
                    continue
                outputs.append(self._report(entry))
            self.rooms.move(entry, None)
            self.writer.release_staging(entry.req)  # with its pages: no write reads either
            scheduler.release(entry.req, cache=not entry.failure)
        return outputs

    def _writes_settled(self, entry: PrefillEntry) -> bool:
        """False while a write is pending (past the timeout the room is doomed, pages held)."""
        state = entry.sender.poll() if entry.sender else TransferState.DONE
        if state is TransferState.FAILED:
            entry.fail("write_failed", "KV write to the decode node failed")
        if state is not TransferState.PENDING:
            return True
        overdue = self.clock() - entry.since >= self.config.transfer_timeout_s
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
            entry.fail("lease_lost", FENCED)
        if entry.sender is not None:
            stats = entry.sender.stats
            req.transfer = TransferSummary(
                stats.pages, stats.bytes, stats.descriptors, stats.page_id_writes
            )
        req.timing.mark("transfer_done")
        self.metrics.count_room(req, (entry.failure_kind or "other") if entry.failure else None)
        state = RoomState.FAILED if entry.failure else RoomState.DONE
        self._post(req.room, req.peer_node_id, state, entry.failure)
        self.rooms.move(entry, REPORTED)
        if entry.failure:
            nodes = f"prefill node {self.link.node_id} -> decode node {req.peer_node_id}"
            req.finish_reason = FinishReason.ABORT
            req.finish_detail = f"room {req.room} ({nodes}): {entry.failure}"
            logger.warning("%s", req.finish_detail, extra={"room": req.room})
        else:
            req.finish_reason = FinishReason.PREFILLED
            logger.debug(
                "room %d: %d prompt tokens (%d cached) prefilled, KV sent to decode node %s",
                *(req.room, len(req.prompt_ids), req.cached_tokens, req.peer_node_id),
                extra={"room": req.room},
            )
        return StepOutput(req, [], True)

    def _expire_bootstrap(self) -> None:
        now, timeout = self.clock(), self.config.bootstrap_timeout_s
        for entry in self.rooms.in_phase(BOOTSTRAP):
            if now - entry.since > timeout:
                reason = (
                    f"no destination from decode node {entry.req.peer_node_id} within "
                    f"{timeout:.1f} s (bootstrap timeout)"
                )
                entry.fail("bootstrap_timeout", reason)
                self.rooms.move(entry, SETTLING)
        for dest in self.early.expired(now, timeout):
            self._confirm_unused(dest, "no prefill request for this room arrived")

    def _fenced(self, entry: PrefillEntry) -> bool:
        """Bootstrap may have declared this node dead since the room started: write no more."""
        return entry.epoch != self.link.epoch or not self.link.lease_ok()

    def _post(self, room: int, decode_node_id: str, state: RoomState, reason: str) -> None:
        self.link.post_status(RoomStatus(room, self.link.node_id, decode_node_id, state, reason))

    def _confirm_unused(self, dest: RoomDestination, reason: str) -> None:
        """Tell D that this node will never write into the room's pages, so it may free them."""
        self._post(dest.room, dest.decode_node_id, RoomState.FAILED, reason)
