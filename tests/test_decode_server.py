"""`decode-server` end to end: the real console script in a subprocess, a real gRPC client.

Servers are module-scoped and shared by the tests that can share them:

- `tiny_server`: the tiny llama with its position limit raised to 65536, so a request with a huge
  `max_new_tokens` cannot finish on its own during a test: streaming, abort and cancel checks
  then depend on ordering only, never on timing.
- `small_pool_server`: the tiny llama with `--context-length 64` and a 6-page KV pool: bad
  input and retraction.
- `default_server`: the real default model (slow): 32 concurrent requests against HF.

SIGTERM and the watchdog each stop their server, so they start their own.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from gateway.process.launcher import ServerProcess as NodeServer
from gateway.process.launcher import running_node, session_pids
from proto import node_pb2
from scripts.tiny_models import hf_greedy

# One torch thread per process: this machine's two cores are shared, and oversubscribed OpenMP
# threads spin (measured: HF greedy 10x slower with two threads than with one under load).
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
RPC_TIMEOUT = 300.0  # only against hangs: nothing here depends on how fast a server is
ENDLESS = 60000  # max_new_tokens no test waits for (see `long_context_model`)


def decode_server(args: list[str], log_path: Path) -> AbstractContextManager[NodeServer]:
    return running_node("decode-server", args, log_path, env=SERVER_ENV)


def reference(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`hf_greedy` on one torch thread (see SERVER_ENV)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return hf_greedy(model_dir, prompts, max_new_tokens)
    finally:
        torch.set_num_threads(threads)


def greedy(max_new_tokens: int) -> node_pb2.SamplingParams:
    return node_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


@dataclass
class Generation:
    """Everything one Generate stream delivered, in order."""

    chunks: list[list[int]] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # "chunk" | "finished", per message
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() per message
    finished: node_pb2.Finished | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk]

    def add(self, msg: node_pb2.GenerateResponse) -> None:
        kind = msg.WhichOneof("payload")
        assert kind in ("chunk", "finished"), msg
        assert self.finished is None, f"a message after Finished: {msg}"
        self.kinds.append(kind)
        self.arrivals.append(time.monotonic())
        if kind == "chunk":
            self.chunks.append(list(msg.chunk.token_ids))
        else:
            self.finished = msg.finished


def collect(
    stream: Iterator[node_pb2.GenerateResponse], into: Generation | None = None
) -> Generation:
    """Read a stream to its end (its status, not just Finished); asserts one Finished, last."""
    gen = into or Generation()
    for msg in stream:
        gen.add(msg)
    assert gen.finished is not None, f"the stream ended without Finished: {gen.kinds}"
    return gen


def generate(
    server: NodeServer, ids: list[int], params: node_pb2.SamplingParams, rid: str = ""
) -> Generation:
    request = node_pb2.GenerateRequest(rid=rid, input_ids=ids, sampling=params)
    return collect(server.stub.Generate(request, timeout=RPC_TIMEOUT))


def start_endless(server: NodeServer, rid: str) -> tuple[Any, Generation]:
    """Start a request that only an abort or a cancel ends; returns once its first chunk came."""
    request = node_pb2.GenerateRequest(rid=rid, input_ids=[5, 6, 7], sampling=greedy(ENDLESS))
    call = server.stub.Generate(request, timeout=RPC_TIMEOUT)
    gen = Generation()
    gen.add(next(call))
    assert gen.kinds == ["chunk"]
    return call, gen


def assert_clean(server: NodeServer) -> None:
    check = server.integrity()
    assert check.ok, check.error
    assert check.used_pages == 0, check
    assert check.free_pages + check.used_pages + check.cached_pages == check.total_pages, check


def assert_rpc_error(
    excinfo: pytest.ExceptionInfo[grpc.RpcError], code: grpc.StatusCode, word: str
) -> None:
    err = excinfo.value
    assert err.code() == code, f"{err.code()}: {err.details()}"
    assert word in err.details(), err.details()


# ---- servers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(long_context_model: Path, tmp_path_factory) -> Iterator[NodeServer]:
    args = ["--model", str(long_context_model), "--max-running-requests", "8"]
    log = tmp_path_factory.mktemp("tiny-server") / "decode-server.log"
    with decode_server(args, log) as server:
        yield server


SMALL_POOL_PAGES = 6
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def small_pool_server(tiny_model_dir, tmp_path_factory) -> Iterator[NodeServer]:
    args = [
        "--model", str(tiny_model_dir("llama")),
        "--context-length", "64",
        "--page-size", str(PAGE_SIZE),
        "--max-total-tokens", str(SMALL_POOL_PAGES * PAGE_SIZE),
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("small-pool-server") / "decode-server.log"
    with decode_server(args, log) as server:
        yield server


@pytest.fixture(scope="module")
def default_server(default_model_dir, tmp_path_factory) -> Iterator[NodeServer]:
    args = ["--model", str(default_model_dir), "--chunked-prefill-size", "64", "--page-size", "16"]
    log = tmp_path_factory.mktemp("default-server") / "decode-server.log"
    with decode_server(args, log) as server:
        yield server


# ---- correctness under concurrency -----------------------------------------------------------


def _text_corpus(tokenizer) -> list[int]:
    subjects = ["The old ship", "A curious fox", "Our committee", "The river", "My neighbour"]
    verbs = ["carried", "examined", "ignored", "painted", "followed", "measured"]
    objects = ["seven lanterns", "the northern road", "a quiet garden", "every letter"]
    places = ["before dawn", "in the harbour", "near the market", "after the storm"]
    sentences = [
        f"{subjects[i % 5]} {verbs[i % 6]} {objects[i % 4]} {places[(i * 3) % 4]}, "
        f"and then counted {i * 7 + 3} steps."
        for i in range(60)
    ]
    return list(tokenizer(" ".join(sentences))["input_ids"])


@pytest.mark.slow
def test_concurrent_mixed_lengths_match_hf(default_server: NodeServer, default_model_dir) -> None:
    from engine.tokenizer import load_tokenizer

    corpus = _text_corpus(load_tokenizer(str(default_model_dir)))
    # Mostly short prompts (HF references are costly on a CPU) and four over the 64-token
    # chunk, the longest split into five chunks.
    lengths = [5 + (i * 7) % 44 for i in range(28)]
    for i, n in zip((3, 10, 17, 30), (70, 129, 200, 300), strict=True):
        lengths.insert(i, n)
    assert len(corpus) > 300 + 31 * 11 and len(lengths) == 32
    prompts = [corpus[i * 11 : i * 11 + n] for i, n in enumerate(lengths)]
    max_new = 8
    expected = reference(default_model_dir, prompts, max_new)

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [
            pool.submit(generate, default_server, p, greedy(max_new), f"mixed-{i}")
            for i, p in enumerate(prompts)
        ]
        gens = [f.result() for f in futures]

    for i, (gen, prompt) in enumerate(zip(gens, prompts, strict=True)):
        assert gen.token_ids == expected[i], f"prompt {i} ({len(prompt)} tokens)"
        assert gen.finished is not None and gen.finished.finish_reason == "length"
        assert gen.finished.usage.prompt_tokens == len(prompt)
        assert gen.finished.usage.completion_tokens == max_new
    default_server.wait_idle()
    assert_clean(default_server)


def test_retraction_when_pool_is_short(small_pool_server: NodeServer, tiny_model_dir) -> None:
    """12 requests of 4 pages each on a 6-page pool: some must be retracted, none may change."""
    # 33-45 prompt tokens (3 pages) + 18 outputs cross into a 4th page, under the 64 context.
    prompts = [[(7 * i + 11 * j) % 250 + 1 for j in range(33 + i)] for i in range(12)]
    max_new = 18
    assert all(len(p) + max_new < 64 for p in prompts)
    expected = reference(tiny_model_dir("llama"), prompts, max_new)
    retractions_before = small_pool_server.log_text().count("retracted request")

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [
            pool.submit(generate, small_pool_server, p, greedy(max_new), f"retract-{i}")
            for i, p in enumerate(prompts)
        ]
        gens = [f.result() for f in futures]

    assert [g.token_ids for g in gens] == expected
    assert all(g.finished and g.finished.finish_reason == "length" for g in gens)
    retractions = small_pool_server.log_text().count("retracted request") - retractions_before
    assert retractions > 0, small_pool_server.log_tail()
    small_pool_server.wait_idle()
    assert_clean(small_pool_server)


# ---- streaming, abort, cancel ----------------------------------------------------------------


def test_stream_sends_one_chunk_per_token_then_finished(
    tiny_server: NodeServer, tiny_model_dir
) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    gen = generate(tiny_server, prompt, greedy(16))
    assert gen.kinds == ["chunk"] * 16 + ["finished"]
    assert [len(c) for c in gen.chunks] == [1] * 16
    assert gen.arrivals == sorted(gen.arrivals)
    assert gen.finished is not None
    assert gen.finished.finish_reason == "length"
    assert gen.finished.usage.completion_tokens == 16
    assert gen.finished.usage.prompt_tokens == len(prompt)
    assert gen.token_ids == reference(tiny_model_dir("llama"), [prompt], 16)[0]
    assert_clean(tiny_server)


def test_first_chunk_arrives_while_request_runs_and_abort_ends_it(tiny_server: NodeServer) -> None:
    call, gen = start_endless(tiny_server, "abort-me")
    load = tiny_server.stub.GetLoad(node_pb2.GetLoadRequest(), timeout=RPC_TIMEOUT)
    assert load.running_requests == 1, "the first token is streamed before the request ends"

    reply = tiny_server.stub.Abort(node_pb2.AbortRequest(rid="abort-me"), timeout=RPC_TIMEOUT)
    assert reply.found
    collect(call, gen)
    assert gen.finished is not None
    assert gen.finished.finish_reason == "abort"
    assert "aborted" in gen.finished.detail
    assert gen.finished.usage.completion_tokens >= len(gen.token_ids)
    assert_clean(tiny_server)  # Abort returns after the engine freed the pages


def test_client_cancel_frees_pages(tiny_server: NodeServer) -> None:
    call, _ = start_endless(tiny_server, "cancel-me")
    assert tiny_server.integrity().used_pages > 0
    call.cancel()
    with pytest.raises(grpc.RpcError) as excinfo:
        next(call)
    assert excinfo.value.code() == grpc.StatusCode.CANCELLED
    # The request cannot end by itself, so an idle server means the cancel freed it.
    tiny_server.wait_idle()
    assert_clean(tiny_server)
    with pytest.raises(grpc.RpcError) as excinfo:
        tiny_server.stub.Abort(node_pb2.AbortRequest(rid="cancel-me"), timeout=RPC_TIMEOUT)
    assert_rpc_error(excinfo, grpc.StatusCode.NOT_FOUND, "cancel-me")


def test_duplicate_rid_while_running(tiny_server: NodeServer) -> None:
    call, _ = start_endless(tiny_server, "twice")
    with pytest.raises(grpc.RpcError) as excinfo:
        generate(tiny_server, [1, 2], greedy(2), rid="twice")
    assert_rpc_error(excinfo, grpc.StatusCode.ALREADY_EXISTS, "already running")
    tiny_server.stub.Abort(node_pb2.AbortRequest(rid="twice"), timeout=RPC_TIMEOUT)
    collect(call)
    # Once its stream is over, the id is free again.
    assert generate(tiny_server, [1, 2], greedy(2), rid="twice").token_ids
    assert_clean(tiny_server)


# ---- bad input -------------------------------------------------------------------------------

BAD_REQUESTS = {
    "empty prompt": ([], greedy(4), "prompt is empty"),
    "prompt at the context length": ([1] * 64, greedy(4), "context length is 64"),
    "zero max_new_tokens": ([1, 2], greedy(0), "max_new_tokens must be >= 1"),
    "negative max_new_tokens": ([1, 2], greedy(-3), "max_new_tokens must be >= 1"),
    "token id above the vocabulary": ([1, 256], greedy(4), "outside the vocabulary"),
    "negative token id": ([-1, 2], greedy(4), "outside the vocabulary"),
    "stop token above the vocabulary": (
        [1, 2],
        node_pb2.SamplingParams(max_new_tokens=4, stop_token_ids=[300]),
        "stop_token_ids",
    ),
    "negative temperature": (
        [1, 2],
        node_pb2.SamplingParams(max_new_tokens=4, temperature=-1.0),
        "temperature",
    ),
}


def assert_still_serves(server: NodeServer) -> None:
    gen = generate(server, [1, 2, 3], greedy(3))
    assert gen.finished is not None and gen.finished.finish_reason == "length"
    assert len(gen.token_ids) == 3
    assert_clean(server)


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_invalid_argument(small_pool_server: NodeServer, case: str) -> None:
    ids, params, message = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as excinfo:
        generate(small_pool_server, ids, params)
    assert_rpc_error(excinfo, grpc.StatusCode.INVALID_ARGUMENT, message)
    assert_still_serves(small_pool_server)


def test_abort_of_unknown_rid_is_not_found(small_pool_server: NodeServer) -> None:
    with pytest.raises(grpc.RpcError) as excinfo:
        small_pool_server.stub.Abort(node_pb2.AbortRequest(rid="nobody"), timeout=RPC_TIMEOUT)
    assert_rpc_error(excinfo, grpc.StatusCode.NOT_FOUND, "'nobody'")
    assert_still_serves(small_pool_server)


def test_garbage_bytes_are_rejected(small_pool_server: NodeServer) -> None:
    raw_generate = small_pool_server.channel.unary_stream(
        "/pdserve.node.Node/Generate", request_serializer=None, response_deserializer=None
    )
    with pytest.raises(grpc.RpcError) as excinfo:
        list(raw_generate(b"\xff\x00garbage", timeout=RPC_TIMEOUT))
    # grpc.aio answers a request it cannot parse with UNKNOWN; INVALID_ARGUMENT would be better.
    assert excinfo.value.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT)
    assert "GenerateRequest" in excinfo.value.details(), excinfo.value.details()
    assert_still_serves(small_pool_server)


# ---- process life cycle ----------------------------------------------------------------------


def test_sigterm_ends_in_flight_request_and_exits_zero(
    long_context_model: Path, tmp_path: Path
) -> None:
    args = ["--model", str(long_context_model), "--max-running-requests", "4"]
    with decode_server([*args, "--drain-timeout", "1"], tmp_path / "log") as server:
        call, gen = start_endless(server, "in-flight")
        outcome: list[BaseException | None] = []

        def read_to_end() -> None:
            try:
                collect(call, gen)
                outcome.append(None)
            except BaseException as exc:  # any terminal status; an exception is the outcome
                outcome.append(exc)

        reader = threading.Thread(target=read_to_end, daemon=True)
        reader.start()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=120) == 0, server.log_tail()
        reader.join(timeout=120)
        assert not reader.is_alive(), "the client hangs after the server exited"
        [error] = outcome
        if error is None:
            assert gen.finished is not None and gen.finished.finish_reason == "abort"
        else:
            assert isinstance(error, grpc.RpcError), repr(error)
            assert error.code() != grpc.StatusCode.OK
        assert session_pids(server.pid) == [], "the server left processes behind"
        log = server.log_text()
        assert "draining" in log and "stopped" in log, server.log_tail()
        assert "aborted 1 in-flight requests" in log and "no page in use" in log, server.log_tail()


def test_watchdog_kills_a_wedged_node(long_context_model: Path, tmp_path: Path) -> None:
    # A limit shorter than any step makes every step "wedged"; the watchdog looks once a second.
    args = ["--model", str(long_context_model), "--max-running-requests", "4"]
    with decode_server([*args, "--watchdog-timeout", "0.001"], tmp_path / "log") as server:
        request = node_pb2.GenerateRequest(input_ids=[5, 6, 7], sampling=greedy(ENDLESS))
        with pytest.raises(grpc.RpcError) as excinfo:
            collect(server.stub.Generate(request, timeout=RPC_TIMEOUT))
        assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE, excinfo.value.details()
        assert server.process.wait(timeout=60) == 70
        assert "watchdog: one scheduler step has run" in server.log_text()
