"""From token chunks to text events, per choice; merging the choices of one request.

A request with n choices (or several prompts) becomes one `ChoiceJob` each, every job its own
`Generation` (own room, own nodes). `choice_events` turns a job's token chunks into
`ChoiceEvent`s: incremental text (stop strings trimmed), the tokens and their logprobs, and at the
end a `ChoiceEnd` with the finish reason and usage. Streaming responses format these events as
they come; non-streaming ones `collect` them. Both paths run the same code, so the streamed
pieces concatenate to exactly the non-streaming text.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from gateway.dispatch import Dispatcher
from gateway.text import StopTrimmer, TextCodec
from gateway.timeline import Timeline
from proto import node_pb2


@dataclass(frozen=True)
class ChoiceJob:
    index: int
    prompt_ids: list[int]
    sampling: node_pb2.SamplingParams
    echo_text: str = ""  # completions with `echo`: the prompt, sent before the completion


@dataclass(frozen=True)
class ChoiceEnd:
    reason: str  # "stop" | "length"
    matched: str  # the stop string or token that ended it ("" otherwise)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timeline: Timeline | None = None  # where the time went (gateway/timeline.py)


@dataclass(frozen=True)
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


async def choice_events(
    job: ChoiceJob, codec: TextCodec, dispatcher: Dispatcher, rid: str
) -> AsyncGenerator[ChoiceEvent, None]:
    if job.echo_text:
        yield ChoiceEvent(job.index, job.echo_text)
    detokenizer = codec.detokenizer(job.prompt_ids)
    trimmer = StopTrimmer(job.sampling.stop)
    generation = dispatcher.generation(job.prompt_ids, job.sampling, f"{rid}-{job.index}")
    async with contextlib.aclosing(aiter(generation)) as chunks:
        async for chunk in chunks:
            if trimmer.stopped is not None:
                continue  # the text ended at a stop string; the node stops right after
            text = trimmer.push(detokenizer.push(chunk.token_ids))
            yield ChoiceEvent(job.index, text, chunk.token_ids, chunk.logprobs)
    finished = generation.finished
    assert finished is not None
    tail = trimmer.push(detokenizer.flush()) + trimmer.flush()
    stopped = trimmer.stopped is not None or finished.finish_reason == "stop"
    end = ChoiceEnd(
        reason="stop" if stopped else "length",
        matched=trimmer.stopped or finished.detail,
        prompt_tokens=len(job.prompt_ids),
        completion_tokens=finished.usage.completion_tokens,
        cached_tokens=generation.cached_tokens,
        timeline=generation.timeline,
    )
    yield ChoiceEvent(job.index, tail, end=end)


async def merge(
    streams: Sequence[AsyncGenerator[ChoiceEvent, None]],
) -> AsyncGenerator[ChoiceEvent, None]:
    """The events of all choices as they come; an error in one ends all of them."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for event in only:
                yield event
        return
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
