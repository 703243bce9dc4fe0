"""The gateway's Python per streamed token, in one process: no sockets, no gRPC threads.

A real gateway app (gateway/api/app.py, the OpenAI handlers, the dispatcher, `GenerateMux`, the SSE
encoding) serves `--streams` streaming `/v1/completions` requests called straight through ASGI;
its one node is an in-process stand-in whose `GenerateStream` answers with one serialized
`StreamBatch` per step (a token for every open request, parsed again as gRPC would), a step
whenever the gateway asks for the next batch. The ASGI `send` only counts the bytes; it is the
bound method of a stand-in for uvicorn's httptools `RequestResponseCycle`, whose transport
counts them too, so that frames take the fast lane (gateway/dispatch/lane.py) as under uvicorn (with
`--asgi-send` a plain function: every frame through the chain and `send`). Printed:
process CPU time (`time.process_time`, which another process's load does not inflate the way it
does wall time) per streamed token, frames, tokens per frame.

What this leaves out, measured by scripts/bench/gateway_cpu.py with real processes: the socket
writes, HTTP parsing, gRPC's threads and its receive path.

    python -m scripts.bench.stream_path [--streams 64] [--tokens 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from proto import node_pb2


@dataclass
class _Open:
    wanted: int
    prompt_tokens: int
    sent: int = 0


class InProcessNode:
    """A stub with `GenerateStream` only: a step per batch the reader asks for."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.open: dict[str, _Open] = {}
        self.wake = asyncio.Event()
        self.follower: asyncio.Future[None] | None = None
        self._wire: dict[tuple[str, int], bytes] = {}

    def GenerateStream(self, requests: AsyncIterator[node_pb2.StreamRequest]) -> Any:
        self.follower = asyncio.ensure_future(self._follow(requests))
        return self._batches()

    async def _follow(self, requests: AsyncIterator[node_pb2.StreamRequest]) -> None:
        async for msg in requests:
            if msg.HasField("open"):
                req = msg.open
                self.open[req.rid] = _Open(req.sampling.max_new_tokens, len(req.input_ids))
            else:
                self.open.pop(msg.cancel_rid, None)
            self.wake.set()

    async def _batches(self) -> AsyncIterator[node_pb2.StreamBatch]:
        while True:
            while not self.open:
                self.wake.clear()
                await self.wake.wait()
            await asyncio.sleep(0)  # one step per turn of the loop, as a node's batches come
            wire = b"".join(self._delta(rid, request) for rid, request in list(self.open.items()))
            yield node_pb2.StreamBatch.FromString(wire)  # parsed as gRPC would, on our CPU

    def _delta(self, rid: str, request: _Open) -> bytes:
        """One `StreamBatch.deltas` entry on the wire (field 1, length-delimited): built once
        per (rid, token) and reused, so that the stand-in costs little of the measured CPU."""
        token = self.token_ids[request.sent % len(self.token_ids)]
        request.sent += 1
        if request.sent < request.wanted:
            wire = self._wire.get((rid, token))
            if wire is None:
                delta = node_pb2.RequestDelta(rid=rid, chunk=node_pb2.TokenChunk(token_ids=[token]))
                wire = self._wire[rid, token] = _field_one(delta.SerializeToString())
            return wire
        del self.open[rid]
        usage = node_pb2.Usage(
            prompt_tokens=request.prompt_tokens, completion_tokens=request.wanted
        )
        finished = node_pb2.Finished(finish_reason="length", usage=usage)
        delta = node_pb2.RequestDelta(
            rid=rid, chunk=node_pb2.TokenChunk(token_ids=[token]), finished=finished
        )
        return _field_one(delta.SerializeToString())


def _field_one(payload: bytes) -> bytes:
    """`payload` as field 1, wire type 2 (tag, varint length, bytes)."""
    length = bytearray()
    n = len(payload)
    while n >= 0x80:
        length.append(n & 0x7F | 0x80)
        n >>= 7
    length.append(n)
    return b"\x0a" + bytes(length) + payload


@dataclass
class StreamCount:
    frames: int = 0
    body_bytes: int = 0

    def add(self, body: bytes) -> None:
        self.frames += body.count(b"data: ")
        self.body_bytes += len(body)


class _Flow:
    write_paused = False


class _Transport:
    def __init__(self, count: StreamCount) -> None:
        self.write = count.add  # the chunk framing's bytes count too: a few per frame


class RequestResponseCycle:
    """What gateway/dispatch/lane.py's `ChunkedWriter` needs of uvicorn's httptools cycle."""

    def __init__(self, count: StreamCount, done: asyncio.Event) -> None:
        self.flow = _Flow()
        self.transport = _Transport(count)
        self.scope = {"method": "POST"}
        self.chunked_encoding = True
        self.response_started = self.response_complete = self.disconnected = False
        self._count = count
        self._done = done

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.response_started = True
        elif message["type"] == "http.response.body":
            self._count.add(message.get("body", b""))
            if not message.get("more_body", False):
                self.response_complete = True
                self._done.set()


async def _one_stream(app: Any, body: bytes, count: StreamCount, plain_send: bool) -> None:
    done = asyncio.Event()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def plain(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            count.add(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    send = plain if plain_send else RequestResponseCycle(count, done).send

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    await app(scope, receive, send)


async def run_round(
    streams: int, tokens: int, interval: int, plain_send: bool = False
) -> tuple[float, int, int]:
    """CPU seconds, tokens and token frames of `streams` concurrent requests."""
    from engine.model_fetch import resolve_model
    from gateway.api.app import Gateway, build_app, with_server_send
    from gateway.process.server import build_config, build_parser
    from gateway.requests.text import TextCodec
    from gateway.routing.nodes import COLOCATED, LiveNode

    model = resolve_model(None)
    flags = ["--bootstrap", "127.0.0.1:1", "--stream-interval", str(interval)]
    args = build_parser().parse_args([*flags, "--max-inflight", "100000"])
    config = build_config(args, model)
    codec = TextCodec.load(model)
    gateway = Gateway(config, codec)
    app = with_server_send(build_app(gateway))
    text = "The gateway turns token ids into text and frames for every stream it holds. "
    token_ids = list(codec.tokenizer.encode(text, add_special_tokens=False))
    node = InProcessNode(token_ids)
    gateway.directory.nodes["fake"] = LiveNode("fake", COLOCATED, "in-process", node)  # type: ignore[arg-type]
    body = {
        "model": config.model.served_name,
        "prompt": list(range(1000, 1016)),
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw = json.dumps(body).encode()
    count = StreamCount()
    await _one_stream(app, raw, StreamCount(), plain_send)  # warm-up
    cpu = time.process_time()
    await asyncio.gather(*(_one_stream(app, raw, count, plain_send) for _ in range(streams)))
    cpu = time.process_time() - cpu
    frames = count.frames - 2 * streams  # the usage chunk and [DONE] of each
    return cpu, streams * tokens, frames


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--interval", type=int, default=1, help="--stream-interval")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--asgi-send",
        action="store_true",
        help="a plain ASGI send: no fast lane, every frame through the chain and `send`",
    )
    args = parser.parse_args(argv)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    per_token = []
    for _ in range(args.rounds):
        cpu, tokens, frames = runner(
            run_round(args.streams, args.tokens, args.interval, args.asgi_send)
        )
        per_token.append(cpu / tokens * 1e6)
        print(
            f"{args.streams} streams x {args.tokens} tokens, interval {args.interval}: "
            f"{cpu / tokens * 1e6:.1f} us CPU per token, {tokens / frames:.2f} tokens per frame",
            flush=True,
        )
    print(f"best {min(per_token):.1f} us, median {statistics.median(per_token):.1f} us per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
