"""Running one choice on the cluster: retries before its first token, migration after it.

`Generation` is one choice (one prompt): iterate it for its token chunks; afterwards `finished`
(usage over every node it ran on), `cached_tokens` and `route` (its last nodes) say how it ended.

Attempts: while every decode node is at its running-request cap the choice waits at the gateway
(gateway/dispatch/decode_line.py); then the router picks a (prefill?, decode) pair; `PDStream` sends
to both. If the attempt fails before the first token reached us (a node is unreachable, refuses, or
the KV hand-off fails), the failed node is excluded and the next attempt goes elsewhere (or to
the decode node alone when no other prefill node is left), up to `max_attempts`. Requests the
nodes call invalid (e.g. too long for their context) become a 400 at once. A failure after the
first token (the decode node died, its stream broke, or it aborted the request, e.g. while
shutting down) migrates the choice (gateway/dispatch/migration.py): the node is excluded and prompt
+ streamed tokens go to another pair, the chunks continuing the same iteration, up to
`migration_limit` moves; then `GenerationFailed` names every node that failed. Leaving the
iteration early (the HTTP client went away) cancels both node calls: the request is aborted on
both nodes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Collection, Sequence
from dataclasses import dataclass

import grpc

from bootstrap.security import RoomTickets
from gateway.config import RoutingConfig
from gateway.dispatch.decode_line import DecodeLine
from gateway.dispatch.lane import TokenLane
from gateway.dispatch.migration import Progress
from gateway.dispatch.pd_client import PDResult, PDStream
from gateway.dispatch.timeline import Timeline, assemble, current_trace
from gateway.errors import APIError, GenerationFailed, bad_request, unavailable
from gateway.metrics import GatewayMetrics
from gateway.routing.nodes import NodeDirectory
from gateway.routing.policies import Route, Router
from gateway.routing.prefix_index import PrefixIndex
from proto import node_pb2

logger = logging.getLogger("pdserve.gateway.dispatch")

_INVALID = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


@dataclass(frozen=True)
class AttemptFailure:
    node_id: str  # excluded from the next attempts
    reason: str
    kind: str  # metrics label: prefill | decode | handoff


class Dispatcher:
    def __init__(
        self,
        directory: NodeDirectory,
        config: RoutingConfig,
        metrics: GatewayMetrics,
        tickets: RoomTickets | None = None,
        index: PrefixIndex | None = None,
        worker_index: int = 0,
    ) -> None:
        """`worker_index`: which gateway worker this process is (routing, metric labels)."""
        self.directory = directory
        self.tickets = tickets  # signs each room's (prefill, decode) assignment for bootstrap
        self.router = Router(directory, config, index, worker_index)
        self.worker = str(worker_index)
        # this worker's series, looked up once (the batch counters move on every node message)
        self._batches = metrics.worker_node_batches.labels(self.worker)
        self._deltas = metrics.worker_node_deltas.labels(self.worker)
        self.worker_tokens = metrics.worker_completion_tokens.labels(self.worker)
        self.index = self.router.index
        self.config = config
        self.metrics = metrics
        self.line = DecodeLine(config.decode_hold_s)  # requests waiting for a decode slot
        directory.on_room = self.line.wake

    def generation(
        self,
        prompt_ids: list[int],
        sampling: node_pb2.SamplingParams,
        rid: str,
        lane: TokenLane | None = None,
    ) -> Generation:
        return Generation(self, prompt_ids, sampling, rid, lane)

    def count_batch(self, deltas: int) -> None:
        """A decode node's per-step message with `deltas` request deltas reached this worker."""
        self._batches.inc()
        self._deltas.inc(deltas)

    def enter(self, route: Route, prompt_tokens: int = 0, takes_slot: bool = False) -> bool:
        """Count a request routed to `route`; True when it counts against its decode node's
        cap at once: it prefills there, or the line released it (`takes_slot`). Otherwise it
        counts from its first token (`decoding`)."""
        for node in route.nodes:
            node.inflight += 1
            node.inflight_tokens += prompt_tokens
            self.metrics.node_requests.labels(node.role_name, node.node_id).inc()
            self.metrics.worker_node_requests.labels(
                self.worker, node.role_name, node.node_id
            ).inc()
        if route.prefill is None:
            self.metrics.local_prefills.inc()
        if route.prefill is None or takes_slot:
            route.decode.decoding += 1  # in (or waiting for) a slot there at once
            return True
        return False

    def decoding(self, route: Route) -> None:
        """The first token of a request prefilled elsewhere came from its decode node: its KV
        landed and it holds (or waits for) a running slot there."""
        route.decode.decoding += 1

    def leave(self, route: Route, prompt_tokens: int = 0, decoding: bool = False) -> None:
        """`decoding`: the request was counted in its decode node's `decoding`."""
        if decoding:
            current = self.directory.nodes.get(route.decode.node_id, route.decode)
            current.decoding = max(current.decoding - 1, 0)
        for node in route.nodes:
            current = self.directory.nodes.get(node.node_id, node)
            current.inflight = max(current.inflight - 1, 0)
            current.inflight_tokens = max(current.inflight_tokens - prompt_tokens, 0)
            current.left_tokens += prompt_tokens
            current.left_requests += 1
        self.line.wake()

    async def hold(self, excluded: Collection[str], rid: str) -> bool:
        """Wait in the line while every decode node (but `excluded`) is at its cap, or others
        wait already (gateway/dispatch/decode_line.py); at most --decode-hold. True when the line
        released the request to a node with room: route it and count its slot (`enter`'s
        `takes_slot`) before the next await, or the next in line takes the same slot."""
        if self.line.hold_s <= 0:
            return False  # off (--decode-hold 0)

        def blocked() -> bool:
            return self.router.decode_blocked(excluded)

        if not self.line.must_wait(blocked):
            return False  # a node has room and nobody waits
        m = self.metrics
        m.decode_held.inc()
        start = time.monotonic()
        try:
            routed = await self.line.turn(blocked)
        finally:
            m.decode_held.dec()
        m.decode_hold.observe(time.monotonic() - start)
        if not routed:
            m.decode_hold_expired.inc()
            logger.info(
                "request %s waited %.1f s (--decode-hold) for a decode node below its cap: "
                "sent to a node's queue",
                rid,
                self.config.decode_hold_s,
            )
        return routed


class Generation:
    def __init__(
        self,
        dispatcher: Dispatcher,
        prompt_ids: list[int],
        sampling: node_pb2.SamplingParams,
        rid: str,
        lane: TokenLane | None = None,
    ) -> None:
        """`lane`: the streamed choice's fast lane (gateway/dispatch/lane.py); each attempt puts its
        per-chunk bookkeeping on it."""
        self.dispatcher = dispatcher
        self.lane = lane
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.rid = rid
        self.progress = Progress(prompt_ids, sampling)
        metrics = dispatcher.metrics
        metrics.admitted_choices.inc()
        metrics.admitted_prompt_tokens.inc(len(prompt_ids))
        metrics.admitted_max_tokens.inc(self.progress.budget)
        self.finished: node_pb2.Finished | None = None
        self.cached_tokens = 0
        self.cache_node = ""  # whose prefix cache served `cached_tokens`: the one that prefilled
        # With sampling.prompt_logprobs: from the node that prefilled (prompt tokens 1..).
        self.prompt_logprobs: list[node_pb2.TokenLogprobs] = []
        self.route: Route | None = None
        self.attempts = 0
        self.timeline: Timeline | None = None
        trace = current_trace.get()
        self.trace = trace
        self.started = trace.started if trace is not None else time.monotonic()
        self._last_chunk = 0.0
        self._retries = 0  # failed attempts before the first token
        self._moved_at: float | None = None  # when the stream last moved to another node
        self._decoding = False  # this attempt is counted in its decode node's `decoding`

    def __aiter__(self) -> AsyncGenerator[node_pb2.TokenChunk, None]:
        return self._chunks()

    async def _chunks(self) -> AsyncGenerator[node_pb2.TokenChunk, None]:
        d = self.dispatcher
        progress = self.progress
        excluded: set[str] = set()
        while True:
            self.attempts += 1
            resumed = len(progress.streamed)
            released = False  # by the line: no await between here and `enter`
            if not progress.started and d.line.hold_s > 0:  # a moving stream never waits
                released = await d.hold(excluded, self.rid)
            route = self.route = self._choose(excluded)
            stream = PDStream(
                route.decode.target,
                route.prefill.target if route.prefill else None,
                progress.input_ids,
                progress.next_sampling(),
                rid=f"{self.rid}-{self.attempts - 1}",
                tickets=d.tickets,
                resumed_tokens=resumed,
                lane=self.lane,
                on_batch=d.count_batch,
            )
            if self.lane is not None:
                self.lane.observers = (stream.record, self._observe)
            self.finished = None
            failure: AttemptFailure | None = None
            self._decoding = d.enter(route, len(self.prompt_ids), takes_slot=released)
            try:
                async with contextlib.aclosing(aiter(stream)) as responses:
                    async for response in responses:
                        if response.HasField("chunk"):
                            self._observe(response.chunk.token_ids)
                            yield response.chunk
                        else:
                            self.finished = response.finished
                failure = self._check(stream.result, route, len(progress.streamed) > resumed)
            except grpc.aio.AioRpcError as exc:
                failure = self._decode_failed(exc, route, len(progress.streamed) > resumed)
            finally:
                if self.lane is not None:
                    self.lane.observers = ()
                d.leave(route, len(self.prompt_ids), self._decoding)
            if failure is None:
                assert self.finished is not None
                self.finished = progress.whole(self.finished, resumed)
                self._account(stream.result, route, self.started)
                return
            excluded.add(failure.node_id)
            if self._recover(failure, stream.result, route):
                return

    def _recover(self, failure: AttemptFailure, result: PDResult, route: Route) -> bool:
        """After a failed attempt: False to try again elsewhere (a retry before the first token,
        a migration after it), True when the choice is over after all; raises when it failed."""
        d = self.dispatcher
        progress = self.progress
        on = f"prefill node {route.prefill.node_id} -> " if route.prefill else ""
        on += f"decode node {route.decode.node_id}"
        progress.tried.append(f"attempt {self.attempts} on {on}: {failure.reason}")
        logger.warning(
            "request %s attempt %d failed after %d streamed tokens: %s",
            self.rid,
            self.attempts,
            len(progress.streamed),
            failure.reason,
            extra={"room": result.room},
        )
        if not progress.started:
            self._retries += 1
            d.metrics.retries.labels(failure.kind).inc()
            if self._retries >= d.config.max_attempts:
                raise unavailable(
                    f"no node could serve the request in {self._retries} attempts; "
                    f"last failure: {failure.reason}"
                )
            return False
        if progress.spent:  # every token is out: only the node's last word was lost
            self.finished = progress.ended_by_length()
            self._account(result, route, self.started)
            return True
        self._migrate(failure)
        return False

    def _observe(self, token_ids: Sequence[int]) -> None:
        """A chunk of tokens arrived (by the chain or the lane)."""
        m = self.dispatcher.metrics
        now = time.monotonic()
        if not self._decoding and self.route is not None:
            self._decoding = True
            self.dispatcher.decoding(self.route)
        if self.progress.started:
            m.itl.observe(now - self._last_chunk)
        else:
            m.ttft.observe(now - self.started)
        self._last_chunk = now
        if self._moved_at is not None:  # the first token from the node it moved to
            m.migration_gap.observe(now - self._moved_at)
            self._moved_at = None
        self.progress.streamed.extend(token_ids)

    def _choose(self, excluded: set[str]) -> Route:
        try:
            return self.dispatcher.router.choose(self.progress.input_ids, excluded)
        except APIError as exc:
            if not self.progress.started:
                raise
            raise self._out_of_moves(f"no node left to move it to: {exc.message}") from exc

    def _migrate(self, failure: AttemptFailure) -> None:
        """Move the streaming choice to another node, or end it when it has moved enough."""
        d = self.dispatcher
        progress = self.progress
        if progress.migrations >= d.config.migration_limit:
            moved = f"it was already moved {progress.migrations} times (--migration-limit)"
            raise self._out_of_moves(moved)
        progress.migrations += 1
        self._moved_at = time.monotonic()
        d.metrics.migrations.labels(failure.kind).inc()
        logger.info(
            "request %s: moving to another node after %d streamed tokens (move %d of %d)",
            self.rid,
            len(progress.streamed),
            progress.migrations,
            d.config.migration_limit,
        )

    def _out_of_moves(self, why: str) -> GenerationFailed:
        self.dispatcher.metrics.failures.inc()
        progress = self.progress
        return GenerationFailed(
            f"the request failed after {len(progress.streamed)} streamed tokens and {why}; "
            f"nodes tried: {'; '.join(progress.tried)}"
        )

    def _check(self, result: PDResult, route: Route, sent: bool) -> AttemptFailure | None:
        """How the attempt ended: None when it finished; else which node to blame. `sent`:
        the attempt streamed tokens (then only the decode node can be at fault)."""
        finished = self.finished
        if finished is not None and finished.finish_reason != "abort":
            return None
        detail = finished.detail if finished is not None else ""
        if sent:
            reason = (
                f"decode node {route.decode.node_id} aborted the request after "
                f"{len(result.token_ids)} tokens: {detail or result.prefill_error or 'no reason'}"
            )
            return AttemptFailure(route.decode.node_id, reason, "decode")
        current = self.dispatcher.directory.nodes.get(route.decode.node_id)
        if current is not None and current.load.draining:  # D gave it up on its way out
            reason = f"decode node {route.decode.node_id} is draining: {detail}"
            return AttemptFailure(route.decode.node_id, reason, "decode")
        if route.prefill is not None and (result.prefill_error or finished is None):
            if result.prefill_code == grpc.StatusCode.UNAVAILABLE:
                self.dispatcher.directory.report_unreachable(route.prefill.node_id)
            reason = f"prefill node {route.prefill.node_id}: {result.prefill_error or detail}"
            return AttemptFailure(route.prefill.node_id, reason, "prefill")
        if route.prefill is not None:  # D aborted before any token: the hand-off failed
            reason = f"KV hand-off from {route.prefill.node_id} to {route.decode.node_id}: {detail}"
            return AttemptFailure(route.prefill.node_id, reason, "handoff")
        reason = f"decode node {route.decode.node_id}: {detail or 'stream ended without a result'}"
        return AttemptFailure(route.decode.node_id, reason, "decode")

    def _decode_failed(self, exc: grpc.aio.AioRpcError, route: Route, sent: bool) -> AttemptFailure:
        code, details = exc.code(), exc.details() or ""
        if code in _INVALID and not self.progress.started:
            raise bad_request(None, f"the decode node refused the request: {details}")
        if code == grpc.StatusCode.UNAVAILABLE:
            self.dispatcher.directory.report_unreachable(route.decode.node_id)
        blamed = route.decode.node_id
        if not sent and route.prefill is not None and route.prefill.node_id in details:
            blamed = route.prefill.node_id  # e.g. D does not know this P (yet)
        kind = "decode" if blamed == route.decode.node_id else "prefill"
        where = "mid-stream" if sent else "before its first token"
        reason = f"{kind} node {blamed} failed {where}: {code.name}: {details}"
        return AttemptFailure(blamed, reason, kind)

    def _account(self, result: PDResult, route: Route, started: float) -> None:
        m = self.dispatcher.metrics
        finished = self.finished
        assert finished is not None
        if route.prefill is not None and result.prefill is not None:
            self.cached_tokens = result.prefill.cached_tokens
            self.prompt_logprobs = list(result.prefill.prompt_logprobs)
            cache_node = route.prefill
        else:
            self.cached_tokens = finished.usage.cached_tokens
            self.prompt_logprobs = list(finished.prompt_logprobs)
            cache_node = route.decode
        self.cache_node = cache_node.node_id
        # What the nodes cache for this request, until their events say so (prefix_index.py):
        # a prefill node its prompt, the decode node prompt and output but the last token.
        index = self.dispatcher.index
        if route.prefill is not None:
            index.expect(route.prefill.node_id, self.prompt_ids)
        index.expect(route.decode.node_id, [*self.prompt_ids, *self.progress.streamed[:-1]])
        m.node_cached_tokens.labels(cache_node.role_name, cache_node.node_id).inc(
            self.cached_tokens
        )
        m.node_prompt_tokens.labels(cache_node.role_name, cache_node.node_id).inc(
            len(self.prompt_ids)
        )
        m.cached_tokens.inc(self.cached_tokens)
        m.prompt_tokens.inc(len(self.prompt_ids))
        m.completion_tokens.inc(finished.usage.completion_tokens)
        m.finished_max_tokens.inc(self.progress.budget)
        self.dispatcher.worker_tokens.inc(finished.usage.completion_tokens)
        m.e2e.observe(time.monotonic() - started)
        prefill = result.prefill if route.prefill is not None else None
        # Done: both calls over (P's answer may come after D's last token; the client waits).
        done = time.monotonic()
        self.timeline = assemble(started, result.sent_at, done, finished, prefill)
        if self.trace is not None:
            self.trace.timelines.append(self.timeline)
        logger.debug(
            "request %s (%s -> decode node %s) finished %s: %d tokens, %d cached on %s; "
            "timeline %s",
            self.rid,
            f"prefill node {route.prefill.node_id}" if route.prefill else "local prefill",
            route.decode.node_id,
            finished.finish_reason,
            finished.usage.completion_tokens,
            self.cached_tokens,
            self.cache_node,
            self.timeline.as_dict(),
            extra={"room": result.room},
        )
