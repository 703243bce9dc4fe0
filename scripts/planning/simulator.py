"""Discrete-event simulation of a pdserve cluster: N prefill + M decode nodes, or colocated.

It follows the queues and batching rules of the real nodes (engine/scheduler.py,
prefill_node/prefill_role.py, decode_node/decode_role.py), with step times from a `NodeProfile`:

- gateway: each arrival goes to the decode node and the prefill node with the fewest requests
  in flight (least load); tokens reach the client `gateway_s` after the node emits them.
- decode node, disaggregated: prealloc queue (FIFO) -> admitted when fewer than
  max_running_requests are busy and the KV pool holds prompt + decode_headroom tokens -> the
  destination reaches the prefill node `handoff_s` later -> prefill (below) -> KV bytes and
  P's DONE through bootstrap (`transfer_s`) -> at the node's next step boundary the request
  joins the running batch and its first token (sampled by P) is emitted -> one token per
  decode step until output_len.
- prefill node: waiting queue (FIFO); a step carries partially prefilled requests first, then
  new ones, under the chunked_prefill_size token budget; a request whose last chunk ran starts
  its transfer (transfer_s of its prompt). The node reports DONE as soon as the transfer
  completes, mid-step too (prefill_node/prefill_role.py polls its writes between the model's
  layers), but frees the pages only between steps: a transfer that completes during a step
  holds its pages until that step's end.
- colocated node: one scheduler; a step carries every decoding request plus prefill chunks under
  the budget; a request's first token is emitted at the end of its last prefill chunk.
- shared host (CPU): with host_cores > 0 the cores are shared (processor sharing): while k
  nodes are stepping, each step progresses at 1 / max(1, (k * threads_per_node + b) /
  host_cores) of its profiled speed, re-evaluated whenever a step starts or ends, so a long
  prefill slows down when the decode node starts stepping beside it; b is the cores the rest of
  the host is busy with: the gateway, the client, the nodes' gRPC and transfer threads, charged
  as `overhead_s_per_token` CPU-seconds per token streamed in the last HOST_WINDOW_S seconds
  (measured by `plan_capacity.py host`; a disaggregated cluster has transfer and bootstrap
  work on top, hence its own `pd_overhead_s_per_token`); on top of that each step slows by
  `co_runner` per other step in flight (shared memory bandwidth and caches, which sharing the
  cores does not show); slowdown scales every step.

Prefix cache hits: an arrival's `cached_len` leading tokens are not computed by whichever node
prefills it (their attention is: each chunk's pairs count its prefix), as if routing always
found the node holding them (`kv_aware`); their KV is still counted whole in each request's
pages and sent whole from a prefill node. Not modelled: retraction, multi-turn sessions,
network jitter.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scripts.serving.metrics import RequestTrace

from .profile import NodeProfile

HOST_WINDOW_S = 1.0  # the window over which the host's token rate is taken


@dataclass(frozen=True)
class HostConfig:
    host_cores: int = 0  # 0: every node has its own accelerator (no sharing)
    threads_per_node: int = 1
    slowdown: float = 1.0
    overhead_s_per_token: float = 0.0  # host CPU outside engine steps per streamed token
    pd_overhead_s_per_token: float | None = None  # the same with prefill nodes (None: same)
    # each other step in flight slows a step by this fraction on top of sharing the cores
    # (memory bandwidth and caches: `plan_capacity.py steps` shows it by the company a step kept)
    co_runner: float = 0.0

    def overhead(self, disaggregated: bool) -> float:
        pd = self.pd_overhead_s_per_token
        return pd if disaggregated and pd is not None else self.overhead_s_per_token


@dataclass(frozen=True)
class Arrival:
    at: float
    prompt_len: int
    output_len: int
    cached_len: int = 0  # leading prompt tokens whose KV the prefilling node already holds


@dataclass
class SimRequest:
    index: int
    arrival: Arrival
    sent: float = 0.0
    prefilled: int = 0
    emitted: list[float] = field(default_factory=list)
    decode: Node | None = None
    prefill: Node | None = None

    @property
    def finished(self) -> bool:
        return len(self.emitted) >= self.arrival.output_len

    @property
    def context(self) -> int:
        return self.arrival.prompt_len + len(self.emitted)


class Node:
    """One node's queues; `role` is prefill, decode or colocated."""

    def __init__(self, sim: Simulation, role: str, index: int) -> None:
        self.sim = sim
        self.role = role
        self.name = f"{role}-{index}"
        self.waiting: deque[SimRequest] = deque()  # P/colocated: to prefill; D: prealloc
        self.running: list[SimRequest] = []
        self.arrived: list[SimRequest] = []  # D: transfer done, joins at the next step
        self.sent: list[SimRequest] = []  # P: transfer complete, pages freed at the step's end
        self.reserved = 0  # D: requests between prealloc and the running batch
        self.kv_used = 0
        self.assigned = 0  # requests routed here and not finished (the gateway's load)
        self.stepping = False

    # -- work arriving --------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self.kick()

    def transfer_done(self, req: SimRequest) -> None:
        self.arrived.append(req)
        self.kick()

    def kick(self) -> None:
        if not self.stepping:
            self.sim.at(self.sim.now, self.start_step)

    # -- one step ---------------------------------------------------------------------------
    def start_step(self) -> None:
        if self.stepping:
            return
        profile = self.sim.profile
        if self.role == "decode":
            self._admit_prealloc()
            self._take_over()
        plan = self._prefill_plan() if self.role != "decode" else []
        decoding = [r for r in self.running if r.emitted] if self.role != "prefill" else []
        if not plan and not decoding:
            return
        chunks = [(n, req.prefilled) for req, n in plan]
        context = sum(r.context for r in decoding) / len(decoding) if decoding else 0.0
        work = profile.mixed_s(chunks, len(decoding), context)
        self.stepping = True
        self.sim.begin_step(work, lambda: self._end_step(plan, decoding))

    def _end_step(self, plan: list[tuple[SimRequest, int]], decoding: list[SimRequest]) -> None:
        now = self.sim.now
        self.stepping = False
        for req in self.sent:
            self._free_prefill(req)
        self.sent.clear()
        for req, n in plan:
            req.prefilled += n
            if req.prefilled < req.arrival.prompt_len:
                continue
            if self.role == "prefill":
                self.running.remove(req)
                done_at = now + self.sim.profile.transfer_s(req.arrival.prompt_len)
                self.sim.at(done_at, functools.partial(self._transfer_complete, req))
            else:
                decoding.append(req)  # colocated: first token at the end of the last chunk
        for req in decoding:
            self._emit(req, now)
        self.kick()

    def _prefill_plan(self) -> list[tuple[SimRequest, int]]:
        profile = self.sim.profile
        budget = profile.chunked_prefill_size
        plan = []
        for req in self.running:
            left = req.arrival.prompt_len - req.prefilled
            if left > 0 and budget > 0:
                plan.append((req, min(left, budget)))
                budget -= plan[-1][1]
        while budget > 0 and self.waiting:
            req = self.waiting[0]
            need = req.arrival.prompt_len + (
                req.arrival.output_len if self.role == "colocated" else 0
            )
            if len(self.running) >= profile.max_running_requests or (
                self.kv_used + need > profile.max_total_tokens
            ):
                break
            self.waiting.popleft()
            self.kv_used += need
            self.running.append(req)
            plan.append((req, min(req.arrival.prompt_len - req.prefilled, budget)))
            budget -= plan[-1][1]
        return plan

    def _admit_prealloc(self) -> None:
        profile = self.sim.profile
        while self.waiting:
            req = self.waiting[0]
            need = req.arrival.prompt_len + max(profile.decode_headroom, req.arrival.output_len)
            busy = len(self.running) + self.reserved
            if (
                busy >= profile.max_running_requests
                or self.kv_used + need > profile.max_total_tokens
            ):
                return
            self.waiting.popleft()
            self.kv_used += need
            self.reserved += 1
            assert req.prefill is not None
            self.sim.at(
                self.sim.now + profile.handoff_s, functools.partial(req.prefill.submit, req)
            )

    def _take_over(self) -> None:
        for req in self.arrived:
            self.reserved -= 1
            self.running.append(req)
            self._emit(req, self.sim.now)  # the first token, sampled by the prefill node
        self.arrived.clear()

    def _transfer_complete(self, req: SimRequest) -> None:
        assert req.decode is not None
        req.decode.transfer_done(req)
        if self.stepping:
            self.sent.append(req)
        else:
            self._free_prefill(req)

    def _free_prefill(self, req: SimRequest) -> None:
        self.kv_used -= req.arrival.prompt_len
        self.assigned -= 1

    def _emit(self, req: SimRequest, now: float) -> None:
        req.emitted.append(now + self.sim.profile.gateway_s)
        self.sim.streamed.append(now)
        if req.finished:
            self.running.remove(req)
            profile = self.sim.profile
            if self.role == "decode":
                self.kv_used -= req.arrival.prompt_len + max(
                    profile.decode_headroom, req.arrival.output_len
                )
            else:
                self.kv_used -= req.arrival.prompt_len + req.arrival.output_len
            self.assigned -= 1
            self.sim.finished(req)


@dataclass(eq=False)
class _Step:
    work: float  # seconds of it left at the profiled (unshared) speed
    end: Callable[[], None]


class Simulation:
    def __init__(
        self,
        profile: NodeProfile,
        prefill: int,
        decode: int,
        host: HostConfig = HostConfig(),
        max_concurrency: int | None = None,
    ) -> None:
        if decode < 1 or prefill < 0:
            raise ValueError(
                f"need >= 1 decode node and >= 0 prefill nodes, got {prefill}:{decode}"
            )
        self.profile = profile
        self.host = host
        self.max_concurrency = max_concurrency
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        role = "decode" if prefill else "colocated"
        self.prefill_nodes = [Node(self, "prefill", i) for i in range(prefill)]
        self.decode_nodes = [Node(self, role, i) for i in range(decode)]
        self._backlog: deque[SimRequest] = deque()  # client side, waiting for a slot
        self._in_flight = 0
        self.done: list[SimRequest] = []
        self.streamed: deque[float] = deque()  # when each token left a node, oldest first
        self._steps: list[_Step] = []  # in flight on any node
        self._factor = 1.0  # every step in flight runs this many times slower than profiled
        self._since = 0.0  # when the factor was last set
        self._epoch = 0  # step-end events of an older epoch are stale

    @property
    def nodes(self) -> list[Node]:
        return self.prefill_nodes + self.decode_nodes

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), action))

    def contention(self) -> float:
        """How many times slower than profiled each step in flight runs now."""
        host = self.host
        factor = host.slowdown
        if host.host_cores > 0:
            busy = len(self._steps) * host.threads_per_node + self.background_cores()
            factor *= max(1.0, busy / host.host_cores)
            factor *= 1.0 + host.co_runner * max(0, len(self._steps) - 1)
        return factor

    # -- steps sharing the host ---------------------------------------------------------------
    def begin_step(self, work: float, end: Callable[[], None]) -> None:
        """Run `work` seconds of profiled step time, then `end`; shares the host's cores."""
        self._progress()
        self._steps.append(_Step(work, end))
        self._reschedule()

    def _progress(self) -> None:
        done = (self.now - self._since) / self._factor
        for step in self._steps:
            step.work -= done
        self._since = self.now

    def _reschedule(self) -> None:
        self._factor = self.contention()
        self._epoch += 1
        for step in self._steps:
            end_at = self.now + max(0.0, step.work) * self._factor
            self.at(end_at, functools.partial(self._step_ended, step, self._epoch))

    def _step_ended(self, step: _Step, epoch: int) -> None:
        if epoch != self._epoch:
            return  # the factor changed since this end time was computed
        self._progress()
        self._steps.remove(step)
        self._reschedule()
        step.end()

    def background_cores(self) -> float:
        """Cores the host spends outside engine steps: its recent token rate x cost per token."""
        while self.streamed and self.streamed[0] < self.now - HOST_WINDOW_S:
            self.streamed.popleft()
        per_token = self.host.overhead(bool(self.prefill_nodes))
        return per_token * len(self.streamed) / HOST_WINDOW_S

    def run(self, arrivals: Sequence[Arrival]) -> list[RequestTrace]:
        requests = [SimRequest(i, a, prefilled=a.cached_len) for i, a in enumerate(arrivals)]
        for req in requests:
            self.at(req.arrival.at, functools.partial(self._arrive, req))
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        if len(self.done) != len(requests):
            stuck = len(requests) - len(self.done)
            raise RuntimeError(f"{stuck} requests never finished: a request too large for a node?")
        return [self._trace(r) for r in requests]

    def _arrive(self, req: SimRequest) -> None:
        if self.max_concurrency is not None and self._in_flight >= self.max_concurrency:
            self._backlog.append(req)
            return
        self._send(req)

    def _send(self, req: SimRequest) -> None:
        self._in_flight += 1
        req.sent = self.now
        decode = min(self.decode_nodes, key=lambda n: n.assigned)
        decode.assigned += 1
        req.decode = decode
        if self.prefill_nodes:
            prefill = min(self.prefill_nodes, key=lambda n: n.assigned)
            prefill.assigned += 1
            req.prefill = prefill
        decode.submit(req)

    def finished(self, req: SimRequest) -> None:
        self.done.append(req)
        self._in_flight -= 1
        if self._backlog:
            self._send(self._backlog.popleft())

    def _trace(self, req: SimRequest) -> RequestTrace:
        return RequestTrace(
            sent=req.sent,
            chunks=list(req.emitted),
            done=req.emitted[-1],
            prompt_tokens=req.arrival.prompt_len,
            output_tokens=len(req.emitted),
            session=req.index,
        )
