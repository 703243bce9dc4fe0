"""From token chunks to text events, per choice; merging the choices of one request.

A request with n choices (or several prompts) becomes one `ChoiceJob` each, every job its own
`Generation` (own room, own nodes). `choice_events` turns a job's token chunks into
`ChoiceEvent`s: incremental text (stop strings trimmed), the tokens and their logprobs, and at the
end a `ChoiceEnd` with the finish reason and usage. An event carries `interval` tokens
(`--stream-interval`; the first token goes out alone, at once), so the per-event work (decoding
text, encoding a frame) is paid once per batch rather than once per token. Streaming responses
format these events as they come; non-streaming ones `collect` them (in one batch). Both paths
run the same code, so the streamed pieces concatenate to exactly the non-streaming text.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.lane import TokenLane
from gateway.dispatch.timeline import Timeline
from gateway.requests.text import IncrementalDetokenizer, StopTrimmer, TextCodec
from proto import node_pb2


@dataclass(frozen=True)
class ChoiceJob:
    index: int
    prompt_ids: list[int]
    sampling: node_pb2.SamplingParams
    echo_text: str = ""  # completions with `echo`: the prompt, sent before the completion
    # `max_tokens: 0` with `echo`: the prompt is scored (its logprobs come from the forward
    # that draws one token); that token is not answered and not counted.
    score_only: bool = False


@dataclass(frozen=True)
class ChoiceEnd:
    reason: str  # "stop" | "length"
    matched: str  # the stop string or token that ended it ("" otherwise)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timeline: Timeline | None = None  # where the time went (gateway/dispatch/timeline.py)
    cache_node: str = ""  # the node whose prefix cache served `cached_tokens`
    # Prompt tokens 1.. when the request asked for prompt logprobs (token 0 has none).
    prompt_logprobs: Sequence[node_pb2.TokenLogprobs] = ()


@dataclass(slots=True)  # one per streamed frame: a frozen dataclass's __init__ costs ~4x more
class ChoiceEvent:
    index: int
    text: str
    token_ids: Sequence[int] = ()
    logprobs: Sequence[node_pb2.TokenLogprobs] = ()
    end: ChoiceEnd | None = None


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[node_pb2.TokenLogprobs] = field(default_factory=list)
    end: ChoiceEnd | None = None

    def add(self, event: ChoiceEvent) -> None:
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        self.end = event.end or self.end


class PendingTokens:
    """Tokens received but not yet sent as an event, and the text they make.

    Without stop strings the text is decoded once per event (one detokenizer call for the whole
    batch). With stop strings every node chunk is decoded and trimmed as it comes, so a stop
    string ends the choice after exactly the chunk it appeared in, whatever the interval: the
    token ids then equal those of interval 1 too. The text of the first `min_tokens` tokens is
    not searched for stop strings, as the node does not stop there.
    """

    def __init__(
        self, detokenizer: IncrementalDetokenizer, trimmer: StopTrimmer, min_tokens: int = 0
    ) -> None:
        self.detokenizer = detokenizer
        self.trimmer = trimmer
        self.per_chunk = bool(trimmer.stops)
        self.unmatched = min_tokens  # tokens still before min_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[node_pb2.TokenLogprobs] = []
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.trimmer.stopped is not None

    def add(self, chunk: node_pb2.TokenChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if self.per_chunk:
            ids = list(chunk.token_ids)
            if self.unmatched:
                head, ids = ids[: self.unmatched], ids[self.unmatched :]
                self.unmatched -= len(head)
                self.text += self.detokenizer.push(head)
            if ids:
                self.text += self.trimmer.push(self.detokenizer.push(ids))

    def add_ids(self, token_ids: list[int]) -> None:
        """`add` for a chunk of a choice that `lane_takes` (no logprobs, no stop strings)."""
        self.token_ids += token_ids

    def take(self, index: int, end: ChoiceEnd | None = None) -> ChoiceEvent:
        """An event with everything pending (at the end: the detokenizer's and trimmer's rest)."""
        text = self.text
        if not self.per_chunk and self.token_ids:
            text += self.trimmer.push(self.detokenizer.push(self.token_ids))
        if end is not None:
            text += self.trimmer.push(self.detokenizer.flush()) + self.trimmer.flush()
        event = ChoiceEvent(index, text, self.token_ids, self.logprobs, end)
        self.token_ids, self.logprobs, self.text = [], [], ""
        return event


def lane_takes(sampling: node_pb2.SamplingParams) -> bool:
    """Whether a choice's chunks may take a fast lane (gateway/dispatch/lane.py): its events are
    text only (no logprobs) and a chunk never ends it (no stop strings, which are matched per
    chunk)."""
    return not (sampling.stop or sampling.logprobs or sampling.top_logprobs)


async def choice_events(
    job: ChoiceJob,
    codec: TextCodec,
    dispatcher: Dispatcher,
    rid: str,
    interval: int = 1,
    lane: TokenLane | None = None,
) -> AsyncGenerator[ChoiceEvent, None]:
    """The choice's events: the first token at once, then one event per `interval` tokens (or
    as soon as a stop string matched), and a last one with the rest and the `ChoiceEnd`.

    With a `lane` (only for a choice that `lane_takes`) the events after the first may leave by
    it: `pending` then also fills from the lane, and the end takes whatever it left pending."""
    if job.echo_text:
        yield ChoiceEvent(job.index, job.echo_text)
    pending = PendingTokens(
        codec.detokenizer(job.prompt_ids), StopTrimmer(job.sampling.stop), job.sampling.min_tokens
    )
    generation = dispatcher.generation(job.prompt_ids, job.sampling, f"{rid}-{job.index}", lane)

    def lane_event(token_ids: list[int]) -> ChoiceEvent | None:
        pending.add_ids(token_ids)
        return pending.take(job.index) if len(pending.token_ids) >= interval else None

    first = True
    try:
        async with contextlib.aclosing(aiter(generation)) as chunks:
            async for chunk in chunks:
                if pending.stopped or job.score_only:
                    # the text ended at a stop string (the node stops right after), or no
                    # generated token is answered (the prompt is scored only)
                    continue
                pending.add(chunk)
                if first or pending.stopped or len(pending.token_ids) >= interval:
                    if first and lane is not None:
                        lane.event = lane_event  # from the next chunk on
                    first = False
                    yield pending.take(job.index)
    finally:
        if lane is not None:
            lane.event = None
    finished = generation.finished
    assert finished is not None
    stopped = not job.score_only and (pending.stopped or finished.finish_reason == "stop")
    end = ChoiceEnd(
        reason="stop" if stopped else "length",
        matched=pending.trimmer.stopped or finished.detail,
        prompt_tokens=len(job.prompt_ids),
        completion_tokens=0 if job.score_only else finished.usage.completion_tokens,
        cached_tokens=generation.cached_tokens,
        timeline=generation.timeline,
        cache_node=generation.cache_node,
        prompt_logprobs=generation.prompt_logprobs,
    )
    yield pending.take(job.index, end)


def merge(
    streams: Sequence[AsyncGenerator[ChoiceEvent, None]],
) -> AsyncGenerator[ChoiceEvent, None]:
    """The events of all choices as they come; an error in one ends all of them. One choice's
    stream is returned as it is (no extra generator between it and the client)."""
    return streams[0] if len(streams) == 1 else _merge_many(streams)


async def _merge_many(
    streams: Sequence[AsyncGenerator[ChoiceEvent, None]],
) -> AsyncGenerator[ChoiceEvent, None]:
    queue: asyncio.Queue[ChoiceEvent | Exception | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[ChoiceEvent, None]) -> None:
        try:
            async with contextlib.aclosing(stream) as events:
                async for event in events:
                    queue.put_nowait(event)
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(streams: Sequence[AsyncGenerator[ChoiceEvent, None]]) -> list[ChoiceResult]:
    results: dict[int, ChoiceResult] = {}
    async with contextlib.aclosing(merge(streams)) as events:
        async for event in events:
            results.setdefault(event.index, ChoiceResult(event.index)).add(event)
    return [results[i] for i in sorted(results)]


def usage(results: Sequence[ChoiceEnd], prompt_tokens: int) -> dict[str, object]:
    """OpenAI's usage object; the prompt counts once per distinct prompt (`prompt_tokens`)."""
    completion = sum(e.completion_tokens for e in results)
    cached = max((e.cached_tokens for e in results), default=0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
