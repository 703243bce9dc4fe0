"""Send one request through a prefill/decode pair: the gateway's core call (docs/architecture.md,
the request life cycle).

`Generate(room, P id)` goes to the decode node and `Prefill(room, D id)` to the prefill node at
the same time; the decode node streams the tokens. Without a prefill node the decode node
prefills locally (colocated). If the prefill call fails before the decode node produced a token,
the decode call is cancelled so that its pages are released at once instead of waiting for the
transfer timeout.

Once the decode node has ended the request with an abort (it gave the room up, or bootstrap
failed it), the prefill node's answer is awaited for at most `PREFILL_ANSWER_GRACE_S` and then
the call is cancelled (the request is aborted on P): a frozen prefill node, or one waiting for a
destination that a restarted bootstrap forgot, must not hold the request past D's own timeouts.

`PDStream` yields the decode node's responses as they arrive (the gateway streams them on);
`pd_generate` runs one request to completion. Leaving a `PDStream` early (the consumer stops
iterating or is cancelled, e.g. because the HTTP client went away) cancels both calls, which
aborts the request on both nodes.

The decode side does not open a gRPC call per request: all requests of this process to one node
share one `GenerateStream` call (`GenerateMux`, one per stub), which the node answers with one
batch per engine step for all of them (engine/node/multiplex.py). Cancelling a request sends
`cancel_rid` on that call. A node without `GenerateStream` (UNIMPLEMENTED) is served with one
`Generate` call per request instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeAlias

import grpc

from bootstrap.security import RoomTickets
from gateway.dispatch.lane import TokenLane
from gateway.routing.nodes import NodeTarget
from proto import node_pb2, node_pb2_grpc

logger = logging.getLogger("pdserve.gateway.pd_client")

# After D aborted, P normally answers within milliseconds (it reported the failure itself).
PREFILL_ANSWER_GRACE_S = 2.0


def new_room() -> int:
    """A random non-zero 63-bit bootstrap room."""
    return secrets.randbits(63) or 1


@dataclass
class PDResult:
    room: int
    token_ids: list[int] = field(default_factory=list)
    first_chunk_at: float = 0.0  # monotonic arrival of the first chunk (0: none yet)
    last_chunk_at: float = 0.0  # ... and of the latest
    sent_at: float = 0.0
    finished_at: float = 0.0  # monotonic arrival of the decode node's Finished
    finished: node_pb2.Finished | None = None
    prefill: node_pb2.PrefillResponse | None = None
    prefill_error: str = ""
    prefill_code: grpc.StatusCode | None = None

    @property
    def ttft_s(self) -> float:
        return self.first_chunk_at - self.sent_at if self.first_chunk_at else float("nan")

    @property
    def e2e_s(self) -> float:
        return self.last_chunk_at - self.sent_at if self.last_chunk_at else float("nan")


# Told the number of request deltas in each per-step message a mux receives (metrics).
BatchObserver: TypeAlias = Callable[[int], None]


class PDStream:
    """One request on a (decode, optional prefill) pair; iterate once for D's responses.

    Raises grpc.aio.AioRpcError if the decode node refuses or fails. When the prefill call fails
    first, iteration simply ends with `result.finished` None and `result.prefill_error` set.
    """

    def __init__(
        self,
        decode: NodeTarget,
        prefill: NodeTarget | None,
        input_ids: list[int],
        sampling: node_pb2.SamplingParams,
        room: int | None = None,
        rid: str = "",
        tickets: RoomTickets | None = None,
        resumed_tokens: int = 0,
        lane: TokenLane | None = None,
        on_batch: BatchObserver | None = None,
    ) -> None:
        """`resumed_tokens`: the last this many `input_ids` were generated for the request on
        another node (a migrated request, gateway/dispatch/migration.py). `lane`: the streamed
        choice's fast lane (gateway/dispatch/lane.py), which the mux's reader may hand this call's
        chunks to; whoever gave it puts `record` among its observers. `on_batch`: told the size of
        every per-step message the decode node's mux receives (`GenerateMux.for_stub`)."""
        self.decode = decode
        self.lane = lane
        self.on_batch = on_batch
        self.prefill = prefill
        room = (room or new_room()) if prefill is not None else 0
        self.rid = rid or f"r{room or new_room()}"
        self.result = PDResult(room=room)
        self._generate = node_pb2.GenerateRequest(
            rid=self.rid,
            input_ids=input_ids,
            sampling=sampling,
            bootstrap_room=room,
            prefill_node_id=prefill.node_id if prefill else "",
            resumed_tokens=resumed_tokens,
        )
        if tickets is not None and prefill is not None:
            self._generate.room_ticket = tickets.issue(room, prefill.node_id, decode.node_id)
        self._prefill_request = (
            node_pb2.PrefillRequest(
                rid=self.rid,
                input_ids=input_ids,
                sampling=sampling,
                bootstrap_room=room,
                decode_node_id=decode.node_id,
                resumed_tokens=resumed_tokens,
            )
            if prefill is not None
            else None
        )
        self._cancelled_decode = False

    def __aiter__(self) -> AsyncGenerator[Response, None]:
        return self._responses()

    async def _responses(self) -> AsyncGenerator[Response, None]:
        result = self.result
        result.sent_at = time.monotonic()
        mux = GenerateMux.for_stub(self.decode.stub, self.on_batch)
        call = mux.open(self._generate, self.lane)
        prefill_task = None
        if self.prefill is not None and self._prefill_request is not None:
            prefill_task = asyncio.create_task(self._run_prefill(self.prefill, call))
        try:
            async for response in call:
                if response.HasField("chunk"):
                    self.record(response.chunk.token_ids)
                else:
                    result.finished = response.finished
                    result.finished_at = time.monotonic()
                yield response
        except asyncio.CancelledError:
            if not self._cancelled_decode or _being_cancelled():
                raise  # not (only) our own cancel after a failed prefill
        finally:
            if result.finished is None:
                call.cancel()  # the consumer left early: abort on D
                if prefill_task is not None:
                    prefill_task.cancel()  # ... and on P
            if prefill_task is not None:
                aborted = result.finished is not None and result.finished.finish_reason == "abort"
                await _prefill_answer(prefill_task, PREFILL_ANSWER_GRACE_S if aborted else None)

    def record(self, token_ids: Sequence[int]) -> None:
        """Note a chunk of D's tokens (by the chain or the lane)."""
        result = self.result
        result.token_ids.extend(token_ids)
        result.last_chunk_at = time.monotonic()
        result.first_chunk_at = result.first_chunk_at or result.last_chunk_at

    async def _run_prefill(self, prefill: NodeTarget, decode_call: object) -> None:
        result = self.result
        assert self._prefill_request is not None
        try:
            result.prefill = await prefill.stub.Prefill(self._prefill_request)
        except grpc.aio.AioRpcError as exc:
            result.prefill_error = f"{exc.code().name}: {exc.details()}"
            result.prefill_code = exc.code()
            cancel = getattr(decode_call, "cancel", None)
            # Once D streams tokens it holds the whole prompt's KV: a late P error is moot.
            if cancel is not None and result.finished is None and not result.token_ids:
                self._cancelled_decode = True
                cancel()


class _Cancelled:
    """Queued to a `MuxedCall` by its own `cancel`."""


_End: TypeAlias = "node_pb2.RequestDelta | grpc.aio.AioRpcError | _Cancelled"
# What a call yields: a `RequestDelta` that carries only a chunk is handed on as it is (it reads
# as a `GenerateResponse` with a chunk: `HasField("chunk")`, `.chunk`), without a copy per token.
Response: TypeAlias = "node_pb2.GenerateResponse | node_pb2.RequestDelta"


class RequestInbox:
    """One request's deltas from the mux's reader, and a wake-up for its consumer.

    The reader sorts each delta once: one that only brings tokens goes to `chunks`; the last
    word (a delta with `finished` or `error`, the call's failure, or a cancel) to `end`, which
    the consumer reads after the chunks before it. Lighter than an `asyncio.Queue`, and the
    consumer takes every chunk that arrived since it last looked in one go: when it falls
    behind, the tokens of several steps travel on as one chunk (as a decode node merges them
    when its gateway reads slowly, engine/node/multiplex.py) instead of one frame each. With a
    `lane` (gateway/dispatch/lane.py) a plain chunk that comes while the consumer waits for it goes
    to the client by the lane, in the reader's turn, and wakes nobody.
    """

    __slots__ = ("_loop", "_waiter", "chunks", "end", "lane")

    def __init__(self, loop: asyncio.AbstractEventLoop, lane: TokenLane | None = None) -> None:
        self.chunks: list[node_pb2.RequestDelta] = []
        self.end: _End | None = None
        self.lane = lane
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None

    def put(self, delta: node_pb2.RequestDelta) -> None:
        if self.end is not None:
            return  # ended (its lane failed): nothing after the last word
        lane = self.lane
        # The lane only while the consumer waits with nothing before this chunk: the chain
        # above it is parked too, so the lane's frame is the next one on the socket.
        if lane is not None and self._waiter is not None and not self.chunks and lane.open:
            try:
                lane.deliver(delta.chunk)
            except Exception as exc:
                self._lane_failed(exc)
            return
        self.chunks.append(delta)
        self._wake()

    def _lane_failed(self, exc: Exception) -> None:
        """A bug on the lane must not stop the mux's reader (every request on the node): this
        request fails as if its node had, and is moved (gateway/dispatch/dispatcher.py)."""
        logger.exception("the stream fast lane failed (a gateway bug): failing the request")
        self.lane = None
        self.close(_rpc_error(grpc.StatusCode.INTERNAL, f"gateway stream lane failed: {exc!r}"))

    def close(self, end: _End) -> None:
        """The request's last item; a later one (a cancel after the end came) is ignored."""
        if self.end is None:
            self.end = end
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> node_pb2.RequestDelta | None:
        """The tokens that came since the last call as one delta; None once only `end` is left."""
        while not self.chunks and self.end is None:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks, self.chunks = self.chunks, []
        if not chunks:
            return None
        first = chunks[0]
        for later in chunks[1:]:
            first.MergeFrom(later)  # token ids and logprobs appended in order
        return first


class GenerateMux:
    """All of this process's `Generate` requests to one node, over one `GenerateStream` call.

    The call opens with the first request and stays open; when it fails (node gone, connection
    cut) every request on it fails with the call's error, and the next request opens a new one.
    """

    _by_stub: ClassVar[weakref.WeakKeyDictionary[node_pb2_grpc.NodeStub, GenerateMux]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, stub: node_pb2_grpc.NodeStub, on_batch: BatchObserver | None = None) -> None:
        self.stub = stub
        self.on_batch = on_batch  # told each received batch's number of deltas
        self.supported = True  # False once the node answered UNIMPLEMENTED
        self._loop = asyncio.get_running_loop()
        self._outbox: asyncio.Queue[node_pb2.StreamRequest] | None = None
        self._requests: dict[str, RequestInbox] = {}
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    def for_stub(
        cls, stub: node_pb2_grpc.NodeStub, on_batch: BatchObserver | None = None
    ) -> GenerateMux:
        """The stub's mux on this event loop; `on_batch` is kept if it has none yet."""
        mux = cls._by_stub.get(stub)
        if mux is None or mux._loop is not asyncio.get_running_loop():
            mux = cls._by_stub[stub] = cls(stub, on_batch)
        elif mux.on_batch is None:
            mux.on_batch = on_batch
        return mux

    def open(self, request: node_pb2.GenerateRequest, lane: TokenLane | None = None) -> MuxedCall:
        """Start `request` (its rid must be unique on this node); iterate the answer for its
        responses, as a `Generate` call's. Its plain chunks may take `lane` (see `RequestInbox`)."""
        if not self.supported:
            return MuxedCall(self, request, None)
        inbox = RequestInbox(self._loop, lane)
        self._requests[request.rid] = inbox
        self._send(node_pb2.StreamRequest(open=request))
        return MuxedCall(self, request, inbox)

    def cancel(self, rid: str) -> None:
        if self._requests.pop(rid, None) is not None:
            self._send(node_pb2.StreamRequest(cancel_rid=rid))

    def _send(self, message: node_pb2.StreamRequest) -> None:
        if self._outbox is None:
            self._outbox = asyncio.Queue()
            call = self.stub.GenerateStream(_drain(self._outbox))
            self._reader = asyncio.create_task(self._read(call, self._outbox))
        self._outbox.put_nowait(message)

    async def _read(
        self,
        call: AsyncIterator[node_pb2.StreamBatch],
        outbox: asyncio.Queue[node_pb2.StreamRequest],
    ) -> None:
        error: grpc.aio.AioRpcError
        requests = self._requests
        try:
            async for batch in call:
                requests = self._requests
                deltas = batch.deltas
                if self.on_batch is not None:
                    self.on_batch(len(deltas))
                for delta in deltas:
                    inbox = requests.get(delta.rid)
                    if inbox is None:
                        continue  # cancelled meanwhile
                    if delta.HasField("finished") or delta.HasField("error"):
                        del requests[delta.rid]
                        inbox.close(delta)
                    else:
                        inbox.put(delta)
            error = _rpc_error(
                grpc.StatusCode.UNAVAILABLE, "the node ended the GenerateStream call"
            )
        except grpc.aio.AioRpcError as exc:
            error = exc
        if self._outbox is outbox:
            self._outbox = None
        self.supported = error.code() != grpc.StatusCode.UNIMPLEMENTED
        failed, self._requests = self._requests, {}
        for inbox in failed.values():
            inbox.close(error)


class MuxedCall:
    """One request on a `GenerateMux`: iterate for its responses (`Response`); `cancel` aborts
    it. Leaving the iteration before the end cancels it too."""

    def __init__(
        self,
        mux: GenerateMux,
        request: node_pb2.GenerateRequest,
        inbox: RequestInbox | None,
    ) -> None:
        self.mux = mux
        self.request = request
        self._inbox = inbox
        self._fallback: grpc.aio.UnaryStreamCall | None = None
        self._done = False

    def cancel(self) -> None:
        if self._done:
            return
        self._done = True
        if self._fallback is not None:
            self._fallback.cancel()
        elif self._inbox is not None:
            self.mux.cancel(self.request.rid)
            self._inbox.close(_Cancelled())

    def __aiter__(self) -> AsyncIterator[Response]:
        return self._responses()

    async def _responses(self) -> AsyncGenerator[Response, None]:
        try:
            if self._inbox is None:
                async for response in self._generate():
                    yield response
                return
            inbox = self._inbox
            while True:
                delta = await inbox.take()
                if delta is not None:
                    yield delta
                elif inbox.end is not None:
                    async for response in self._ended(inbox.end):
                        yield response
                    return
        finally:
            self.cancel()  # the consumer left before the end (a no-op after it)

    async def _ended(self, end: _End) -> AsyncGenerator[node_pb2.GenerateResponse, None]:
        """The responses of the request's last word: its last tokens and `Finished`, or the
        error it failed with."""
        if isinstance(end, _Cancelled):
            raise asyncio.CancelledError
        if isinstance(end, grpc.aio.AioRpcError):
            if end.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older node: no mux
                async for response in self._generate():
                    yield response
                return
            self._done = True
            raise end
        self._done = True
        if end.HasField("error"):
            raise _rpc_error(grpc.StatusCode(_STATUS[end.error.code]), end.error.message)
        if end.HasField("chunk"):
            yield node_pb2.GenerateResponse(chunk=end.chunk)
        yield node_pb2.GenerateResponse(finished=end.finished)

    async def _generate(self) -> AsyncGenerator[node_pb2.GenerateResponse, None]:
        self._fallback = self.mux.stub.Generate(self.request)
        async for response in self._fallback:
            yield response
        self._done = True


_STATUS = {code.value[0]: code for code in grpc.StatusCode}


async def _drain(
    outbox: asyncio.Queue[node_pb2.StreamRequest],
) -> AsyncGenerator[node_pb2.StreamRequest, None]:
    while True:
        yield await outbox.get()


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a `Generate` call would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


async def _prefill_answer(task: asyncio.Task[None], grace_s: float | None) -> None:
    """Wait for P's answer; at most `grace_s` (then cancel the call) when given."""
    if grace_s is not None:
        _, pending = await asyncio.wait({task}, timeout=grace_s)
        if pending:
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _being_cancelled() -> bool:
    """True when someone cancelled the running task (Python >= 3.11 can tell)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() > 0


async def pd_generate(
    decode: NodeTarget,
    prefill: NodeTarget | None,
    input_ids: list[int],
    sampling: node_pb2.SamplingParams,
    room: int | None = None,
    rid: str = "",
) -> PDResult:
    """Run one request to completion; raises grpc.aio.AioRpcError if the decode node refuses."""
    stream = PDStream(decode, prefill, input_ids, sampling, room, rid)
    async for _ in stream:
        pass
    return stream.result
