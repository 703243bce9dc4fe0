"""`GenerateStream`: many requests on one call, a batch per engine step (engine/node/multiplex.py),
and the gateway's client for it (`GenerateMux`, gateway/dispatch/pd_client.py).

A real `decode-server` with the tiny llama allowed 65536 positions, so a request with a huge
`max_new_tokens` runs until it is cancelled: every check depends on ordering, never on timing.
"""

from __future__ import annotations

import asyncio
import queue
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway.dispatch.pd_client import GenerateMux, pd_generate
from gateway.process.launcher import ServerProcess, running_node
from gateway.routing.nodes import NodeTarget
from proto import node_pb2, node_pb2_grpc

ENDLESS = 60000
RPC_TIMEOUT = 300.0


def greedy(max_new_tokens: int) -> node_pb2.SamplingParams:
    return node_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def opening(rid: str, ids: list[int], max_new_tokens: int) -> node_pb2.StreamRequest:
    request = node_pb2.GenerateRequest(rid=rid, input_ids=ids, sampling=greedy(max_new_tokens))
    return node_pb2.StreamRequest(open=request)


class StreamCall:
    """A blocking `GenerateStream` call: `send` messages, `read_until` what arrived per request."""

    def __init__(self, server: ServerProcess, stub: node_pb2_grpc.NodeStub | None = None) -> None:
        self._outbox: queue.Queue[node_pb2.StreamRequest | None] = queue.Queue()
        stub = stub or server.stub
        self.call = stub.GenerateStream(iter(self._outbox.get, None), timeout=RPC_TIMEOUT)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, node_pb2.Finished] = {}
        self.errors: dict[str, node_pb2.RequestError] = {}
        self.batches = 0

    def send(self, message: node_pb2.StreamRequest) -> None:
        self._outbox.put(message)

    def half_close(self) -> None:
        self._outbox.put(None)

    def read_until(self, done) -> None:  # type: ignore[no-untyped-def]
        while not done(self):
            self._take(next(self.call))

    def read_to_end(self) -> None:
        for batch in self.call:
            self._take(batch)

    def _take(self, batch: node_pb2.StreamBatch) -> None:
        self.batches += 1
        rids = [d.rid for d in batch.deltas]
        assert len(rids) == len(set(rids)), f"two deltas for one request in a batch: {rids}"
        for delta in batch.deltas:
            ended = delta.rid in self.finished or delta.rid in self.errors
            assert not ended, f"a delta after the end of {delta.rid}"
            self.tokens[delta.rid].extend(delta.chunk.token_ids)
            if delta.HasField("finished"):
                self.finished[delta.rid] = delta.finished
            if delta.HasField("error"):
                self.errors[delta.rid] = delta.error


@pytest.fixture(scope="module")
def node(long_context_model: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    args = ["--model", str(long_context_model), "--max-running-requests", "8"]
    log = tmp_path_factory.mktemp("stream-node") / "decode-server.log"
    with running_node("decode-server", args, log, env={"OMP_NUM_THREADS": "1"}) as server:
        yield server


def assert_clean(server: ServerProcess) -> None:
    check = server.wait_idle()
    assert check.ok, check.error
    assert check.used_pages == 0, check


def generate(server: ServerProcess, ids: list[int], max_new_tokens: int) -> list[int]:
    request = node_pb2.GenerateRequest(input_ids=ids, sampling=greedy(max_new_tokens))
    stream = server.stub.Generate(request, timeout=RPC_TIMEOUT)
    return [t for msg in stream if msg.HasField("chunk") for t in msg.chunk.token_ids]


PROMPTS = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6, 5, 3, 5, 8], "c": [2, 7], "d": [1, 1, 2, 3, 5, 8]}
LENGTHS = {"a": 3, "b": 5, "c": 8, "d": 13}


def test_requests_on_one_stream_get_what_generate_gives(node: ServerProcess) -> None:
    expected = {rid: generate(node, PROMPTS[rid], LENGTHS[rid]) for rid in PROMPTS}
    call = StreamCall(node)
    for rid, ids in PROMPTS.items():
        call.send(opening(rid, ids, LENGTHS[rid]))
    call.half_close()
    call.read_to_end()  # the node ends the call: client side closed, every request over
    assert dict(call.tokens) == expected
    assert not call.errors
    for rid, finished in call.finished.items():
        assert finished.finish_reason == "length"
        assert finished.usage.completion_tokens == LENGTHS[rid]
        assert finished.usage.prompt_tokens == len(PROMPTS[rid])
    assert set(call.finished) == set(PROMPTS)
    assert call.batches < sum(LENGTHS.values())  # batched: fewer messages than tokens
    assert_clean(node)


def test_cancel_aborts_only_that_request(node: ServerProcess) -> None:
    call = StreamCall(node)
    call.send(opening("endless", [5, 6, 7], ENDLESS))
    call.read_until(lambda c: c.tokens["endless"])
    call.send(node_pb2.StreamRequest(cancel_rid="endless"))
    call.send(opening("short", PROMPTS["b"], 6))
    call.half_close()
    call.read_to_end()
    assert "endless" not in call.finished  # a cancelled request gets nothing more
    assert call.finished["short"].finish_reason == "length"
    assert call.tokens["short"] == generate(node, PROMPTS["b"], 6)
    assert_clean(node)  # the endless request's pages are free: the cancel aborted it


def test_a_refused_request_gets_an_error_and_the_others_go_on(node: ServerProcess) -> None:
    call = StreamCall(node)
    call.send(opening("bad", [10**7], 4))
    call.send(opening("good", PROMPTS["a"], 4))
    call.half_close()
    call.read_to_end()
    assert call.errors["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "vocabulary" in call.errors["bad"].message, call.errors
    assert not call.errors.get("good"), call.errors["good"]
    assert "good" in call.finished, (dict(call.tokens), call.batches)
    assert call.finished["good"].usage.completion_tokens == 4
    assert_clean(node)


def test_an_open_without_rid_fails_the_call(node: ServerProcess) -> None:
    call = StreamCall(node)
    call.send(opening("", PROMPTS["a"], 4))
    with pytest.raises(grpc.RpcError) as excinfo:
        call.read_to_end()
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rid" in excinfo.value.details()


def test_the_call_ending_aborts_its_requests(node: ServerProcess) -> None:
    call = StreamCall(node)
    call.send(opening("e1", [5, 6, 7], ENDLESS))
    call.send(opening("e2", [7, 6, 5], ENDLESS))
    call.read_until(lambda c: c.tokens["e1"] and c.tokens["e2"])
    call.call.cancel()  # the gateway went away
    assert_clean(node)  # neither request can end by itself: the node aborted both


def test_pd_client_requests_share_one_stream(node: ServerProcess) -> None:
    expected = [generate(node, PROMPTS[rid], LENGTHS[rid]) for rid in PROMPTS]

    async def run() -> tuple[list[list[int]], GenerateMux, GenerateMux]:
        async with grpc.aio.insecure_channel(node.address) as channel:
            target = NodeTarget("d", node_pb2_grpc.NodeStub(channel))
            mux = GenerateMux.for_stub(target.stub)
            results = await asyncio.gather(
                *(
                    pd_generate(target, None, PROMPTS[rid], greedy(LENGTHS[rid]), rid=f"mux-{rid}")
                    for rid in PROMPTS
                )
            )
            return [r.token_ids for r in results], mux, GenerateMux.for_stub(target.stub)

    tokens, mux, again = asyncio.run(run())
    assert tokens == expected
    assert mux is again and mux.supported
    assert_clean(node)


class OnlyGenerate(node_pb2_grpc.NodeServicer):
    """A node from before GenerateStream."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        yield node_pb2.GenerateResponse(chunk=node_pb2.TokenChunk(token_ids=[7, 8]))
        yield node_pb2.GenerateResponse(finished=node_pb2.Finished(finish_reason="length"))


def test_pd_client_falls_back_to_generate_on_an_older_node() -> None:
    async def run() -> tuple[list[list[int]], bool]:
        server = grpc.aio.server()
        node_pb2_grpc.add_NodeServicer_to_server(OnlyGenerate(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                target = NodeTarget("old", node_pb2_grpc.NodeStub(channel))
                first = await pd_generate(target, None, [1, 2], greedy(2), rid="x1")
                second = await pd_generate(target, None, [1, 2], greedy(2), rid="x2")
                return [first.token_ids, second.token_ids], GenerateMux.for_stub(
                    target.stub
                ).supported
        finally:
            await server.stop(None)

    tokens, supported = asyncio.run(run())
    assert tokens == [[7, 8], [7, 8]]
    assert not supported
