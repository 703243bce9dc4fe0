"""A `GenerateStream` client that stops reading: the node bounds what it holds for it.

A real `decode-server` (the tiny llama allowed 65536 positions, so the requests run until
something ends them) with `--stream-buffer-tokens 32`, and a client that opens eight endless
requests asking for 20 top logprobs a token (large batches) on a channel without BDP probing
(its flow-control window stays at 64 KiB and fills within a few steps), reads one batch and then
nothing. The node must abort every request by itself and free its pages; once the client reads
again, each request's last delta is RESOURCE_EXHAUSTED naming the flag. Without the bound they
would decode forever, their unsent tokens growing in the node's memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway.process.launcher import ServerProcess, running_node
from proto import node_pb2, node_pb2_grpc
from tests.test_node_stream import ENDLESS, PROMPTS, StreamCall, assert_clean

BUFFER_TOKENS = 32
REQUESTS = 8
ABORT_WITHIN_S = 120.0  # a loaded 2-core host: a few hundred steps at worst


@pytest.fixture(scope="module")
def node(
    long_context_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--model", str(long_context_model), "--max-running-requests", str(REQUESTS)]
    args += ["--stream-buffer-tokens", str(BUFFER_TOKENS)]
    log = tmp_path_factory.mktemp("stream-bound-node") / "decode-server.log"
    with running_node("decode-server", args, log, env={"OMP_NUM_THREADS": "1"}) as server:
        yield server


def opening(rid: str, ids: list[int]) -> node_pb2.StreamRequest:
    sampling = node_pb2.SamplingParams(
        max_new_tokens=ENDLESS, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=20
    )
    request = node_pb2.GenerateRequest(rid=rid, input_ids=ids, sampling=sampling)
    return node_pb2.StreamRequest(open=request)


def running(server: ServerProcess) -> int:
    load = server.stub.GetLoad(node_pb2.GetLoadRequest(), timeout=30)
    return int(load.running_requests + load.queued_requests)


def test_a_stalled_reader_gets_its_requests_aborted_and_their_pages_freed(
    node: ServerProcess,
) -> None:
    prompts = list(PROMPTS.values())
    rids = [f"stalled-{i}" for i in range(REQUESTS)]
    # Without BDP probing the call's window stays at gRPC's initial 64 KiB instead of growing
    # to megabytes: it fills within a few steps, as a slow gateway's would in production.
    channel = grpc.insecure_channel(node.address, options=[("grpc.http2.bdp_probe", 0)])
    call = StreamCall(node, node_pb2_grpc.NodeStub(channel))
    for i, rid in enumerate(rids):
        call.send(opening(rid, prompts[i % len(prompts)]))
    call.read_until(lambda c: c.tokens)  # decoding has started; from here on nothing is read
    deadline = time.monotonic() + ABORT_WITHIN_S
    while running(node):
        assert time.monotonic() < deadline, f"still running after {ABORT_WITHIN_S:g} s unread"
        time.sleep(0.2)
    assert_clean(node)  # every page back while the client still reads nothing
    call.half_close()
    call.read_to_end()
    assert set(call.errors) == set(rids), (call.errors, call.finished)
    assert not call.finished
    for rid, error in call.errors.items():
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], error
        assert "--stream-buffer-tokens" in error.message and rid in error.message, error
