"""The fast lane of a streamed choice: a node's token chunk straight to the client's socket.

A streamed token normally travels up a chain of async generators, each resumed once per token:
the request's `MuxedCall` and `PDStream` (gateway/dispatch/pd_client.py), its `Generation` (retries
and migration, gateway/dispatch/dispatcher.py), `choice_events` (text, gateway/api/choices.py), the
API's frame encoder (gateway/api/openai_api.py) and the response's writer (`EventStream`,
gateway/api/app.py), which awaits the server's ASGI `send`. At stream interval 1 that chain, a
task wake-up, a future and an ASGI message per token cost more of the gateway's CPU than the
token's own work.

A `TokenLane` is the same per-token work as plain calls, run by the mux's reader in the turn of
the loop that parsed the node's `StreamBatch` (one pass over every request of a step). Each
stage of the chain puts its step on the lane while it streams, and takes it off when it stops:

- `observers`: what the attempt records per chunk (`PDStream`'s result, `Generation`'s progress
  and metrics); set per attempt.
- `event`: a chunk's token ids -> the choice's next `ChoiceEvent`, or None (interval not reached);
  set by `choice_events` once its first event went out by the chain.
- `frame`: event -> SSE frame bytes (None: nothing to send); set by the API's stream encoder.
- `writer`: the frame onto the socket (`ChunkedWriter`); set by `EventStream` while it sends.

The lane takes a chunk only when every stage is on it, the request's consumer is parked waiting
for its next chunk (so the whole chain above is too: nothing is half sent, order is kept) and the
socket takes writes without waiting; otherwise the chunk goes the chain's way, which then
applies backpressure (uvicorn's flow control) and handles the rare cases (stop strings,
logprobs, several choices, a stream's start and end, errors, migration) as before. A stage
never declines after an earlier one acted: the only refusal (`writable`) is asked first.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from proto import node_pb2

Observer = Callable[[list[int]], None]  # a chunk's token ids


class TokenLane:
    """One streamed choice's per-token path as plain calls; see the module docstring."""

    __slots__ = ("event", "frame", "observers", "writer")

    def __init__(self) -> None:
        self.observers: Sequence[Observer] = ()
        self.event: Callable[[list[int]], Any | None] | None = None
        self.frame: Callable[[Any], bytes | None] | None = None
        self.writer: ChunkedWriter | None = None

    @property
    def open(self) -> bool:
        """Every stage is on the lane and the socket takes writes now."""
        writer = self.writer
        return (
            writer is not None
            and self.event is not None
            and self.frame is not None
            and bool(self.observers)
            and writer.writable
        )

    def deliver(self, chunk: node_pb2.TokenChunk) -> None:
        """Run the chain's per-token work for `chunk` (call only when `open`)."""
        # A list once: extending a list from protobuf's repeated field costs ~1 us each time.
        ids = chunk.token_ids[:]
        for observe in self.observers:
            observe(ids)
        assert self.event is not None and self.frame is not None and self.writer is not None
        event = self.event(ids)
        if event is not None:
            frame = self.frame(event)
            if frame:
                self.writer.write(frame)


class ChunkedWriter:
    """Body bytes of a started chunked HTTP/1.1 response written straight to uvicorn's transport
    (what its httptools `send` does for `http.response.body` with `more_body`), without an ASGI
    message and a coroutine per frame. `writable` is False while uvicorn's flow control holds
    writes (the client reads slowly) or the connection is gone: then frames take `send`, which
    waits."""

    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self._transport = cycle.transport

    @classmethod
    def for_send(cls, send: Callable[..., Awaitable[None]]) -> ChunkedWriter | None:
        """The writer behind uvicorn's httptools `send` once its chunked response started;
        None for any other server or response (then frames go through `send`)."""
        cycle: Any = getattr(send, "__self__", None)
        if type(cycle).__name__ != "RequestResponseCycle" or not hasattr(cycle, "flow"):
            return None
        if not getattr(cycle, "chunked_encoding", False) or cycle.scope.get("method") == "HEAD":
            return None
        if not getattr(cycle, "response_started", False) or cycle.response_complete:
            return None
        if not callable(getattr(getattr(cycle, "transport", None), "write", None)):
            return None
        return cls(cycle)

    @property
    def writable(self) -> bool:
        cycle = self._cycle
        return not (self._flow.write_paused or cycle.disconnected or cycle.response_complete)

    def write(self, body: bytes) -> None:
        self._transport.write(b"%x\r\n%b\r\n" % (len(body), body))


class LaneFrames:
    """An SSE frame stream and the lane its token frames may take instead (`EventStream` puts
    its writer on the lane). Iterating it is iterating the frames: no frame of its own."""

    def __init__(self, frames: AsyncGenerator[bytes, None], lane: TokenLane) -> None:
        self.frames = frames
        self.lane = lane

    def __aiter__(self) -> LaneFrames:
        return self

    def __anext__(self) -> Awaitable[bytes]:
        return self.frames.__anext__()

    async def aclose(self) -> None:
        await self.frames.aclose()
