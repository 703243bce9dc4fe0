"""A token source for gateway benchmarks: a process that speaks the node gRPC protocol, no model.

It registers with a real bootstrap-server as a colocated node, so a gateway discovers it as it
discovers any node. On `Node.GenerateStream` (what the gateway uses) it answers as a decode
node does (engine/node/multiplex.py): one `StreamBatch` per step with a delta for every request
open on the call, `--tokens-per-message` tokens each.

Two clocks:
- `--step-ms 0` (the default): a step whenever the stream takes the previous batch, so the
  gateway is always the bottleneck (its CPU per token at saturation);
- `--step-ms S`: a step every S ms whatever the gateway does, as an engine steps at its own
  pace. Tokens of steps that the call could not send yet merge into the pending deltas, as a
  decode node merges them when its gateway reads slowly: at B requests this offers
  B / S tokens per ms, and shows whether a gateway keeps up with a node that fast.

With `--per-request-streams` it offers only `Node.Generate` (one `TokenChunk` message per token
per request, serialized once at start), as nodes did before the per-step stream.

    python -m scripts.bench.fake_node --bootstrap HOST:PORT --port N --token-ids 1,2,3 [...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.node.server import PING_POLICY
from engine.ports import LOCALHOST


@dataclass(frozen=True)
class FakeNodeConfig:
    bootstrap: str
    address: str
    token_ids: tuple[int, ...]  # cycled through
    tokens_per_message: int = 1  # per request per step
    step_s: float = 0.0  # 0: a step whenever the stream takes the previous batch
    per_request_streams: bool = False
    node_id: str = ""  # "": the bootstrap names it (a fixed id fixes its place in id order)


@dataclass
class FakeRequest:
    wanted: int  # max_new_tokens
    prompt_tokens: int
    generated: int = 0  # tokens its steps produced
    sent: int = 0  # tokens already in a delta
    rid_field: bytes = b""  # its `RequestDelta.rid`, encoded once (see `StepSource.batch`)

    @property
    def done(self) -> bool:
        return self.sent >= self.wanted


class StepSource:
    """The requests open on one `GenerateStream` call and the tokens they have not sent."""

    def __init__(self, config: FakeNodeConfig) -> None:
        self.config = config
        self.open: dict[str, FakeRequest] = {}
        self.ready = asyncio.Event()  # a step produced tokens that are not sent yet

    def step(self) -> None:
        """Every open request gains `tokens_per_message` tokens (at most its `wanted`)."""
        for request in self.open.values():
            request.generated = min(
                request.generated + self.config.tokens_per_message, request.wanted
            )
        if self.open:
            self.ready.set()

    def batch(self) -> bytes:
        """One serialized `StreamBatch` with each request's unsent tokens (then its end).

        The deltas of requests still running are encoded by hand (protobuf's wire format: the
        rid field encoded once per request, a one-token chunk once per id), so that the
        source costs ~1 us a token instead of ~8 with message objects and can feed several
        gateway workers from one process, in batches as large as a decode node's; a request's
        last delta (its usage) goes through protobuf."""
        from proto import node_pb2

        ids, one_token = self.config.token_ids, self._one_token_chunks
        parts = []
        for rid, request in list(self.open.items()):
            first, last = request.sent, request.generated
            if first == last:
                continue
            request.sent = last
            if not request.done:
                if not request.rid_field:
                    request.rid_field = _field(1, rid.encode())
                if last - first == 1:
                    chunk = one_token[first % len(ids)]
                else:
                    packed = b"".join([_varint(ids[i % len(ids)]) for i in range(first, last)])
                    chunk = _field(2, _field(1, packed))
                delta = request.rid_field + chunk
            else:
                usage = node_pb2.Usage(
                    prompt_tokens=request.prompt_tokens, completion_tokens=request.wanted
                )
                tokens = [ids[i % len(ids)] for i in range(first, last)]
                delta = node_pb2.RequestDelta(
                    rid=rid,
                    chunk=node_pb2.TokenChunk(token_ids=tokens),
                    finished=node_pb2.Finished(finish_reason="length", usage=usage),
                ).SerializeToString()
                del self.open[rid]
            size = len(delta)
            parts.append(b"\x0a%c%b" % (size, delta) if size < 0x80 else _field(1, delta))
        return b"".join(parts)

    @functools.cached_property
    def _one_token_chunks(self) -> list[bytes]:
        """`RequestDelta.chunk` holding one token id, encoded, for each id of the cycle."""
        return [_field(2, _field(1, _varint(token))) for token in self.config.token_ids]


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


async def _clock(source: StepSource, step_s: float) -> None:
    """A step every `step_s`; late steps are not made up (an engine does not catch up)."""
    loop = asyncio.get_running_loop()
    next_at = loop.time()
    while True:
        source.step()
        next_at = max(next_at + step_s, loop.time())
        await asyncio.sleep(next_at - loop.time())


async def _generate_stream(config: FakeNodeConfig, requests: Any) -> AsyncIterator[bytes]:
    source = StepSource(config)
    ended = asyncio.Event()

    async def read() -> None:
        async for msg in requests:
            if msg.HasField("open"):
                req = msg.open
                source.open[req.rid] = FakeRequest(req.sampling.max_new_tokens, len(req.input_ids))
                if config.step_s == 0:
                    source.ready.set()
            else:
                source.open.pop(msg.cancel_rid, None)
        ended.set()

    tasks = [asyncio.create_task(read())]
    if config.step_s > 0:
        tasks.append(asyncio.create_task(_clock(source, config.step_s)))
    try:
        while not (ended.is_set() and not source.open):
            if not source.ready.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(source.ready.wait(), 0.05)
                continue
            if config.step_s == 0:
                source.step()
            if not source.open:
                source.ready.clear()
                continue
            if config.step_s > 0:
                source.ready.clear()
            yield source.batch()
    finally:
        for task in tasks:
            task.cancel()


async def serve(config: FakeNodeConfig) -> None:
    import grpc

    from bootstrap.client import BootstrapClient, NodeSession
    from proto import bootstrap_pb2, node_pb2

    ids = config.token_ids
    per_message = config.tokens_per_message
    running = 0
    session: NodeSession | None = None

    def message(start: int, count: int) -> bytes:
        tokens = [ids[(start + j) % len(ids)] for j in range(count)]
        chunk = node_pb2.TokenChunk(token_ids=tokens)
        return node_pb2.GenerateResponse(chunk=chunk).SerializeToString()

    full = [message(start, per_message) for start in range(len(ids))]  # by first token

    async def generate(request: node_pb2.GenerateRequest, context: object) -> object:
        nonlocal running
        wanted = request.sampling.max_new_tokens
        running += 1
        try:
            for sent in range(0, wanted - per_message + 1, per_message):
                yield full[sent % len(ids)]
            if rest := wanted % per_message:
                yield message(wanted - rest, rest)
            usage = node_pb2.Usage(prompt_tokens=len(request.input_ids), completion_tokens=wanted)
            finished = node_pb2.Finished(finish_reason="length", usage=usage)
            yield node_pb2.GenerateResponse(finished=finished).SerializeToString()
        finally:
            running -= 1

    async def generate_stream(requests: Any, context: object) -> AsyncIterator[bytes]:
        async for batch in _generate_stream(config, requests):
            yield batch

    async def health(request: node_pb2.HealthRequest, context: object) -> node_pb2.HealthResponse:
        node_id = session.node_id if session is not None else ""
        return node_pb2.HealthResponse(ok=True, role="colocated", model="fake", node_id=node_id)

    async def load(request: node_pb2.GetLoadRequest, context: object) -> node_pb2.LoadResponse:
        return node_pb2.LoadResponse(running_requests=running)

    async def abort(request: node_pb2.AbortRequest, context: object) -> node_pb2.AbortResponse:
        return node_pb2.AbortResponse(found=False)

    def unary(behaviour: object, request_type: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            behaviour,
            request_deserializer=request_type.FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )

    # Responses of Generate and GenerateStream are bytes already: no serializer.
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=node_pb2.GenerateRequest.FromString
        ),
        "Health": unary(health, node_pb2.HealthRequest),
        "GetLoad": unary(load, node_pb2.GetLoadRequest),
        "Abort": unary(abort, node_pb2.AbortRequest),
    }
    if not config.per_request_streams:
        handlers["GenerateStream"] = grpc.stream_stream_rpc_method_handler(
            generate_stream, request_deserializer=node_pb2.StreamRequest.FromString
        )
    server = grpc.aio.server(options=PING_POLICY)  # the gateway's keepalive pings, as a node
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("pdserve.node.Node", handlers)]
    )
    server.add_insecure_port(config.address)
    await server.start()
    info = bootstrap_pb2.NodeInfo(
        node_id=config.node_id,
        role=bootstrap_pb2.COLOCATED,
        grpc_address=config.address,
        transfer_backend="mooncake",
    )
    client = BootstrapClient(config.bootstrap)
    session = NodeSession(
        client, info, load=lambda: bootstrap_pb2.NodeLoad(running_requests=running)
    )
    await session.start()
    await server.wait_for_termination()


def build_config(argv: list[str]) -> FakeNodeConfig:
    parser = argparse.ArgumentParser(prog="fake_node", description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True, help="host:port of the bootstrap-server")
    parser.add_argument("--token-ids", required=True, help="comma-separated ids to cycle through")
    parser.add_argument("--host", default=LOCALHOST)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens-per-message", type=int, default=1)
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="one step per this many ms (0: as fast as read)"
    )
    parser.add_argument("--per-request-streams", action="store_true")
    parser.add_argument(
        "--node-id", default="", help="the id to register with (default: the bootstrap's choice)"
    )
    args = parser.parse_args(argv)
    if args.tokens_per_message < 1 or args.step_ms < 0:
        raise SystemExit("--tokens-per-message must be >= 1 and --step-ms >= 0")
    return FakeNodeConfig(
        bootstrap=args.bootstrap,
        address=f"{args.host}:{args.port}",
        token_ids=tuple(int(t) for t in args.token_ids.split(",")),
        tokens_per_message=args.tokens_per_message,
        step_s=args.step_ms / 1000,
        per_request_streams=args.per_request_streams,
        node_id=args.node_id,
    )


def main(argv: list[str] | None = None) -> int:
    asyncio.run(serve(build_config(sys.argv[1:] if argv is None else argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
