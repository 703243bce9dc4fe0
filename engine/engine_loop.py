"""Runs a `Scheduler` on its own thread and talks to the outside world through typed messages.

Why a thread and not a process: the model forward spends its time inside torch kernels, which
release the GIL, so the gRPC event loop on the main thread stays responsive while a step runs;
a thread needs no serialisation of token streams and makes shutdown and "no orphan process"
trivial. Everything that touches the scheduler runs on the engine thread: other threads only
enqueue commands (`submit`, `abort`, `call`). What the engine produces leaves as one
`OutputBatch` per step through the one sink bound with `bind_output` (the node's gRPC service).

A watchdog thread kills the process with a clear log line if one step runs past
`watchdog_timeout_s`: a wedged node must die loudly so the fleet can route around it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.kv_events import KVEvent
from engine.layer_groups import LayerStream
from engine.metrics import NodeMetrics
from engine.request import PromptLogprob, Req, TransferSummary
from engine.scheduler import Scheduler, StepOutput
from engine.step_trace import StepTrace
from engine.timing import RequestTiming


class NodeRole(Protocol):
    """The PD queues of a prefill or decode node (see prefill_node/, decode_node/).

    Called on the engine thread only: before every step (to move requests between its queues
    and the scheduler) and after it (to start KV writes for the chunks just computed).
    """

    @property
    def has_work(self) -> bool: ...

    @property
    def poll_pause_s(self) -> float | None:
        """While some of its work only a poll can notice (a prefill node's KV writes in
        flight): how long an idle loop may wait before the next step polls it (a command or
        the role's wakeup ends the wait sooner). None otherwise: an idle loop then waits for a
        command or the wakeup alone (its timeouts checked every `LoopConfig.idle_poll_s`)."""
        ...

    def bind_wakeup(self, wake: Callable[[], None]) -> None:
        """`wake` (thread-safe) ends the loop's idle wait: call it after queueing a message."""
        ...

    def accepts(self, req: Req) -> bool: ...

    def submit(self, scheduler: Scheduler, req: Req) -> None: ...

    def before_step(self, scheduler: Scheduler) -> list[StepOutput]: ...

    def after_step(self, scheduler: Scheduler) -> list[StepOutput]:
        """Start the KV writes of the chunks just computed; requests finished at once (a
        prefill node's writes that all landed already) go out with the step's outputs."""
        ...

    def during_forward(self, scheduler: Scheduler) -> list[StepOutput]:
        """Called between the model's layers while a step's forward runs (at most every
        `LoopConfig.interlude_s`): requests finished meanwhile (a prefill node's KV writes
        done), answered now instead of when the step ends. The batch being computed and the
        KV memory must stay as they are until the step ends."""
        ...

    def abort(self, scheduler: Scheduler, rid: str) -> Req | None: ...

    @property
    def layer_stream(self) -> LayerStream | None:
        """Layer-group signals this role wants from extend forwards (a prefill node streaming
        KV, engine/layer_groups.py), set on the runner while the role is bound; else None."""
        ...

    def queue_summary(self) -> str:
        """The PD queue sizes for the step log line, e.g. `#prealloc-req 2, #transfer-req 1`."""
        ...

    def close(self) -> None:
        """Stop the role's own threads (a prefill role's layer-group poster), on the engine
        thread: once another role replaced it, or when the loop ends."""
        ...


logger = logging.getLogger("pdserve.engine")


class RoleBusy(RuntimeError):
    """A role switch found requests still on the node: drain it first."""


@dataclass(frozen=True)
class LoopConfig:
    decode_log_interval: int = 40  # log a decode line every N decode steps
    watchdog_timeout_s: float = 300.0
    idle_poll_s: float = 0.05
    step_trace: Path | None = None  # append one JSON line per step here (engine/step_trace.py)
    interlude_s: float = 0.01  # the role's `during_forward` runs at most this often


@dataclass(frozen=True)
class RequestFinish:
    """How one request ended on this node: its last message."""

    rid: str
    reason: str
    detail: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    transfer: TransferSummary | None = None
    timing: RequestTiming | None = None
    # Computed here when this node prefilled the prompt of a request that asked (entry 0: None).
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)


@dataclass(frozen=True)
class TokenLogprobs:
    """The logprobs of one request's new tokens in an `OutputBatch`, one entry per token."""

    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


@dataclass
class OutputBatch:
    """Everything one step (or one abort, one role hand-off) produced, for all its requests.

    Columns, not a message per request per token: `rids[i]` got the new tokens `token_ids[i]`;
    `logprobs` holds only the requests that asked for them; `finishes` end their requests after
    any tokens of theirs in the same batch. A step emits one batch, and its receiver is woken
    once per batch (a message per request per token took a third of a node's CPU at B=256).
    """

    rids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    finishes: list[RequestFinish] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.rids or self.finishes)


# Called on the engine thread with each non-empty batch; must only hand it over (e.g.
# `call_soon_threadsafe`), never block.
OutputSink = Callable[[OutputBatch], None]
# Called on the engine thread with a step's prefix-cache changes, if any; must not block.
KVEventSink = Callable[[list[KVEvent]], None]


@dataclass
class _Submit:
    req: Req


@dataclass
class _Call:
    fn: Callable[[Scheduler], Any]
    future: Future[Any] = field(default_factory=Future)


def _nothing(scheduler: Scheduler) -> None:
    return None


class EngineLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        config: LoopConfig,
        role: NodeRole | None = None,
        metrics: NodeMetrics | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.config = config
        self.role = role
        self.metrics = metrics or NodeMetrics("colocated" if role is None else "node")
        self._counted_stats = scheduler.last_stats
        self._commands: queue.Queue[_Submit | _Call] = queue.Queue()
        self._live: set[str] = set()  # requests whose end the output sink has not been told
        self._output: OutputSink | None = None
        self._kv_events: KVEventSink | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._step_started: float | None = None
        self._log = StepLogger(config.decode_log_interval)
        self._trace = StepTrace(config.step_trace) if config.step_trace else None
        self.fatal_error: BaseException | None = None
        self._last_interlude = float("-inf")
        self._bind_role(role)

    def _bind_role(self, role: NodeRole | None) -> None:
        self.role = role
        if role is not None:
            role.bind_wakeup(self.wake)
            # Not on a TP node: its other ranks are inside the forward's all-reduces, and a
            # role's poll there talks to them (a TP prefill node agrees on its KV writes' state
            # by a collective, engine/node/tp_transfer.py), so both sides would wait for ever.
            if self.scheduler.runner.group.size == 1:
                self.scheduler.runner.interlude = self._interlude
        self.scheduler.runner.layer_stream = role.layer_stream if role is not None else None

    # ---- called from other threads -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._watchdog.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.wake()  # an idle wait (up to a role's poll pause) ends now
        self._thread.join(timeout)
        if self._trace is not None and not self._thread.is_alive():
            self._trace.close()

    def bind_output(self, sink: OutputSink) -> None:
        """Where every request's tokens and end go; bind before the first `submit`."""
        self._output = sink

    def bind_kv_events(self, sink: KVEventSink) -> None:
        """Where the prefix cache's changes go, one list per step (engine/kv_events.py); bind
        before `start`. Without a prefix cache there is nothing to publish."""
        radix = self.scheduler.kv.radix
        if radix is not None:
            radix.record_events()
            self._kv_events = sink

    def submit(self, req: Req) -> None:
        if self._output is None:
            raise RuntimeError("EngineLoop.submit before bind_output: its output would be lost")
        # Marked here: a request sent during a long step waits for its end in the queue.
        req.timing.mark("arrived")
        self._commands.put(_Submit(req))

    def wake(self) -> None:
        """End an idle wait: the role has a message to handle in the next step."""
        self._commands.put(_Call(_nothing))

    def call(self, fn: Callable[[Scheduler], Any]) -> Future[Any]:
        """Run `fn(scheduler)` on the engine thread between two steps."""
        cmd = _Call(fn)
        self._commands.put(cmd)
        return cmd.future

    def abort(self, rid: str, reason: str = "aborted by the client") -> Future[Any]:
        return self.call(lambda s: self._abort(s, rid, reason))

    def replace_role(self, role: NodeRole | None) -> Future[Any]:
        """Serve `role` from the next step on (None: no PD role, every request prefilled here).
        Refused (the future raises RoleBusy) while the old role or the scheduler holds any
        request: a role switch drains first (engine/node/role_switch.py)."""
        return self.call(lambda s: self._replace_role(s, role))

    def holds_requests(self) -> bool:
        """On the engine thread: any request live, queued, running or parked, or any room of
        the role (a write settling, pages in quarantine)."""
        role_busy = self.role is not None and self.role.has_work
        return bool(self._live or self.scheduler.has_work or self.scheduler.live_requests()
                    or role_busy)  # fmt: skip

    def _replace_role(self, scheduler: Scheduler, role: NodeRole | None) -> None:
        if self.holds_requests():
            raise RoleBusy(
                f"the node still holds requests ({len(self._live)} live, "
                f"{len(scheduler.live_requests())} in the scheduler): drain it before switching "
                "its role"
            )
        old = self.role
        self._bind_role(role)
        if old is not None:
            old.close()

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.scheduler.runner.bind_thread()
            while not self._stop.is_set():
                self._drain_commands(self._idle_wait())
                self._step()
            if self.role is not None:
                self.role.close()
        except BaseException as exc:  # the node cannot serve without its loop: report, die
            logger.exception("engine loop crashed: %s", exc)
            self.fatal_error = exc
            self._fail_all(f"engine loop crashed: {exc}")
            # A node without its loop would accept requests and never answer: exit instead, so
            # clients and bootstrap see it gone. The pause lets the failures above be sent.
            time.sleep(0.5)
            logger.critical("exiting: the engine loop is gone")
            logging.shutdown()
            os._exit(1)

    def _idle_wait(self) -> float:
        """How long to wait for a command before the next step: none while the scheduler has
        work; the role's poll pause while only a poll sees its work end (KV writes in flight:
        don't spin a core, but a write's end noticed late is latency); else until a command
        or the role's wakeup (a decode node's rooms before P's DONE: a 1 ms poll there took
        ~8% of a core from the prefill on the same host), its timeouts checked every
        `idle_poll_s`."""
        if self.scheduler.has_work:
            return 0.0
        pause = self.role.poll_pause_s if self.role is not None else None
        return self.config.idle_poll_s if pause is None else pause

    def _drain_commands(self, wait_s: float) -> None:
        try:
            cmd = self._commands.get(timeout=wait_s) if wait_s > 0 else None
            while True:
                if cmd is None:
                    cmd = self._commands.get_nowait()
                self._execute(cmd)
                cmd = None
        except queue.Empty:
            return

    def _call(self, cmd: _Call) -> None:
        # The caller may have given up already (an admin RPC past its deadline cancels its
        # future): the call still runs (an abort must happen) but its answer goes nowhere. A
        # running future can no longer be cancelled, so the answer below always lands.
        wanted = cmd.future.set_running_or_notify_cancel()
        try:
            result = cmd.fn(self.scheduler)
        except Exception as exc:
            if wanted:
                cmd.future.set_exception(exc)
            else:
                logger.warning("engine call failed after its caller gave up: %s", exc)
            return
        if wanted:
            cmd.future.set_result(result)

    def _execute(self, cmd: _Submit | _Call) -> None:
        if isinstance(cmd, _Call):
            self._call(cmd)
            return
        try:
            if self.role is not None and self.role.accepts(cmd.req):
                self.scheduler.validate_prompt(cmd.req.prompt_ids)
                self.role.submit(self.scheduler, cmd.req)
            else:
                self.scheduler.add_request(cmd.req)
        except ValueError as exc:
            self.metrics.finished.labels("abort").inc()
            finish = RequestFinish(cmd.req.rid, "abort", str(exc), len(cmd.req.prompt_ids), 0, 0)
            self._send(OutputBatch(finishes=[finish]))
            return
        self._live.add(cmd.req.rid)

    def _step(self) -> None:
        self._step_started = started = time.monotonic()
        stepped = False
        # Role outputs (a decode node's first token from P, failures) go out before this
        # step's forward, not one decode step late.
        if self.role is not None:
            self._send(self._batch(self.role.before_step(self.scheduler)))
        outputs = []
        if self.scheduler.has_work:
            outputs = self.scheduler.step()
            stats = self.scheduler.last_stats
            if stats is not self._counted_stats:  # a step with nothing to run keeps the old
                self._counted_stats = stats
                self._log.record(self.scheduler, self.role.queue_summary() if self.role else "")
                self.metrics.observe_step(self.scheduler, stats)
                stepped = True
                if self._trace is not None:
                    self._trace.write(self.scheduler)
        if self.role is not None:
            outputs = outputs + self.role.after_step(self.scheduler)
        self.metrics.observe_queues(self.scheduler)
        self._step_started = None
        self._send(self._batch(outputs))
        if self._kv_events is not None:
            assert self.scheduler.kv.radix is not None
            events = self.scheduler.kv.radix.take_events()
            if events:
                self._kv_events(events)
        if stepped:
            self.metrics.loop_seconds.observe(time.monotonic() - started)

    def _interlude(self) -> None:
        now = time.monotonic()
        if self.role is None or now - self._last_interlude < self.config.interlude_s:
            return
        self._last_interlude = now
        self._send(self._batch(self.role.during_forward(self.scheduler)))

    def _batch(self, outputs: list[StepOutput]) -> OutputBatch:
        """The outputs of live requests as one batch; the finished ones stop being live."""
        batch = OutputBatch()
        live = self._live
        for out in outputs:
            req = out.req
            rid = req.rid
            if rid not in live:
                continue
            new = out.new_token_ids
            if new:
                req.timing.mark("first_token" if out.start == 0 else "second_token")
                batch.rids.append(rid)
                batch.token_ids.append(new)
                if req.params.logprobs:
                    span = slice(out.start, out.start + len(new))
                    batch.logprobs[rid] = TokenLogprobs(
                        req.output_logprobs[span], req.output_top_logprobs[span]
                    )
            if out.finished:
                live.discard(rid)
                self.metrics.observe_finish(req)
                batch.finishes.append(_finish(req))
        return batch

    def _send(self, batch: OutputBatch) -> None:
        if batch:
            assert self._output is not None  # submit refuses requests before bind_output
            self._output(batch)

    def _abort(self, scheduler: Scheduler, rid: str, reason: str) -> bool:
        req = self.role.abort(scheduler, rid) if self.role else None
        req = req or scheduler.abort(rid)
        if req is None:
            return False
        if rid in self._live:
            self._live.discard(rid)
            self.metrics.observe_finish(req)
            self._send(OutputBatch(finishes=[_finish(req, reason)]))
        return True

    def _fail_all(self, detail: str) -> None:
        batch = OutputBatch()
        for rid in self._live:
            self.metrics.finished.labels("abort").inc()
            batch.finishes.append(RequestFinish(rid, "abort", detail, 0, 0, 0))
        self._live.clear()
        self._send(batch)

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            started = self._step_started
            if started is not None and time.monotonic() - started > self.config.watchdog_timeout_s:
                logger.critical(
                    "watchdog: one scheduler step has run for %.0f s (limit %.0f s); the node is "
                    "wedged, killing it",
                    time.monotonic() - started,
                    self.config.watchdog_timeout_s,
                )
                logging.shutdown()
                os._exit(70)


def _finish(req: Req, default_detail: str = "") -> RequestFinish:
    req.timing.mark("finished")
    return RequestFinish(
        rid=req.rid,
        reason=req.finish_reason.value if req.finish_reason else "abort",
        detail=req.finish_detail or default_detail,
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        transfer=req.transfer,
        timing=req.timing,
        prompt_logprobs=req.prompt_logprobs,
    )


class StepLogger:
    """One line per prefill step and one per `decode_interval` decode steps."""

    def __init__(self, decode_interval: int) -> None:
        self.decode_interval = decode_interval
        self._decode_steps = 0
        self._decode_tokens = 0
        self._since = time.monotonic()

    def record(self, scheduler: Scheduler, pd_queues: str = "") -> None:
        """`pd_queues`: the node role's queue sizes, appended to each line."""
        stats = scheduler.last_stats
        tail = f", {pd_queues}" if pd_queues else ""
        kv = scheduler.kv
        alloc = kv.allocator
        usage = (alloc.num_used + alloc.num_cached) / alloc.total
        if stats.num_prefill_reqs:
            logger.info(
                "prefill batch: #new-seq %d, #new-token %d, #cached-token %d, token usage %.2f, "
                "#running-req %d, #queue-req %d%s",
                stats.num_prefill_reqs,
                stats.num_prefill_tokens,
                stats.cached_tokens,
                usage,
                len(scheduler.running),
                len(scheduler.waiting),
                tail,
            )
        self._decode_tokens += stats.num_decode_reqs
        self._decode_steps += 1 if stats.num_decode_reqs else 0
        if stats.num_decode_reqs and self._decode_steps % self.decode_interval == 0:
            elapsed = max(time.monotonic() - self._since, 1e-9)
            logger.info(
                "decode batch: #running-req %d, #token %d, token usage %.2f, "
                "gen throughput (token/s) %.2f, #queue-req %d%s",
                len(scheduler.running),
                sum(r.seq_len for r in scheduler.running),
                usage,
                self._decode_tokens / elapsed,
                len(scheduler.waiting),
                tail,
            )
            self._decode_tokens, self._since = 0, time.monotonic()
