"""From the engine's per-step `OutputBatch` to the request streams of the node's gRPC API.

The engine thread hands each batch over with one `call_soon_threadsafe` (`OutputRouter.on_output`);
on the event loop, `deliver` fans it out to the receiver of each request: a `RequestOutput`
buffer that its `Generate` or `Prefill` handler drains (one chunk per step, as ever), or the
`StreamConnection` of a `GenerateStream` call (multiplex.py). A reader that falls behind costs
memory for its tokens only, never a wait on the engine thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from engine.engine_loop import OutputBatch, RequestFinish, TokenLogprobs
from engine.request import PromptLogprob
from engine.timing import RequestTiming
from proto import node_pb2


class OutputReceiver(Protocol):
    """Where `OutputRouter.deliver` puts the output of the requests registered to it."""

    def add_tokens(
        self, rid: str, token_ids: list[int], logprobs: TokenLogprobs | None
    ) -> None: ...

    def end(self, finish: RequestFinish) -> None: ...


@dataclass
class RequestOutput:
    """One request's output that its handler has not sent yet."""

    steps: list[tuple[list[int], TokenLogprobs | None]] = field(default_factory=list)
    finish: RequestFinish | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def add_tokens(self, rid: str, token_ids: list[int], logprobs: TokenLogprobs | None) -> None:
        self.steps.append((token_ids, logprobs))
        self.ready.set()

    def end(self, finish: RequestFinish) -> None:
        self.finish = finish
        self.ready.set()

    async def wait_finish(self) -> RequestFinish:
        """Wait for the request's end (a prefill node's answer needs no tokens)."""
        while self.finish is None:
            await self.ready.wait()
            self.ready.clear()
        return self.finish

    async def next_messages(self) -> list[node_pb2.GenerateResponse]:
        """Wait for output, then take all of it: a chunk per step, then the Finished if any."""
        await self.ready.wait()
        self.ready.clear()
        messages = [
            node_pb2.GenerateResponse(chunk=chunk_to_proto(ids, [lp] if lp else []))
            for ids, lp in self.steps
        ]
        self.steps = []
        if self.finish is not None:
            messages.append(node_pb2.GenerateResponse(finished=finished_to_proto(self.finish)))
        return messages


class OutputRouter:
    """Routes each request's output to its receiver; one thread hop per engine batch."""

    def __init__(self) -> None:
        self._receivers: dict[str, OutputReceiver] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def register(self, rid: str, receiver: OutputReceiver) -> None:
        """Called on the event loop before the request is submitted to the engine."""
        self._loop = self._loop or asyncio.get_running_loop()
        self._receivers[rid] = receiver

    def unregister(self, rid: str) -> None:
        self._receivers.pop(rid, None)

    def on_output(self, batch: OutputBatch) -> None:
        """The engine loop's output sink (engine thread)."""
        assert self._loop is not None  # a request was registered before any output
        self._loop.call_soon_threadsafe(self.deliver, batch)

    def deliver(self, batch: OutputBatch) -> None:
        receivers = self._receivers
        logprobs = batch.logprobs
        for rid, token_ids in zip(batch.rids, batch.token_ids, strict=True):
            receiver = receivers.get(rid)
            if receiver is not None:  # None: its handler is gone (the request is being aborted)
                receiver.add_tokens(rid, token_ids, logprobs.get(rid) if logprobs else None)
        for finish in batch.finishes:
            receiver = receivers.pop(finish.rid, None)
            if receiver is not None:
                receiver.end(finish)


def chunk_to_proto(token_ids: list[int], logprobs: list[TokenLogprobs]) -> node_pb2.TokenChunk:
    chunk = node_pb2.TokenChunk(token_ids=token_ids)
    for piece in logprobs:
        for lp, top in zip(piece.logprobs, piece.top, strict=True):
            if lp is None:
                continue
            entry = chunk.logprobs.add(logprob=lp)
            for tid, tlp in top or []:
                entry.top.add(token_id=tid, logprob=tlp)
    return chunk


def finished_to_proto(finish: RequestFinish) -> node_pb2.Finished:
    usage = node_pb2.Usage(
        prompt_tokens=finish.prompt_tokens,
        completion_tokens=finish.completion_tokens,
        cached_tokens=finish.cached_tokens,
    )
    return node_pb2.Finished(
        finish_reason=finish.reason,
        detail=finish.detail,
        usage=usage,
        timing=timing_to_proto(finish.timing),
        prompt_logprobs=prompt_logprobs_to_proto(finish.prompt_logprobs),
    )


def prompt_logprobs_to_proto(
    entries: list[PromptLogprob | None],
) -> list[node_pb2.TokenLogprobs]:
    """Prompt tokens 1.. (token 0 has no logprob); empty when none were computed here."""
    out = []
    for entry in entries[1:]:
        message = node_pb2.TokenLogprobs(logprob=entry.logprob if entry else 0.0)
        for token_id, logprob in entry.top if entry else ():
            message.top.add(token_id=token_id, logprob=logprob)
        out.append(message)
    return out


def timing_to_proto(t: RequestTiming | None) -> node_pb2.NodeTiming:
    """The spans between a request's marks on this node (engine/timing.py)."""
    if t is None:
        return node_pb2.NodeTiming()
    prefill_node = bool(t.transfer_done)
    decode_start = "admitted" if t.admitted else "first_token"
    decode_first_end = "second_token" if t.second_token else "finished"
    return node_pb2.NodeTiming(
        bootstrap_wait_s=t.span("arrived", "destination"),
        queue_s=t.span("destination" if t.destination else "arrived", "scheduled"),
        prefill_s=t.span("scheduled", "first_token"),
        transfer_s=t.span("first_token", "transfer_done"),
        prealloc_s=t.span("arrived", "published"),
        kv_wait_s=t.span("published", "kv_arrived"),
        admit_s=t.span("kv_arrived", "admitted"),
        first_decode_s=0.0 if prefill_node else t.span(decode_start, decode_first_end),
        decode_s=0.0 if prefill_node else t.span("second_token", "finished"),
        total_s=t.span("arrived", "finished"),
    )
