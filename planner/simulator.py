"""Discrete-event simulation of a pdserve cluster: N prefill + M decode nodes, or colocated.

It follows the queues and batching rules of the real nodes (engine/scheduler.py,
prefill_node/prefill_role.py, decode_node/decode_role.py), with step times from a `NodeProfile`:

- gateway: each arrival goes to the decode node and the prefill node with the fewest requests
  in flight (least load); tokens reach the client `gateway_s` after the node emits them.
- decode node, disaggregated: prealloc queue (FIFO) -> admitted when fewer than
  max_running_requests are busy and the KV pool holds prompt + decode_headroom tokens beside
  a page per decoding request (only the prompt's pages are taken) -> the destination reaches
  the prefill node `handoff_s` later -> prefill (below) -> KV bytes and P's DONE through
  bootstrap (`transfer_s`) -> at the node's next step boundary the request joins the running
  batch and its first token (sampled by P) is emitted -> one token per decode step until
  output_len.
- KV memory and retraction (decode and colocated nodes, as engine/scheduler.py): pages of
  `page_size` tokens, `max_total_tokens // page_size` of them. Each decode step needs one more
  KV slot per decoding request; when the pool is short the newest running request is retracted:
  its pages go back (its full pages into the node's prefix cache: evictable, least recently
  used first, whole), it goes to the front of the node's waiting queue with its generated
  tokens, and when the node can admit it again (a page kept per decoding request, its first
  chunk's pages; on a decode node no new room gets pages while a retracted request waits,
  as decode_node/decode_role.py `_admit`) it is prefilled again on that node, prompt +
  generated tokens less the cached pages it finds again, in chunks beside the decoding batch;
  the chunk that ends it samples its next token. A request alone that outgrows the pool is
  aborted (error `kv_pool_exhausted`). Retractions and recomputed tokens are counted per node.
- prefill node: waiting queue (FIFO); a step carries partially prefilled requests first, then
  new ones, under the chunked_prefill_size token budget; a request whose last chunk ran starts
  its transfer (transfer_s of its prompt). The node reports DONE as soon as the transfer
  completes, mid-step too (prefill_node/prefill_role.py polls its writes between the model's
  layers), but frees the pages only between steps: a transfer that completes during a step
  holds its pages until that step's end.
- colocated node: one scheduler; a step carries every decoding request plus prefill chunks under
  the budget (admission by the first chunk's pages, as above, not the whole output); a
  request's first token is emitted at the end of its last prefill chunk.
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
pages and sent whole from a prefill node. Not modelled: multi-turn sessions, network jitter,
a decode node's prefix hits on new prompts, and a prefill node's chunk-by-chunk page
reservation (it holds a prompt's pages whole from admission).
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .metrics import RequestTrace
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


@dataclass(slots=True)
class SimRequest:
    index: int
    arrival: Arrival
    sent: float = 0.0
    # Tokens whose KV the node now running it holds, as the engine's `Req.kv_len`: on a prefill
    # node its progress through the prompt; on a decode node the prompt from the take-over on.
    kv_len: int = 0
    pages: int = 0  # KV pages it holds on its decode / colocated node
    retractions: int = 0
    emitted: list[float] = field(default_factory=list)
    error: str = ""  # aborted by its node (the pool too small for it alone)
    ended: float = 0.0
    decode: Node | None = None
    prefill: Node | None = None
    # Prompt + the tokens generated so far (the engine's `seq_len`): kept up by `Node._emit`,
    # not derived, as every step reads it for every request in flight.
    context: int = field(init=False)

    def __post_init__(self) -> None:
        self.context = self.arrival.prompt_len

    @property
    def pending(self) -> int:
        """Tokens still to run through the model before its next token is sampled."""
        return self.context - self.kv_len


class PagePool:
    """A node's KV pages as the engine counts them (engine/memory/allocator.py): free + used +
    cached == total. Cached pages are the full pages a finished or retracted request left in the
    node's prefix cache (engine/memory/radix_cache.py), one entry per request, evicted whole and
    least recently used first when the free pages run short; they count as available."""

    def __init__(self, total: int, page_size: int) -> None:
        self.total = total
        self.page_size = page_size
        self.used = 0
        self.cached: OrderedDict[int, int] = OrderedDict()  # request index -> pages, LRU first
        self.cached_pages = 0

    @property
    def free(self) -> int:
        return self.total - self.used - self.cached_pages

    @property
    def available(self) -> int:
        """Pages a reservation could get: free now plus what eviction could free."""
        return self.total - self.used

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def take(self, pages: int) -> bool:
        """`pages` more in use, evicting cached entries if needed; False (nothing changed) if
        even eviction cannot make room."""
        if pages > self.available:
            return False
        while pages > self.free:
            _, evicted = self.cached.popitem(last=False)
            self.cached_pages -= evicted
        self.used += pages
        return True

    def give_back(self, pages: int, key: int, keep: int) -> None:
        """`pages` no longer in use; the first `keep` of them stay cached under `key`."""
        self.used -= pages
        if keep:
            self.cached[key] = keep
            self.cached_pages += keep

    def attach(self, key: int) -> int:
        """In use again: the pages cached under `key` (0 if evicted since)."""
        pages = self.cached.pop(key, 0)
        self.cached_pages -= pages
        self.used += pages
        return pages

    def check(self) -> None:
        """free + used + cached == total, none of them negative (tests call it after a run)."""
        if min(self.free, self.used, self.cached_pages) < 0 or self.cached_pages != sum(
            self.cached.values()
        ):
            raise AssertionError(
                f"pages: {self.used} used + {self.cached_pages} cached of {self.total}"
            )


class Node:
    """One node's queues and KV pages; `role` is prefill, decode or colocated.

    A decode or colocated node's pages in use are its requests' `pages` (decode: the parked
    ones' too); a prefill node holds a prompt's pages whole from admission to the end of its
    transfer and caches nothing (its prefix hits are the arrivals' `cached_len`)."""

    def __init__(self, sim: Simulation, role: str, index: int) -> None:
        self.sim = sim
        self.role = role
        self.name = f"{role}-{index}"
        self.prealloc: deque[SimRequest] = deque()  # D: waiting for pages for its prompt
        self.waiting: deque[SimRequest] = deque()  # P/colocated: to prefill; D: retracted
        self.running: list[SimRequest] = []  # in admission order: the newest is retracted
        self.arrived: list[SimRequest] = []  # D: transfer done, joins at the next step
        self.sent: list[SimRequest] = []  # P: transfer complete, pages freed at the step's end
        self.parked = 0  # D: requests between prealloc and the running batch (pages held)
        profile = sim.profile
        self.pool = PagePool(profile.max_total_tokens // profile.page_size, profile.page_size)
        self.assigned = 0  # requests routed here and not finished (the gateway's load)
        self.retractions = 0
        self.recomputed_tokens = 0  # prefilled again after a retraction
        self.stepping = False

    def _grow(self, req: SimRequest, tokens: int) -> bool:
        """Pages for `req`'s first `tokens` tokens; False (nothing changed) if the pool is short."""
        need = max(0, self.pool.pages(tokens) - req.pages)
        if not self.pool.take(need):
            return False
        req.pages += need
        return True

    def _release(self, req: SimRequest, cache: bool) -> None:
        """`req`'s pages back; with `cache`, its full pages stay in the prefix cache."""
        full = req.kv_len // self.pool.page_size if cache else 0
        self.pool.give_back(req.pages, req.index, min(full, req.pages))
        req.pages = 0
        req.kv_len = 0

    def _attach_cached(self, req: SimRequest) -> int:
        """On admission: a retracted request's pages still in the prefix cache, and as many
        tokens less to prefill again (engine/kv_manager.py `attach_prefix`); returns them."""
        if req.pages or not req.retractions:
            return 0
        req.pages = self.pool.attach(req.index)
        req.kv_len = req.pages * self.pool.page_size
        return req.pages

    # -- work arriving --------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        (self.prealloc if self.role == "decode" else self.waiting).append(req)
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
        if self.role == "decode" and self.arrived:
            self._take_over()
        decoding, prefilling = self._split_running()
        if self.role == "decode" and self.prealloc:
            self._admit_prealloc(len(decoding))
        if decoding and not self._reserve_decodes(decoding):
            decoding, prefilling = self._split_running()  # less the retracted ones
        plan = self._prefill_plan(prefilling, len(decoding)) if prefilling or self.waiting else []
        if not plan and not decoding:
            return
        context = sum([r.context for r in decoding]) / len(decoding) if decoding else 0.0
        if plan:
            chunks = [(n, req.kv_len) for req, n in plan]
            self.recomputed_tokens += sum(n for req, n in plan if req.retractions)
            work = self.sim.profile.mixed_s(chunks, len(decoding), context)
        else:  # what mixed_s makes of no chunks
            work = self.sim.profile.decode_s(len(decoding), context)
        self.stepping = True
        self.sim.begin_step(work, lambda: self._end_step(decoding, plan))

    def _split_running(self) -> tuple[list[SimRequest], list[SimRequest]]:
        """The running requests that decode this step (a token emitted, none pending but the
        one it feeds back) and those still prefilling, in admission order; a prefill node
        decodes none of them."""
        decoding: list[SimRequest] = []
        prefilling: list[SimRequest] = []
        for req in self.running:
            if req.emitted and req.context - req.kv_len == 1:
                decoding.append(req)
            else:
                prefilling.append(req)
        return ([], prefilling) if self.role == "prefill" else (decoding, prefilling)

    def _end_step(self, decoding: list[SimRequest], plan: list[tuple[SimRequest, int]]) -> None:
        now = self.sim.now
        self.stepping = False
        for req in self.sent:
            self._free_prefill(req)
        self.sent.clear()
        for req in decoding:  # one token each, nothing else touched them during the step
            req.kv_len += 1
            self._emit(req, now)
        for req, n in plan:
            req.kv_len += n
            if req.pending:
                continue  # a chunk that leaves part of the prompt for a later step
            if self.role == "prefill":
                self.running.remove(req)
                done_at = now + self.sim.profile.transfer_s(req.arrival.prompt_len)
                self.sim.at(done_at, functools.partial(self._transfer_complete, req))
            else:
                self._emit(req, now)  # the token after a last chunk
        self.kick()

    def _reserve_decodes(self, decoding: list[SimRequest]) -> bool:
        """One more KV slot per decoding request, retracting the newest running request while
        the pool is short (engine/scheduler.py `_reserve_decodes`); False when it was short:
        the running requests may have changed."""
        pages, page_size = self.pool.pages, self.pool.page_size
        short = [r for r in decoding if r.kv_len >= r.pages * page_size]  # its pages are full
        if not short:  # the common case: no page fills up this step
            return True
        if self.pool.take(sum(pages(r.kv_len + 1) - r.pages for r in short)):
            for req in short:  # all at once: the next most common case
                req.pages = pages(req.kv_len + 1)
            return True
        for req in list(decoding):
            while req in self.running and not self._grow(req, req.kv_len + 1):
                if not self._retract_newest():
                    break
        return False

    def _retract_newest(self) -> bool:
        """The newest running request back to the front of the waiting queue, its KV freed and
        its tokens kept: it is prefilled again, prompt + generated tokens, on this node, less
        the full pages of them still in the prefix cache then. Alone, it is aborted as the
        engine does (the pool is too small for it); False then."""
        if len(self.running) <= 1:
            if self.running:
                self._abort(self.running[0], "kv_pool_exhausted")
            return False
        victim = self.running.pop()
        self._release(victim, cache=True)
        victim.retractions += 1
        self.retractions += 1
        self.waiting.appendleft(victim)
        return True

    def _prefill_plan(
        self, prefilling: list[SimRequest], num_decoding: int
    ) -> list[tuple[SimRequest, int]]:
        """Prefill chunks under the token budget: partly prefilled requests first, then the
        waiting queue's head while it can be admitted (engine/scheduler.py `_schedule`)."""
        budget = self.sim.profile.chunked_prefill_size
        plan: list[tuple[SimRequest, int]] = []
        for req in prefilling:
            if budget <= 0:
                break
            chunk = min(req.pending, budget)
            if self.role != "prefill" and not self._grow(req, req.kv_len + chunk):
                break
            plan.append((req, chunk))
            budget -= chunk
        cap = self.sim.profile.max_running_requests
        while budget > 0 and self.waiting and len(self.running) + self.parked < cap:
            req = self.waiting[0]
            if not self._admit(req, budget, num_decoding):
                break
            chunk = min(req.pending, budget)
            self.waiting.popleft()
            self.running.append(req)
            plan.append((req, chunk))
            budget -= chunk
        return plan

    def _admit(self, req: SimRequest, chunk_budget: int, num_decoding: int) -> bool:
        """Take the pages admitting `req` takes; False (nothing taken) if the pool is short."""
        if self.role == "prefill":  # the prompt's pages whole, held until its transfer ends
            return self.pool.take(self.pool.pages(req.arrival.prompt_len))
        # A page kept per decoding request for its next step (engine/scheduler.py
        # `_can_admit`), then the prefix cache's pages and the first chunk's.
        if self.pool.available <= num_decoding:
            return False
        attached = self._attach_cached(req)
        if self._grow(req, req.kv_len + min(req.pending, chunk_budget)):
            return True
        if attached:
            self._release(req, cache=True)  # back to the cache, most recently used
        return False

    def _admit_prealloc(self, decoding: int) -> None:
        """D: publish a destination for each request at the prealloc queue's head while the pool
        holds its prompt + decode_headroom tokens beside a page per decoding request; only the
        prompt's pages are taken (decode_node/decode_role.py `_admit`)."""
        # retracted requests (a decode node's only waiting ones) go first
        if self.waiting or not self.prealloc:
            return
        profile = self.sim.profile
        while self.prealloc:
            req = self.prealloc[0]
            need = self.pool.pages(req.arrival.prompt_len + profile.decode_headroom) + decoding
            busy = len(self.running) + self.parked
            if busy >= profile.max_running_requests or self.pool.available < need:
                return
            self.prealloc.popleft()
            self._grow(req, req.arrival.prompt_len)
            self.parked += 1
            assert req.prefill is not None
            self.sim.at(
                self.sim.now + profile.handoff_s, functools.partial(req.prefill.submit, req)
            )

    def _take_over(self) -> None:
        for req in self.arrived:
            self.parked -= 1
            req.kv_len = req.arrival.prompt_len
            self.running.append(req)
            self._emit(req, self.sim.now)  # the first token, sampled by the prefill node
        self.arrived.clear()

    def _transfer_complete(self, req: SimRequest) -> None:
        assert req.decode is not None
        req.decode.transfer_done(req)
        if self.stepping:
            self.sent.append(req)
        else:  # idle: the freed pages may admit the head of its waiting queue
            self._free_prefill(req)
            self.kick()

    def _free_prefill(self, req: SimRequest) -> None:
        self.pool.give_back(self.pool.pages(req.arrival.prompt_len), req.index, keep=0)
        self.assigned -= 1

    def _emit(self, req: SimRequest, now: float) -> None:
        """`req`'s next token, leaving the node now; the request ends with its last one."""
        req.emitted.append(now + self.sim.profile.gateway_s)
        req.context += 1
        self.sim.streamed.append(now)
        if len(req.emitted) >= req.arrival.output_len:
            self._end(req, now)

    def _abort(self, req: SimRequest, error: str) -> None:
        req.error = error
        self._end(req, self.sim.now)

    def _end(self, req: SimRequest, now: float) -> None:
        req.ended = now + self.sim.profile.gateway_s
        self.running.remove(req)
        self._release(req, cache=not req.error)
        self.assigned -= 1
        self.sim.finished(req)


@dataclass(eq=False, slots=True)
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
        self._shared_cores = host.host_cores > 0
        self._factor = 1.0  # every step in flight runs this many times slower than profiled
        self._since = 0.0  # when the factor was last set
        # The step in flight that ends first at the current factor: (when, seq, step). It is
        # kept beside the event queue, not in it: every step that starts or ends moves every
        # end time, and an event per step in flight each time filled the queue with stale ones.
        self._next_end: tuple[float, int, _Step] | None = None

    @property
    def nodes(self) -> list[Node]:
        return self.prefill_nodes + self.decode_nodes

    @property
    def retractions(self) -> int:
        """Requests retracted on any node so far (each node counts its own: `Node.retractions`)."""
        return sum(node.retractions for node in self.nodes)

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
        self._share(started=_Step(work, end))

    def _step_ended(self, step: _Step) -> None:
        self._share(ended=step)
        step.end()

    def _share(self, started: _Step | None = None, ended: _Step | None = None) -> None:
        """Every step in flight progressed to now at the factor so far; then, `started` in or
        `ended` out, the new factor and each one's end at it. The first of them (the earliest
        started among equals) is the next end, ordered among the events as if queued now."""
        now, steps = self.now, self._steps
        done = (now - self._since) / self._factor
        for step in steps:
            step.work -= done
        self._since = now
        if started is not None:
            steps.append(started)
        if ended is not None:
            steps.remove(ended)
        # contention() is the slowdown alone where no cores are shared
        self._factor = factor = self.contention() if self._shared_cores else self.host.slowdown
        first: _Step | None = None
        first_at = 0.0
        for step in steps:
            end_at = now + (step.work if step.work > 0.0 else 0.0) * factor  # max(0.0, work)
            if first is None or end_at < first_at:
                first, first_at = step, end_at
        self._next_end = None if first is None else (first_at, next(self._seq), first)

    def background_cores(self) -> float:
        """Cores the host spends outside engine steps: its recent token rate x cost per token."""
        while self.streamed and self.streamed[0] < self.now - HOST_WINDOW_S:
            self.streamed.popleft()
        per_token = self.host.overhead(bool(self.prefill_nodes))
        return per_token * len(self.streamed) / HOST_WINDOW_S

    def run(self, arrivals: Sequence[Arrival]) -> list[RequestTrace]:
        requests = [SimRequest(i, a, kv_len=a.cached_len) for i, a in enumerate(arrivals)]
        for req in requests:
            self.at(req.arrival.at, functools.partial(self._arrive, req))
        events = self._events
        while events or self._next_end is not None:
            end = self._next_end
            # the next step end first if it is earlier than the next event, or as early and
            # drawn its sequence number first
            if end is not None and (
                not events
                or end[0] < events[0][0]
                or (end[0] == events[0][0] and end[1] < events[0][1])
            ):
                self.now = end[0]
                self._step_ended(end[2])
            else:
                self.now, _, action = heapq.heappop(events)
                action()
        if len(self.done) != len(requests):
            stuck = len(requests) - len(self.done)
            raise RuntimeError(f"{stuck} requests never finished: a request too large for a node?")
        self.check_pages()
        return [self._trace(r) for r in requests]

    def check_pages(self) -> None:
        """After a run: every node's pool adds up and no page is left in use (a leak)."""
        for node in self.nodes:
            node.pool.check()
            if node.pool.used:
                raise AssertionError(f"{node.name}: {node.pool.used} pages in use after the run")

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
            done=req.ended,
            error=req.error,
            error_detail="the KV pool is too small for this request alone" if req.error else "",
            prompt_tokens=req.arrival.prompt_len,
            output_tokens=len(req.emitted),
            session=req.index,
        )
