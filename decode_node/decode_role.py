"""The decode node's PD life cycle, run on the engine thread around each scheduler step.

Queues of a disaggregated decode request (one bootstrap room each):

    prealloc    waiting for KV pages: admitted when the pool can hold the prompt plus
                `decode_headroom` tokens while keeping a page for every decoding request
    transfer    pages reserved and published to bootstrap as the room's destination; waiting
                for the prefill node to report DONE (then the aux slot is checked and the
                request joins the running batch with no prefill forward) or FAILED; when
                this node registers again (bootstrap restarted: it forgot the rooms), rooms
                published before fail at once and go to quarantine
    quarantine  given up (client abort or `transfer_timeout_s`), or failed by bootstrap with
                `may_still_write` (P declared dead while its process may be frozen), while P
                may still be writing: the client has its error, but the pages stay held until
                bootstrap says no write can land any more (never delivered, P confirmed it
                stopped, or P's process is gone). If no answer comes (bootstrap restarted and
                forgot the room), the pages are freed after another `transfer_timeout_s`.

Requests without a room prefill locally (colocated): they go straight to the scheduler.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.metrics import DecodeMetrics
from engine.request import FinishReason, Req
from engine.scheduler import Scheduler, StepOutput
from kvtransfer.aux import AuxBuffer, AuxMismatchError
from kvtransfer.room import (
    FailRoomAnswer,
    LinkReset,
    RoomDestination,
    RoomLink,
    RoomMessage,
    RoomState,
    RoomStatus,
)

logger = logging.getLogger("pdserve.decode")


@dataclass(frozen=True)
class DecodeRoleConfig:
    decode_headroom: int = 32  # tokens of decode room required beside the prompt to admit
    transfer_timeout_s: float = 300.0  # published (or last progress from P) -> DONE


@dataclass
class DecodeEntry:
    req: Req
    created: float = field(default_factory=time.monotonic)
    published: float = 0.0
    epoch: int = 0  # the link's registration when the destination was published


class DecodeRole:
    def __init__(
        self,
        config: DecodeRoleConfig,
        link: RoomLink,
        aux: AuxBuffer,
        page_size: int,
        clock: Callable[[], float] = time.monotonic,
        metrics: DecodeMetrics | None = None,
    ) -> None:
        self.config = config
        self.link = link
        self.aux = aux
        self.page_size = page_size
        self.clock = clock
        self.metrics = metrics or DecodeMetrics()
        self.inbox: queue.Queue[RoomMessage] = queue.Queue()
        self._wake: Callable[[], None] = lambda: None  # the engine loop's, once bound
        self._kv_arrived: dict[int, float] = {}  # room -> when P's DONE came (link thread)
        self.prealloc: deque[DecodeEntry] = deque()
        self.transfer: dict[int, DecodeEntry] = {}
        self.quarantine: dict[int, DecodeEntry] = {}

    def accepts(self, req: Req) -> bool:
        return req.room != 0

    @property
    def has_work(self) -> bool:
        return bool(self.prealloc or self.transfer or self.quarantine or not self.inbox.empty())

    @property
    def needs_polling(self) -> bool:
        return False  # every change comes as a message or a timeout

    def bind_wakeup(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def submit(self, scheduler: Scheduler, req: Req) -> None:
        self.prealloc.append(DecodeEntry(req, created=self.clock()))

    def deliver(self, message: RoomMessage) -> None:
        """Called by the bootstrap link's thread: stamp P's DONE, queue the message, wake
        the engine loop."""
        if isinstance(message, RoomStatus) and message.state is RoomState.DONE:
            self._kv_arrived[message.room] = time.monotonic()
        self.inbox.put(message)
        self._wake()

    def before_step(self, scheduler: Scheduler) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        while True:
            try:
                event = self.inbox.get_nowait()
            except queue.Empty:
                break
            outputs += self._on_event(scheduler, event)
        outputs += self._expire(scheduler)
        self._admit(scheduler)
        self.metrics.observe_queues(len(self.prealloc), len(self.transfer), len(self.quarantine))
        return outputs

    def after_step(self, scheduler: Scheduler) -> None:
        return None

    def during_forward(self, scheduler: Scheduler) -> list[StepOutput]:
        return []  # its news comes as bootstrap messages, handled before each step

    def queue_summary(self) -> str:
        return f"#prealloc-req {len(self.prealloc)}, #transfer-req {len(self.transfer)}"

    def abort(self, scheduler: Scheduler, rid: str) -> Req | None:
        for entry in self.prealloc:
            if entry.req.rid == rid:
                self.prealloc.remove(entry)
                entry.req.finish_reason = FinishReason.ABORT
                return entry.req
        for room, entry in self.transfer.items():
            if entry.req.rid == rid:
                self._give_up(room, "aborted by the client")
                self._count_failure("aborted")
                entry.req.finish_reason = FinishReason.ABORT
                return entry.req
        return None

    # ---- prealloc -> transfer ------------------------------------------------------------
    def _admit(self, scheduler: Scheduler) -> None:
        kv = scheduler.kv
        while self.prealloc:
            entry = self.prealloc[0]
            req = entry.req
            busy = len(scheduler.running) + len(self.transfer) + len(self.quarantine)
            prompt_pages = -(-(len(req.prompt_ids) + self.config.decode_headroom) // self.page_size)
            decoding = sum(1 for r in scheduler.running if r.is_decoding)
            if busy >= scheduler.config.max_running_requests or (
                kv.available_pages < prompt_pages + decoding
            ):
                return
            self.prealloc.popleft()
            req.slot = kv.req_to_token.alloc_slot()
            kv.attach_prefix(req)
            cached = req.kv_len
            if not kv.reserve(req, len(req.prompt_ids) - cached):
                kv.release(req, cache=False)
                self.prealloc.appendleft(entry)
                return
            scheduler.parked.append(req)
            self._publish(entry, cached)

    def _publish(self, entry: DecodeEntry, cached: int) -> None:
        req = entry.req
        assert req.slot is not None
        self.aux.clear(req.slot)
        first_page = cached // self.page_size
        dest = RoomDestination(
            room=req.room,
            decode_node_id=self.link.node_id,
            prefill_node_id=req.peer_node_id,
            page_ids=tuple(req.pages[first_page:]),
            cached_tokens=cached,
            aux_slot=req.slot,
            prompt_len=len(req.prompt_ids),
            ticket=req.room_ticket,
        )
        entry.published = self.clock()
        entry.epoch = self.link.epoch
        req.timing.mark("published")
        self.metrics.prealloc_wait.observe(req.timing.span("arrived", "published"))
        self.transfer[req.room] = entry
        self.link.post_destination(dest)

    # ---- transfer -> running ------------------------------------------------------------
    def _on_event(self, scheduler: Scheduler, event: RoomMessage) -> list[StepOutput]:
        if isinstance(event, RoomDestination):
            return []  # destinations go to prefill nodes
        if isinstance(event, LinkReset):
            return self._forgotten(scheduler, event.epoch)
        if isinstance(event, FailRoomAnswer):
            if event.safe_to_free and event.room in self.quarantine:
                self._free(scheduler, self.quarantine.pop(event.room).req)
            return []
        if event.room in self.quarantine:
            if event.state in (RoomState.DONE, RoomState.FAILED) and not event.may_still_write:
                self._free(scheduler, self.quarantine.pop(event.room).req)
            return []
        if event.state not in (RoomState.DONE, RoomState.FAILED):
            progressing = self.transfer.get(event.room)
            if progressing is not None:  # P started writing: the timeout restarts
                progressing.published = self.clock()
            return []
        arrived = self._kv_arrived.pop(event.room, None)
        entry = self.transfer.pop(event.room, None)
        if entry is None:
            return []
        if event.state is RoomState.DONE:
            timing = entry.req.timing
            timing.mark("kv_arrived", arrived)
            self.metrics.transfer_wait.observe(timing.span("published", "kv_arrived"))
            return [self._take_over(scheduler, entry.req)]
        reason = event.reason or "prefill failed"
        self._count_failure("prefill_failed")
        if event.may_still_write:
            self._hold(event.room, entry)
            return [self._fail(scheduler, entry.req, reason, free=False)]
        return [self._fail(scheduler, entry.req, reason)]

    def _forgotten(self, scheduler: Scheduler, epoch: int) -> list[StepOutput]:
        """Bootstrap forgot the rooms published before registration `epoch`: no DONE can
        reach us for them. Fail them now; P may still be writing (it stops once it notices
        its own lease or registration changed), so their pages wait in quarantine for the
        quarantine expiry: there is nobody left to confirm earlier."""
        outputs = []
        for room, entry in list(self.transfer.items()):
            if entry.epoch >= epoch:
                continue
            self._hold(room, self.transfer.pop(room))
            self._count_failure("bootstrap_reset")
            reason = "the bootstrap forgot the room (it restarted, or declared this node dead)"
            outputs.append(self._fail(scheduler, entry.req, reason, free=False))
        return outputs

    def _take_over(self, scheduler: Scheduler, req: Req) -> StepOutput:
        assert req.slot is not None
        try:
            first = self.aux.read(req.slot, req.room)
        except AuxMismatchError as exc:
            self._count_failure("aux_mismatch")
            return self._fail(scheduler, req, str(exc))
        self.metrics.rooms.labels("done").inc()
        req.timing.mark("first_token")
        req.timing.mark("admitted")
        logger.debug(
            "room %d: KV and first token from prefill node %s; joining the batch",
            req.room,
            req.peer_node_id,
            extra={"room": req.room},
        )
        scheduler.parked.remove(req)
        req.kv_len = len(req.prompt_ids)
        req.cached_tokens = first.cached_tokens
        req.output_ids.append(first.token)
        req.output_logprobs.append(first.logprob)
        req.output_top_logprobs.append(first.top_logprobs)
        req.sampler.adopt(first.token)
        scheduler.admit_prefilled(req)
        scheduler.check_finish(req, first.token)
        return StepOutput(req, [first.token], req.finished)

    def _fail(self, scheduler: Scheduler, req: Req, reason: str, free: bool = True) -> StepOutput:
        if free:
            self._free(scheduler, req)
        req.finish_reason = FinishReason.ABORT
        req.finish_detail = (
            f"room {req.room} (prefill node {req.peer_node_id} -> decode node "
            f"{self.link.node_id}): {reason}"
        )
        logger.warning("%s", req.finish_detail, extra={"room": req.room})
        return StepOutput(req, [], True)

    def _count_failure(self, reason: str) -> None:
        self.metrics.rooms.labels("failed").inc()
        self.metrics.failures.labels(reason).inc()

    def _free(self, scheduler: Scheduler, req: Req) -> None:
        if req in scheduler.parked:
            scheduler.parked.remove(req)
        scheduler.kv.release(req, cache=False)

    def _give_up(self, room: int, reason: str) -> None:
        self._hold(room, self.transfer.pop(room))
        self.link.fail_room(room, reason)

    def _hold(self, room: int, entry: DecodeEntry) -> None:
        entry.published = self.clock()  # quarantine clock
        self.quarantine[room] = entry

    def _expire(self, scheduler: Scheduler) -> list[StepOutput]:
        outputs = []
        now = self.clock()
        for room, entry in list(self.quarantine.items()):
            if now - entry.published > self.config.transfer_timeout_s:
                logger.warning("room %d: no word from bootstrap; freeing quarantined pages", room)
                self._free(scheduler, self.quarantine.pop(room).req)
        for room, entry in list(self.transfer.items()):
            if now - entry.published > self.config.transfer_timeout_s:
                reason = (
                    f"no KV from prefill node {entry.req.peer_node_id} within "
                    f"{self.config.transfer_timeout_s:.1f} s (transfer timeout)"
                )
                self._give_up(room, reason)
                self._count_failure("transfer_timeout")
                req = entry.req
                req.finish_reason = FinishReason.ABORT
                req.finish_detail = f"room {room} (decode node {self.link.node_id}): {reason}"
                outputs.append(StepOutput(req, [], True))
        return outputs
