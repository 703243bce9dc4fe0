"""`GenerateStream`: many requests over one gRPC call, answered with one batch per engine step.

A gateway keeps one such call per node (gateway/dispatch/pd_client.py, `GenerateMux`). On it the
client opens requests (`StreamRequest.open`, a `GenerateRequest` with a rid) and cancels them
(`cancel_rid`); the node sends `StreamBatch`es, each with at most one `RequestDelta` per request:
the tokens since the last batch, then the `Finished`, or an `error` for a refused request. A
per-request `Generate` costs the node one gRPC message per request per token; here it is one
per step for all of the call's requests.

Backpressure: a client that reads slowly holds up the writer (gRPC flow control); meanwhile the
deltas of further steps merge into the pending ones, so the engine never waits. What a request
has not sent is bounded: past `max_unsent_tokens` (`--stream-buffer-tokens`) it is aborted,
its pages freed and its unsent tokens dropped, and its delta becomes an `error`
(RESOURCE_EXHAUSTED, naming the flag) that the client gets once it reads again; the gateway
takes it as a failed attempt (moves the request elsewhere or answers the error). Not a pause
(the request would hold its pages for a reader that may never come back, and the scheduler
would need a parked state for it), not dropped tokens (a wrong answer): a client that far
behind is gone in all but name. The call ending early (client gone, connection lost) aborts
every request still running on it, which frees their pages at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from engine.engine_loop import RequestFinish, TokenLogprobs
from engine.node.streams import OutputReceiver, chunk_to_proto, finished_to_proto
from engine.request import Req
from proto import node_pb2


class RequestError(Exception):
    """A request that must be refused with `code`; the message says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class StreamHost(Protocol):
    """What a stream needs from the node service (engine/node/service.py, `NodeService`)."""

    async def accept(self, request: node_pb2.GenerateRequest) -> Req: ...

    def open(self, req: Req, receiver: OutputReceiver) -> None: ...

    def close(self, req: Req, aborted: bool) -> None: ...


@dataclass
class _Pending:
    """One request's output not yet sent on the call."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: RequestFinish | None = None
    error: node_pb2.RequestError | None = None

    def to_proto(self, rid: str) -> node_pb2.RequestDelta:
        delta = node_pb2.RequestDelta(rid=rid)
        if self.token_ids:
            delta.chunk.CopyFrom(chunk_to_proto(self.token_ids, self.logprobs))
        if self.finish is not None:
            delta.finished.CopyFrom(finished_to_proto(self.finish))
        if self.error is not None:
            delta.error.CopyFrom(self.error)
        return delta


# Tokens a request may have waiting for its client (a stalled reader): far above what a step,
# a burst or a paused gateway (GC, a busy event loop) leaves, far below a node's memory
MAX_UNSENT_TOKENS = 4096


class StreamConnection:
    """The requests of one `GenerateStream` call; an `OutputReceiver` for all of them."""

    def __init__(self, host: StreamHost, max_unsent_tokens: int = MAX_UNSENT_TOKENS) -> None:
        self.host = host
        self.max_unsent_tokens = max_unsent_tokens
        self.live: dict[str, Req] = {}  # opened, not finished, not cancelled
        self.ready = asyncio.Event()
        self._pending: dict[str, _Pending] = {}

    def add_tokens(self, rid: str, token_ids: list[int], logprobs: TokenLogprobs | None) -> None:
        pending = self._pending.get(rid)
        if pending is None:
            pending = self._pending[rid] = _Pending()
        pending.token_ids.extend(token_ids)
        if logprobs is not None:
            pending.logprobs.append(logprobs)
        if len(pending.token_ids) > self.max_unsent_tokens:
            self._overflow(rid, len(pending.token_ids))
        self.ready.set()

    def _overflow(self, rid: str, unsent: int) -> None:
        """The client is too far behind on `rid`: abort it, keep only the error for the client."""
        req = self.live.pop(rid, None)
        if req is not None:
            self.host.close(req, aborted=True)
        del self._pending[rid]
        self.refuse(
            rid,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"request {rid!r}: its client left {unsent} tokens unread, more than the "
            f"{self.max_unsent_tokens} a request may hold on this node (--stream-buffer-tokens): "
            "aborted and its pages freed",
        )

    def end(self, finish: RequestFinish) -> None:
        self._pending.setdefault(finish.rid, _Pending()).finish = finish
        req = self.live.pop(finish.rid, None)
        if req is not None:
            self.host.close(req, aborted=False)
        self.ready.set()

    def refuse(self, rid: str, code: grpc.StatusCode, message: str) -> None:
        error = node_pb2.RequestError(code=code.value[0], message=message)
        self._pending.setdefault(rid, _Pending()).error = error
        self.ready.set()

    async def open(self, request: node_pb2.GenerateRequest) -> None:
        rid = request.rid
        if not rid:
            # Without a rid the client could not tell the answers apart: refuse the call.
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "GenerateStream: every open needs a rid"
            )
        if rid in self.live or rid in self._pending:
            self.refuse(rid, grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is on this call")
            return
        try:
            req = await self.host.accept(request)
        except RequestError as exc:
            self.refuse(rid, exc.code, str(exc))
            return
        self.live[rid] = req
        self.host.open(req, self)

    def cancel(self, rid: str) -> None:
        req = self.live.pop(rid, None)
        self._pending.pop(rid, None)
        if req is not None:
            self.host.close(req, aborted=True)

    def cancel_all(self) -> None:
        for rid in list(self.live):
            self.cancel(rid)

    def take(self) -> node_pb2.StreamBatch:
        batch = node_pb2.StreamBatch(
            deltas=[pending.to_proto(rid) for rid, pending in self._pending.items()]
        )
        self._pending = {}
        return batch


async def serve_stream(
    host: StreamHost,
    requests: AsyncIterator[node_pb2.StreamRequest],
    max_unsent_tokens: int = MAX_UNSENT_TOKENS,
) -> AsyncIterator[node_pb2.StreamBatch]:
    """The `GenerateStream` handler: read opens and cancels, write one batch per wake-up.

    Ends once the client has half-closed and every request on the call has ended.
    """
    conn = StreamConnection(host, max_unsent_tokens)
    reader = asyncio.create_task(_read(conn, requests))
    try:
        while True:
            conn.ready.clear()
            batch = conn.take()
            if batch.deltas:
                yield batch  # more may come meanwhile: take again before deciding to wait
                continue
            if reader.done() and (not conn.live or reader.exception() is not None):
                break
            await conn.ready.wait()
        reader.result()  # a failed read (e.g. a request without a rid) fails the call
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        conn.cancel_all()


async def _read(conn: StreamConnection, requests: AsyncIterator[node_pb2.StreamRequest]) -> None:
    try:
        async for message in requests:
            if message.HasField("open"):
                await conn.open(message.open)
            elif message.HasField("cancel_rid"):
                conn.cancel(message.cancel_rid)
    finally:
        conn.ready.set()  # the writer notices the end of the client's side
