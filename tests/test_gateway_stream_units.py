"""The streaming side of the gateway without processes: token batching (`--stream-interval`) and
the SSE frames.

`choice_events` runs over a fake generation that replays node chunks (random token ids of the
default model's tokenizer, one or several per chunk, as a decode node sends them); for every
interval the events must carry the same text, token ids, finish reason and matched stop string
as interval 1, with the first token alone in the first event. The same holds when the chunks
after the first go to the client by the choice's fast lane (gateway/dispatch/lane.py), some or all
of them, and a request's inbox hands a chunk to its lane only while its consumer waits for it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator
from pathlib import Path

import orjson
import pytest

from gateway.api.choices import ChoiceEvent, ChoiceJob, choice_events, lane_takes
from gateway.api.sse import ChunkFrames, TextFrames, sse
from gateway.dispatch.lane import ChunkedWriter, TokenLane
from gateway.dispatch.pd_client import RequestInbox
from gateway.requests.text import TextCodec
from proto import node_pb2

INTERVALS = (1, 2, 3, 5, 8, 64)


class ReplayGeneration:
    """What `Dispatcher.generation` returns, replaying fixed chunks."""

    def __init__(self, chunks: list[list[int]]) -> None:
        self.chunks = chunks
        self.finished: node_pb2.Finished | None = None
        self.cached_tokens = 0
        self.cache_node = ""
        self.prompt_logprobs: list[node_pb2.TokenLogprobs] = []
        self.timeline = None

    def __aiter__(self) -> AsyncGenerator[node_pb2.TokenChunk, None]:
        return self._replay()

    async def _replay(self) -> AsyncGenerator[node_pb2.TokenChunk, None]:
        for ids in self.chunks:
            yield node_pb2.TokenChunk(token_ids=ids)
        count = sum(len(ids) for ids in self.chunks)
        usage = node_pb2.Usage(completion_tokens=count)
        self.finished = node_pb2.Finished(finish_reason="length", usage=usage)


class ReplayDispatcher:
    def __init__(self, chunks: list[list[int]]) -> None:
        self.chunks = chunks

    def generation(
        self, prompt_ids: list[int], sampling: object, rid: str, lane: object = None
    ) -> ReplayGeneration:
        return ReplayGeneration(self.chunks)


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TextCodec:
    return TextCodec.load(str(default_model_dir))


def _events(
    codec: TextCodec, chunks: list[list[int]], stops: list[str], interval: int
) -> list[ChoiceEvent]:
    job = ChoiceJob(0, [1, 2, 3], node_pb2.SamplingParams(stop=stops))
    dispatcher = ReplayDispatcher(chunks)

    async def run() -> list[ChoiceEvent]:
        events = choice_events(job, codec, dispatcher, "r", interval)  # type: ignore[arg-type]
        return [event async for event in events]

    return asyncio.run(run())


def _random_chunks(rng: random.Random, vocab: int) -> list[list[int]]:
    # Mostly common ids (text), some anywhere in the vocabulary (byte pieces, specials).
    def token() -> int:
        return rng.randrange(200, 5000) if rng.random() < 0.8 else rng.randrange(vocab)

    return [
        [token() for _ in range(rng.choice((1, 1, 1, 2, 4)))] for _ in range(rng.randrange(1, 40))
    ]


@pytest.mark.parametrize("stops", [[], ["e"], ["the", "\n"]], ids=["none", "e", "the-newline"])
def test_every_interval_streams_what_interval_one_streams(codec: TextCodec, stops) -> None:
    rng = random.Random(7)
    for _ in range(60):
        chunks = _random_chunks(rng, codec.vocab_size)
        each = _events(codec, chunks, stops, 1)
        expected = (
            "".join(e.text for e in each),
            [t for e in each for t in e.token_ids],
            (each[-1].end.reason, each[-1].end.matched) if each[-1].end else None,
        )
        for interval in INTERVALS[1:]:
            batched = _events(codec, chunks, stops, interval)
            got = (
                "".join(e.text for e in batched),
                [t for e in batched for t in e.token_ids],
                (batched[-1].end.reason, batched[-1].end.matched) if batched[-1].end else None,
            )
            assert got == expected, (chunks, stops, interval)
            assert list(batched[0].token_ids) == chunks[0]  # the first chunk goes out at once
            assert len(batched) <= len(each)
            middle = batched[1:-1]
            if not stops:  # a middle event waits for `interval` tokens
                assert all(len(e.token_ids) >= interval for e in middle), interval


def test_chunk_frames_equal_whole_objects() -> None:
    header = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m\u00e9"}
    choice = {"index": 0, "text": 'caf\u00e9 \u2713 "q"', "logprobs": None, "finish_reason": None}
    frame = ChunkFrames.for_header(header).choice(choice)
    assert frame == sse({**header, "choices": [choice]})
    assert orjson.loads(frame[len(b"data: ") : -2]) == {**header, "choices": [choice]}
    with pytest.raises(ValueError, match="without `choices`"):
        ChunkFrames.for_header({"choices": []})


def test_streamed_text_is_the_whole_decode(codec: TextCodec) -> None:
    """Streamed deltas (one-token windows decoded from the codec's cache) concatenate to what
    the tokenizer itself decodes from all the ids at once."""
    rng = random.Random(11)
    for _ in range(40):
        chunks = _random_chunks(rng, codec.vocab_size)
        events = _events(codec, chunks, [], 1)
        ids = [t for chunk in chunks for t in chunk]
        whole = codec.tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(e.text for e in events) == whole, chunks


@pytest.mark.parametrize("text", ["", "a", 'caf\u00e9 "q"\n\\', "\u2713\ufffd", "</s>"])
def test_text_frames_equal_whole_objects(text: str) -> None:
    header = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    frames = ChunkFrames.for_header(header)

    def chat(index: int, content: str) -> dict[str, object]:
        return {"index": index, "delta": {"content": content}, "logprobs": None,
                "finish_reason": None}  # fmt: skip

    texts = TextFrames(frames, chat)
    for index in (0, 3, 0):
        assert texts.frame(index, text) == frames.choice(chat(index, text))


def _delta(rid: str, ids: list[int], finished: bool = False) -> node_pb2.RequestDelta:
    delta = node_pb2.RequestDelta(rid=rid, chunk=node_pb2.TokenChunk(token_ids=ids))
    if finished:
        delta.finished.CopyFrom(node_pb2.Finished(finish_reason="length"))
    return delta


def test_inbox_merges_what_came_since_the_last_take() -> None:
    async def run() -> None:
        inbox = RequestInbox(asyncio.get_running_loop())
        inbox.put(_delta("r", [1]))
        first = await inbox.take()
        assert first is not None and list(first.chunk.token_ids) == [1]
        for ids in ([2], [3, 4], [5]):  # the consumer fell behind: one delta for three steps
            inbox.put(_delta("r", ids))
        merged = await inbox.take()
        assert merged is not None and list(merged.chunk.token_ids) == [2, 3, 4, 5]
        end = _delta("r", [6], finished=True)
        inbox.close(end)
        inbox.close(_delta("r", [7]))  # a later last word (a cancel after the end) is ignored
        assert await inbox.take() is None and inbox.end is end
        # a consumer waiting for tokens wakes up for the next ones
        later = RequestInbox(asyncio.get_running_loop())
        waiting = asyncio.ensure_future(asyncio.wait_for(later.take(), 5))
        await asyncio.sleep(0)
        later.put(_delta("q", [8]))
        woke = await waiting
        assert woke is not None and list(woke.chunk.token_ids) == [8]

    asyncio.run(run())


class ListWriter:
    """A `ChunkedWriter` stand-in: what the lane writes, in order."""

    def __init__(self, out: list[bytes]) -> None:
        self.out = out
        self.writable = True

    def write(self, body: bytes) -> None:
        self.out.append(body)


class LaneReplayGeneration(ReplayGeneration):
    """Replays its chunks as an inbox would: a chunk takes the lane (when it is open) with
    probability `share`, else the chain; the observers see the lane's chunks only."""

    def __init__(self, chunks: list[list[int]], lane: TokenLane, rng: random.Random) -> None:
        super().__init__(chunks)
        self.lane = lane
        self.rng = rng
        self.share = rng.choice((0.3, 1.0))
        self.observed: list[int] = []
        lane.observers = (self.observed.extend,)

    async def _replay(self) -> AsyncGenerator[node_pb2.TokenChunk, None]:
        for ids in self.chunks:
            chunk = node_pb2.TokenChunk(token_ids=ids)
            if self.lane.open and self.rng.random() < self.share:
                self.lane.deliver(chunk)
            else:
                yield chunk
        count = sum(len(ids) for ids in self.chunks)
        self.finished = node_pb2.Finished(
            finish_reason="length", usage=node_pb2.Usage(completion_tokens=count)
        )


def _lane_events(
    codec: TextCodec, chunks: list[list[int]], interval: int, rng: random.Random
) -> tuple[list[tuple[str, list[int]]], LaneReplayGeneration, TokenLane]:
    """(text, ids) of every event in the order the client gets them, by the lane or the chain."""
    lane, written = TokenLane(), list[bytes]()
    lane.writer = ListWriter(written)  # type: ignore[assignment]
    lane.frame = lambda event: orjson.dumps([event.text, list(event.token_ids)])
    generation = LaneReplayGeneration(chunks, lane, rng)
    dispatcher = ReplayDispatcher(chunks)
    dispatcher.generation = lambda *args, **kwargs: generation  # type: ignore[method-assign]
    job = ChoiceJob(0, [1, 2, 3], node_pb2.SamplingParams())

    async def run() -> list[tuple[str, list[int]]]:
        out: list[tuple[str, list[int]]] = []
        events = choice_events(job, codec, dispatcher, "r", interval, lane)  # type: ignore[arg-type]
        async for event in events:
            out += [tuple(orjson.loads(frame)) for frame in written]  # type: ignore[misc]
            written.clear()
            out.append((event.text, list(event.token_ids)))
            last = event
        assert last.end is not None and last.end.reason == "length"
        return out

    return asyncio.run(run()), generation, lane


def test_lane_streams_what_the_chain_streams(codec: TextCodec) -> None:
    """Frames by the lane and by the chain interleave to the chain-only stream's text, ids and
    end, whatever the interval; the lane starts after the first event and ends with the stream."""
    assert lane_takes(node_pb2.SamplingParams())
    assert not lane_takes(node_pb2.SamplingParams(stop=["x"]))
    assert not lane_takes(node_pb2.SamplingParams(logprobs=True))
    assert not lane_takes(node_pb2.SamplingParams(top_logprobs=2))
    rng = random.Random(5)
    used = 0
    for _ in range(40):
        chunks = _random_chunks(rng, codec.vocab_size)
        each = _events(codec, chunks, [], 1)
        for interval in (1, 3, 8):
            got, generation, lane = _lane_events(codec, chunks, interval, rng)
            assert "".join(text for text, _ in got) == "".join(e.text for e in each)
            assert [t for _, ids in got for t in ids] == [t for c in chunks for t in c]
            assert got[0][1] == chunks[0]  # the first chunk went by the chain, at once
            if generation.share == 1.0:  # every chunk after the first took the lane
                assert generation.observed == [t for c in chunks[1:] for t in c]
            used += len(generation.observed)
            assert lane.event is None  # off the lane once the stream ended
    assert used > 1000


class RecordingLane(TokenLane):
    def __init__(self) -> None:
        super().__init__()
        self.delivered: list[list[int]] = []
        self.accepting = True

    @property
    def open(self) -> bool:
        return self.accepting

    def deliver(self, chunk: node_pb2.TokenChunk) -> None:
        self.delivered.append(list(chunk.token_ids))


async def _parked() -> None:
    """Let a consumer task (under `wait_for`) reach its wait."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_inbox_hands_the_lane_only_what_a_waiting_consumer_would_take_next() -> None:
    async def run() -> None:
        lane = RecordingLane()
        inbox = RequestInbox(asyncio.get_running_loop(), lane)
        inbox.put(_delta("r", [1]))  # nobody waits (the chain is busy above): the chain's
        assert lane.delivered == [] and len(inbox.chunks) == 1
        first = await inbox.take()
        assert first is not None and list(first.chunk.token_ids) == [1]
        waiting = asyncio.ensure_future(asyncio.wait_for(inbox.take(), 5))
        await _parked()
        inbox.put(_delta("r", [2]))
        inbox.put(_delta("r", [3, 4]))
        assert lane.delivered == [[2], [3, 4]] and not inbox.chunks and not waiting.done()
        lane.accepting = False  # e.g. the client reads slowly: the chain, which waits for it
        inbox.put(_delta("r", [5]))
        lane.accepting = True
        inbox.put(_delta("r", [6]))  # behind a chunk the chain has not taken: the chain's too
        woke = await waiting
        assert woke is not None and list(woke.chunk.token_ids) == [5, 6]
        assert lane.delivered == [[2], [3, 4]]
        end = _delta("r", [7], finished=True)
        inbox.close(end)
        inbox.put(_delta("r", [8]))  # nothing after the last word
        assert await inbox.take() is None and inbox.end is end and lane.delivered[-1] == [3, 4]

    asyncio.run(run())


def test_a_failing_lane_fails_its_request_not_the_reader() -> None:
    class BrokenLane(RecordingLane):
        def deliver(self, chunk: node_pb2.TokenChunk) -> None:
            raise RuntimeError("bug")

    async def run() -> None:
        inbox = RequestInbox(asyncio.get_running_loop(), BrokenLane())
        waiting = asyncio.ensure_future(asyncio.wait_for(inbox.take(), 5))
        await _parked()
        inbox.put(_delta("r", [1]))  # does not raise into the mux's reader
        assert await waiting is None
        assert "gateway stream lane failed" in str(inbox.end) and inbox.lane is None

    asyncio.run(run())


def test_chunked_writer_frames_as_uvicorn_does() -> None:
    """Under the installed uvicorn (httptools, as gateway/process/server.py runs it) the writer is
    found behind `send` once the response started, and what it writes reads as the same chunked body
    as frames sent through `send`; before the start there is none."""
    import httpx
    import uvicorn

    from engine.ports import LOCALHOST, free_port

    found: list[bool] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        assert scope["type"] == "http"
        found.append(ChunkedWriter.for_send(send) is None)  # type: ignore[arg-type]
        start = {"type": "http.response.start", "status": 200, "headers": []}
        await send(start)  # type: ignore[operator]
        writer = ChunkedWriter.for_send(send)  # type: ignore[arg-type]
        found.append(writer is not None and writer.writable)
        assert writer is not None
        writer.write(b"data: one\n\n")
        await send({"type": "http.response.body", "body": b"data: two\n\n", "more_body": True})  # type: ignore[operator]
        writer.write("data: caf\u00e9\n\n".encode())
        await send({"type": "http.response.body", "body": b"", "more_body": False})  # type: ignore[operator]

    port = free_port()
    config = uvicorn.Config(app, host=LOCALHOST, port=port, http="httptools", lifespan="off",
                            log_level="warning")  # fmt: skip
    server = uvicorn.Server(config)

    async def run() -> str:
        serving = asyncio.ensure_future(server.serve())
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(timeout=10) as client:
                answer = await client.get(f"http://{LOCALHOST}:{port}/")
                assert answer.headers["transfer-encoding"] == "chunked"
                return answer.text
        finally:
            server.should_exit = True
            await serving

    assert asyncio.run(run()) == "data: one\n\ndata: two\n\ndata: caf\u00e9\n\n"
    assert found == [True, True]
