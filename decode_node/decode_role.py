"""The decode node's PD life cycle, run on the engine thread around each scheduler step.

A room moves through the phases of `decode_node/rooms.py` (PREALLOC -> TRANSFER -> gone, or
-> QUARANTINE -> gone); this module makes the moves. The scheduler holds the request parked,
pages kept, from TRANSFER on, and runs it once P's DONE and the first token arrived.

With staging pages (`stager`, engine/memory/staging.py) a room whose prompt pages form more
runs than the stager's threshold publishes a contiguous staging span as its destination
instead; on DONE the span is scattered into the room's pages before anything reads them
(`_take_over`), and a room that fails keeps its span as long as its pages (a quarantined
room's late writes may still land in it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from decode_node.rooms import DECODE_MOVES, DecodeEntry, DecodePhase
from engine.grammar import GrammarViolation
from engine.layer_groups import LayerStream
from engine.memory.staging import PageStager
from engine.metrics import DecodeMetrics
from engine.node.phases import RoomRole
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
)

logger = logging.getLogger("pdserve.decode")

PREALLOC, TRANSFER, QUARANTINE = DecodePhase
FINAL = (RoomState.DONE, RoomState.FAILED)


@dataclass(frozen=True)
class DecodeRoleConfig:
    decode_headroom: int = 32  # tokens of decode room required beside the prompt to admit
    transfer_timeout_s: float = 300.0  # published (or last progress from P) -> DONE


class DecodeRole(RoomRole[DecodePhase, DecodeEntry]):
    def __init__(
        self,
        config: DecodeRoleConfig,
        link: RoomLink,
        aux: AuxBuffer,
        page_size: int,
        clock: Callable[[], float] = time.monotonic,
        metrics: DecodeMetrics | None = None,
        stager: PageStager | None = None,
    ) -> None:
        super().__init__(DECODE_MOVES, clock)
        self.stager = stager
        self.config = config
        self.link = link
        self.aux = aux
        self.page_size = page_size
        self.metrics = metrics or DecodeMetrics()
        self.layer_stream: LayerStream | None = None  # a decode node streams no KV out

    def accepts(self, req: Req) -> bool:
        return req.room != 0

    @property
    def poll_pause_s(self) -> float | None:
        return None  # every change comes as a message or a timeout

    def submit(self, scheduler: Scheduler, req: Req) -> None:
        self.rooms.add(DecodeEntry(req, PREALLOC, self.clock()))

    def before_step(self, scheduler: Scheduler) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for event, arrived in self.received():
            outputs += self._on_event(scheduler, event, arrived)
        outputs += self._expire(scheduler)
        self._admit(scheduler)
        counts = self.rooms.counts()
        self.metrics.observe_queues(counts[PREALLOC], counts[TRANSFER], counts[QUARANTINE])
        return outputs

    def after_step(self, scheduler: Scheduler) -> list[StepOutput]:
        return []

    def during_forward(self, scheduler: Scheduler) -> list[StepOutput]:
        return []  # its news comes as bootstrap messages, handled before each step

    def load_queues(self) -> tuple[int, int]:
        """(rooms waiting for their KV, rooms waiting for pages): the load the node reports in
        its heartbeats (called from the node's event loop)."""
        counts = self.rooms.counts()
        return counts[TRANSFER], counts[PREALLOC]

    def queue_summary(self) -> str:
        counts = self.rooms.counts()
        return f"#prealloc-req {counts[PREALLOC]}, #transfer-req {counts[TRANSFER]}"

    def close(self) -> None:
        pass  # no thread of its own

    def abort(self, scheduler: Scheduler, rid: str) -> Req | None:
        entry = self.rooms.find(rid)
        if entry is None or entry.phase is QUARANTINE:
            return None
        if entry.phase is PREALLOC:
            self.rooms.move(entry, None)
        else:
            self._give_up(entry, "aborted by the client")
            self._count_failure("aborted")
        entry.req.finish_reason = FinishReason.ABORT
        return entry.req

    # ---- PREALLOC -> TRANSFER ------------------------------------------------------------
    def _admit(self, scheduler: Scheduler) -> None:
        waiting = self.rooms.in_phase(PREALLOC)
        if not waiting:
            return
        if any(req.num_retractions for req in scheduler.waiting):
            # A request retracted for want of pages resumes first: a new room admitted now
            # would take the pages it waits for, and under steady arrivals it would wait on.
            return
        counts = self.rooms.counts()
        busy = len(scheduler.running) + counts[TRANSFER] + counts[QUARANTINE]
        decoding = sum(1 for r in scheduler.running if r.is_decoding)
        for entry in waiting:
            req = entry.req
            prompt_pages = -(-(len(req.prompt_ids) + self.config.decode_headroom) // self.page_size)
            if busy >= scheduler.config.max_running_requests or (
                scheduler.kv.available_pages < prompt_pages + decoding
            ):
                return
            if not scheduler.hold_prompt(req):
                return
            busy += 1
            self._publish(entry, cached=req.kv_len)

    def _publish(self, entry: DecodeEntry, cached: int) -> None:
        req = entry.req
        assert req.slot is not None
        self.aux.clear(req.slot)
        first_page = cached // self.page_size
        dest = RoomDestination(
            room=req.room,
            decode_node_id=self.link.node_id,
            prefill_node_id=req.peer_node_id,
            page_ids=self._destination_pages(entry, first_page),
            cached_tokens=cached,
            aux_slot=req.slot,
            prompt_len=len(req.prompt_ids),
            ticket=req.room_ticket,
        )
        entry.epoch = self.link.epoch
        self.rooms.move(entry, TRANSFER)
        req.timing.mark("published")
        self.metrics.prealloc_wait.observe(req.timing.span("arrived", "published"))
        self.link.post_destination(dest)

    def _destination_pages(self, entry: DecodeEntry, first_page: int) -> tuple[int, ...]:
        """Where P writes the room's prompt pages: its own pages, or a staging span when they
        are scattered (and a span is free)."""
        req = entry.req
        pages = req.pages[first_page:]
        prompt_pages = -(-len(req.prompt_ids) // self.page_size) - first_page
        if self.stager is None or prompt_pages <= 0:
            return tuple(pages)
        if not self.stager.worth_staging(pages[:prompt_pages]):
            return tuple(pages)
        req.staging = self.stager.area.acquire(prompt_pages)
        if req.staging is None:  # every span in use: P writes into the pool pages
            self.metrics.staging_full.inc()
            return tuple(pages)
        entry.staged_into = tuple(pages[:prompt_pages])
        return tuple(req.staging.ids(0, prompt_pages))

    def _unstage(self, entry: DecodeEntry, scatter: bool) -> None:
        """Give the room's staging span back; with `scatter`, after copying it into the
        room's pages (P reported DONE: every write landed)."""
        req = entry.req
        if req.staging is None or self.stager is None:
            return
        fence = None
        if scatter:
            fence = self.stager.scatter(req.staging, 0, entry.staged_into)
            self.metrics.staged_pages.inc(len(entry.staged_into))
        self.stager.area.release(req.staging, fence)
        req.staging = None

    # ---- TRANSFER -> running, QUARANTINE or gone --------------------------------------------
    def _on_event(
        self, scheduler: Scheduler, event: RoomMessage, arrived: float
    ) -> list[StepOutput]:
        if isinstance(event, RoomDestination):
            return []  # destinations go to prefill nodes
        if isinstance(event, LinkReset):
            return self._forgotten(scheduler, event.epoch)
        entry = self.rooms.get(event.room)
        if entry is None or entry.phase is PREALLOC:
            return []
        if isinstance(event, FailRoomAnswer):
            if event.safe_to_free and entry.phase is QUARANTINE:
                self._free(scheduler, entry)
            return []
        if entry.phase is QUARANTINE:
            if event.state in FINAL and not event.may_still_write:
                self._free(scheduler, entry)
            return []
        if event.state not in FINAL:  # P started writing: the timeout restarts
            self.rooms.restart_timer(entry)
            return []
        if event.state is RoomState.DONE:
            self.rooms.move(entry, None)
            timing = entry.req.timing
            timing.mark("kv_arrived", arrived)
            self.metrics.transfer_wait.observe(timing.span("published", "kv_arrived"))
            return [self._take_over(scheduler, entry)]
        self._count_failure("prefill_failed")
        reason = event.reason or "prefill failed"
        if event.may_still_write:
            self.rooms.move(entry, QUARANTINE)
            return [self._fail(entry.req, reason)]
        self._free(scheduler, entry)
        return [self._fail(entry.req, reason)]

    def _forgotten(self, scheduler: Scheduler, epoch: int) -> list[StepOutput]:
        """Bootstrap forgot the rooms published before registration `epoch`: no DONE can
        reach us for them. Fail them now; P may still be writing (it stops once it notices
        its own lease or registration changed), so their pages wait in quarantine for the
        quarantine expiry: there is nobody left to confirm earlier."""
        outputs = []
        for entry in self.rooms.in_phase(TRANSFER):
            if entry.epoch >= epoch:
                continue
            self.rooms.move(entry, QUARANTINE)
            self._count_failure("bootstrap_reset")
            reason = "the bootstrap forgot the room (it restarted, or declared this node dead)"
            outputs.append(self._fail(entry.req, reason))
        return outputs

    def _take_over(self, scheduler: Scheduler, entry: DecodeEntry) -> StepOutput:
        req = entry.req
        assert req.slot is not None
        self._unstage(entry, scatter=True)  # before any kernel reads the room's pages
        try:
            first = self.aux.read(req.slot, req.room)
        except AuxMismatchError as exc:
            self._count_failure("aux_mismatch")
            scheduler.release(req, cache=False)
            return self._fail(req, str(exc))
        self.metrics.rooms.labels("done").inc()
        req.timing.mark("first_token")
        req.timing.mark("admitted")
        logger.debug(
            "room %d: KV and first token from prefill node %s; joining the batch",
            req.room,
            req.peer_node_id,
            extra={"room": req.room},
        )
        try:  # a grammar's matcher advances over the prefill node's token, or refuses it
            req.sampler.adopt(first.token)
        except GrammarViolation as exc:
            scheduler.release(req, cache=False)
            return self._fail(req, str(exc))
        req.kv_len = len(req.prompt_ids)
        req.cached_tokens = first.cached_tokens
        req.output_ids.append(first.token)
        req.output_logprobs.append(first.logprob)
        req.output_top_logprobs.append(first.top_logprobs)
        scheduler.resume(req)
        scheduler.check_finish(req, first.token)
        return StepOutput(req, [first.token], req.finished)

    def _fail(self, req: Req, reason: str) -> StepOutput:
        """The client's end of a failed room (its pages are freed or quarantined apart)."""
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

    def _free(self, scheduler: Scheduler, entry: DecodeEntry) -> None:
        """No write can land any more: the room's pages and staging span go back."""
        self.rooms.move(entry, None)
        self._unstage(entry, scatter=False)
        scheduler.release(entry.req, cache=False)

    def _give_up(self, entry: DecodeEntry, reason: str) -> None:
        self.rooms.move(entry, QUARANTINE)
        self.link.fail_room(entry.room, reason)

    def _expire(self, scheduler: Scheduler) -> list[StepOutput]:
        outputs = []
        now, timeout = self.clock(), self.config.transfer_timeout_s
        for entry in self.rooms.in_phase(QUARANTINE):
            if now - entry.since > timeout:
                logger.warning(
                    "room %d: no word from bootstrap; freeing quarantined pages", entry.room
                )
                self._free(scheduler, entry)
        for entry in self.rooms.in_phase(TRANSFER):
            if now - entry.since > timeout:
                reason = (
                    f"no KV from prefill node {entry.req.peer_node_id} within "
                    f"{timeout:.1f} s (transfer timeout)"
                )
                self._give_up(entry, reason)
                self._count_failure("transfer_timeout")
                req = entry.req
                req.finish_reason = FinishReason.ABORT
                req.finish_detail = f"room {entry.room} (decode node {self.link.node_id}): {reason}"
                outputs.append(StepOutput(req, [], True))
        return outputs
