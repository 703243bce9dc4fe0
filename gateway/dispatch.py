"""Running one choice on the cluster, with retries on other nodes before its first token.

`Generation` is one choice (one prompt, one room): iterate it for the decode node's token
chunks; afterwards `finished`, `cached_tokens` and `route` say how it ended and where it ran.

Attempts: the router picks a (prefill?, decode) pair; `PDStream` sends to both. If the attempt
fails before the first token reached us (a node is unreachable, refuses, or the KV hand-off
fails), the failed node is excluded and the next attempt goes elsewhere (or to the decode node
alone when no other prefill node is left), up to `max_attempts`. Requests the nodes call invalid
(e.g. too long for their context) become a 400 at once. A failure after the first token cannot be
hidden any more: it raises `GenerationFailed`. Leaving the iteration early (the HTTP client went
away) cancels both node calls: the request is aborted on both nodes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc

from bootstrap.security import RoomTickets
from gateway.config import RoutingConfig
from gateway.errors import GenerationFailed, bad_request, unavailable
from gateway.metrics import GatewayMetrics
from gateway.nodes import NodeDirectory
from gateway.pd_client import PDResult, PDStream
from gateway.routing import Route, Router
from gateway.timeline import Timeline, assemble, current_trace
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
    ) -> None:
        self.directory = directory
        self.tickets = tickets  # signs each room's (prefill, decode) assignment for bootstrap
        self.router = Router(directory, config)
        self.config = config
        self.metrics = metrics

    def generation(
        self, prompt_ids: list[int], sampling: node_pb2.SamplingParams, rid: str
    ) -> Generation:
        return Generation(self, prompt_ids, sampling, rid)

    def enter(self, route: Route) -> None:
        for node in route.nodes:
            node.inflight += 1
            self.metrics.node_requests.labels(node.role_name, node.node_id).inc()
        if route.prefill is None:
            self.metrics.local_prefills.inc()

    def leave(self, route: Route) -> None:
        for node in route.nodes:
            current = self.directory.nodes.get(node.node_id, node)
            current.inflight = max(current.inflight - 1, 0)


class Generation:
    def __init__(
        self,
        dispatcher: Dispatcher,
        prompt_ids: list[int],
        sampling: node_pb2.SamplingParams,
        rid: str,
    ) -> None:
        self.dispatcher = dispatcher
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.rid = rid
        self.finished: node_pb2.Finished | None = None
        self.cached_tokens = 0
        # With sampling.prompt_logprobs: from the node that prefilled (prompt tokens 1..).
        self.prompt_logprobs: list[node_pb2.TokenLogprobs] = []
        self.route: Route | None = None
        self.attempts = 0
        self.timeline: Timeline | None = None
        trace = current_trace.get()
        self.trace = trace
        self.started = trace.started if trace is not None else time.monotonic()

    def __aiter__(self) -> AsyncGenerator[node_pb2.TokenChunk, None]:
        return self._chunks()

    async def _chunks(self) -> AsyncGenerator[node_pb2.TokenChunk, None]:
        d = self.dispatcher
        excluded: set[str] = set()
        failure: AttemptFailure | None = None
        started = self.started
        for attempt in range(d.config.max_attempts):
            self.attempts = attempt + 1
            route = self.route = d.router.choose(self.prompt_ids, excluded)
            stream = PDStream(
                route.decode.target,
                route.prefill.target if route.prefill else None,
                self.prompt_ids,
                self.sampling,
                rid=f"{self.rid}-{attempt}",
                tickets=d.tickets,
            )
            sent = False
            last_chunk = 0.0
            d.enter(route)
            try:
                async with contextlib.aclosing(aiter(stream)) as responses:
                    async for response in responses:
                        if response.HasField("chunk"):
                            now = time.monotonic()
                            if sent:
                                d.metrics.itl.observe(now - last_chunk)
                            else:
                                d.metrics.ttft.observe(now - started)
                            sent, last_chunk = True, now
                            yield response.chunk
                        else:
                            self.finished = response.finished
                failure = self._check(stream.result, route, sent)
            except grpc.aio.AioRpcError as exc:
                failure = self._decode_failed(exc, route, sent)
            finally:
                d.leave(route)
            if failure is None:
                self._account(stream.result, route, started)
                return
            excluded.add(failure.node_id)
            d.metrics.retries.labels(failure.kind).inc()
            logger.warning(
                "request %s attempt %d failed: %s",
                self.rid,
                attempt + 1,
                failure.reason,
                extra={"room": stream.result.room},
            )
        assert failure is not None
        raise unavailable(
            f"no node could serve the request in {d.config.max_attempts} attempts; "
            f"last failure: {failure.reason}"
        )

    def _check(self, result: PDResult, route: Route, sent: bool) -> AttemptFailure | None:
        finished = self.finished
        if finished is not None and finished.finish_reason != "abort":
            return None
        detail = finished.detail if finished is not None else ""
        if sent:
            self.dispatcher.metrics.failures.inc()
            raise GenerationFailed(
                f"decode node {route.decode.node_id} aborted the request after "
                f"{len(result.token_ids)} tokens: {detail or result.prefill_error or 'no reason'}"
            )
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
        if code in _INVALID:
            raise bad_request(None, f"the decode node refused the request: {details}")
        if sent:
            self.dispatcher.metrics.failures.inc()
            raise GenerationFailed(
                f"decode node {route.decode.node_id} failed mid-stream: {code.name}: {details}"
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            self.dispatcher.directory.report_unreachable(route.decode.node_id)
        blamed = route.decode.node_id
        if route.prefill is not None and route.prefill.node_id in details:
            blamed = route.prefill.node_id  # e.g. D does not know this P (yet)
        kind = "decode" if blamed == route.decode.node_id else "prefill"
        return AttemptFailure(blamed, f"{code.name}: {details}", kind)

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
        m.node_cached_tokens.labels(cache_node.role_name, cache_node.node_id).inc(
            self.cached_tokens
        )
        m.prompt_tokens.inc(len(self.prompt_ids))
        m.completion_tokens.inc(finished.usage.completion_tokens)
        m.e2e.observe(time.monotonic() - started)
        prefill = result.prefill if route.prefill is not None else None
        # Done: both calls over (P's answer may come after D's last token; the client waits).
        done = time.monotonic()
        self.timeline = assemble(started, result.sent_at, done, finished, prefill)
        if self.trace is not None:
            self.trace.timelines.append(self.timeline)
        logger.debug(
            "request %s (%s -> decode node %s) finished %s: %d tokens; timeline %s",
            self.rid,
            f"prefill node {route.prefill.node_id}" if route.prefill else "local prefill",
            route.decode.node_id,
            finished.finish_reason,
            finished.usage.completion_tokens,
            self.timeline.as_dict(),
            extra={"room": result.room},
        )
