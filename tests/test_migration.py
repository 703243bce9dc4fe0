"""Mid-stream migration (docs/architecture.md, failure semantics): a decode node dies while it
streams, and the client's streams go on from another decode node as if nothing happened.

Real processes on 127.0.0.1 (tests/fault_cluster.py): a bootstrap, one prefill node, two decode
nodes (Mooncake over TCP) and a gateway, with the tiny random-weight llama and the default
model's tokenizer. Several streams run at once, greedy and seeded sampling, spread over both
decode nodes (round robin), so the node that is SIGKILLed carries more than one request on its
one multiplexed `GenerateStream` call. Checked per stream, against a reference run of the same
request on the healthy cluster:

- the streamed text equals the reference exactly: no token repeated, none missing; seeded
  sampling too, since a draw depends on (seed, token position) only (engine/sampling.py);
  `logit_bias` and `min_tokens` too (counted from the stream's start, not from the move);
- `finish_reason` is "length" and `usage.completion_tokens` is `max_tokens`: the budget was
  counted across the move;
- the gateway counted one migration per stream the dead node held, and the survivors hold no
  page.

The same kill with every prompt prefilled by the decode nodes themselves (the move too); with
`--migration-limit 0` it ends the dead node's streams with an SSE error that names the node
instead. Then SIGTERM drains: a decode node (its streams end there, or move once its
--drain-timeout ran out) and the gateway (503 for new requests, its streams finish).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from proto import node_pb2
from tests.fault_cluster import FaultCluster, cluster_fixture, prompts

MAX_TOKENS = 160  # long enough that every stream is mid-way when the node dies
KILL_AFTER = 6  # text chunks every stream must have received before the kill
PROMPTS = prompts(count=4, length=40, seed=19)
SAMPLING: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 0.9, "seed": 7},
    # Token 100 is the argmax of every draw and a stop token, masked until min_tokens: a node
    # that took the stream over without counting the tokens before the move (or without the
    # fields) stops it at once; the bias on 200 steers the text, so a lost bias shows as well.
    {
        "temperature": 0.0,
        "stop_token_ids": [100],
        "min_tokens": MAX_TOKENS,
        "logit_bias": {"100": 100, "200": 2},
    },
    {"temperature": 1.0, "top_p": 0.9, "seed": -11},
]
NODES: dict[str, tuple[str, list[str]]] = {
    "prefill-0": ("prefill-server", []),
    "decode-0": ("decode-server", ["--drain-timeout", "60"]),  # SIGTERM: streams end here
    # 0: its streams are aborted at once and move (0.5 s let a calm host finish all 154 tokens)
    "decode-1": ("decode-server", ["--drain-timeout", "0"]),  # SIGTERM: streams move
}
DECODES = ["decode-0", "decode-1"]
GATEWAY_ARGS = (
    "--local-prefill-max-tokens", "0",  # the first attempt and the move both go through P
    "--decode-policy", "round_robin",
)  # fmt: skip


@dataclass
class StreamResult:
    chunks: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    started: threading.Event = field(default_factory=threading.Event)
    rid: str = ""  # the gateway's id of the request (its log names it)


def body(index: int) -> dict[str, Any]:
    return {
        "prompt": list(PROMPTS[index]),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **SAMPLING[index],
    }


def stream(cluster: FaultCluster, index: int, result: StreamResult) -> None:
    """Stream request `index` to its end into `result`; `started` is set after KILL_AFTER
    chunks (or at the end)."""
    payload = {"model": cluster.model_name, **body(index)}
    try:
        with httpx.stream(
            "POST", cluster.url + "/v1/completions", json=payload, timeout=120
        ) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = str(event["error"]["message"])
                    break
                for choice in event.get("choices") or []:
                    result.text += choice.get("text") or ""
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                    result.chunks += 1
                result.usage = event.get("usage") or result.usage
                result.rid = event.get("id") or result.rid
                if result.chunks >= KILL_AFTER:
                    result.started.set()
    finally:
        result.started.set()


def start_streams(cluster: FaultCluster) -> tuple[list[StreamResult], list[threading.Thread]]:
    """All requests at once, each streamed by its own thread."""
    results = [StreamResult() for _ in PROMPTS]
    threads = [
        threading.Thread(target=stream, args=(cluster, i, r), daemon=True)
        for i, r in enumerate(results)
    ]
    for thread in threads:
        thread.start()
    return results, threads


def join_streams(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a stream did not end"


def run_streams(
    cluster: FaultCluster, kill: bool | str, stop: Callable[[str], object] | None = None
) -> tuple[list[StreamResult], dict[str, int]]:
    """All requests at once; with `kill`, `stop` (default: SIGKILL) the decode node with the
    most of them (or decode-0 / decode-1 when `kill` names it) once every stream is under way.
    Returns the results and how many requests each node held."""
    results, threads = start_streams(cluster)
    for result in results:
        assert result.started.wait(60), "a stream did not start"
    held = {}
    if kill:
        for name in DECODES:
            load = cluster[name].stub.GetLoad(node_pb2.GetLoadRequest(), timeout=10)
            held[name] = load.running_requests + load.queued_requests
        victim = kill if isinstance(kill, str) else max(held, key=lambda name: held[name])
        (stop or cluster.kill)(victim)
    join_streams(threads)
    return results, held


def wait_decoding(cluster: FaultCluster, name: str) -> None:
    """Until `name` decodes one of the streams. Only the node's GetLoad is polled (every few ms):
    the tiny model streams MAX_TOKENS in a second or two, and on a busy host one round trip
    through the gateway (its /metrics, a stream's chunks) can take longer than that.

    The condition is about `name` alone: waiting for every stream's KILL_AFTER-th chunk let a
    node finish all its streams while the other node's last one had not sent its sixth chunk
    (requests reach the prefill node up to a second apart on a busy host), and the drained
    node then held nothing."""
    deadline = time.monotonic() + 60
    while True:
        load = cluster[name].stub.GetLoad(node_pb2.GetLoadRequest(), timeout=10)
        if load.running_requests >= 1:
            return
        assert time.monotonic() < deadline, f"{name} decoded none of the streams: {load}"
        time.sleep(0.002)


cluster = cluster_fixture("migration", NODES, GATEWAY_ARGS)


@pytest.fixture(scope="module")
def reference(cluster: FaultCluster) -> list[StreamResult]:
    results, _ = run_streams(cluster, kill=False)
    for result in results:
        assert not result.error and result.finish_reason == "length", result
    return results


def test_killed_decode_node_streams_move_and_match_the_reference(
    cluster: FaultCluster, reference: list[StreamResult]
) -> None:
    cluster.ensure()
    moved_before = cluster.gateway_metric("pdserve_gateway_migrations_total")
    results, held = run_streams(cluster, kill=True)
    assert max(held.values()) >= 2, f"the killed node should carry several streams: {held}"
    for index, (got, want) in enumerate(zip(results, reference, strict=True)):
        assert not got.error, f"stream {index}: {got.error}"
        assert got.text == want.text, f"stream {index} ({SAMPLING[index]}) differs"
        assert got.finish_reason == "length"
        assert got.usage["completion_tokens"] == MAX_TOKENS
        assert got.usage["prompt_tokens"] == len(PROMPTS[index])
    moved = cluster.gateway_metric("pdserve_gateway_migrations_total") - moved_before
    assert moved == max(held.values())
    gap = cluster.gateway_metric("pdserve_gateway_migration_gap_seconds_sum")
    print(f"\n{int(moved)} streams moved; mean gap (failure -> next token) {gap / moved:.3f} s")
    survivors = [n for n in cluster.node_names() if cluster.procs[n].alive]
    assert cluster.leaked_pages(survivors) == dict.fromkeys(survivors, 0)


def test_streams_prefilled_locally_move_and_match_too(
    cluster: FaultCluster, reference: list[StreamResult]
) -> None:
    """The same kill with every prompt prefilled by the decode node itself (no prefill node
    on the way, first attempt or move): the new decode node prefills prompt + streamed tokens
    and continues exactly."""
    cluster.gateway_args = (*GATEWAY_ARGS, "--local-prefill-max-tokens", "100000")
    cluster.forget("gateway")  # started again with the new flag
    try:
        cluster.ensure()
        results, held = run_streams(cluster, kill=True)
        assert max(held.values()) >= 1
        for index, (got, want) in enumerate(zip(results, reference, strict=True)):
            assert not got.error, f"stream {index}: {got.error}"
            assert got.text == want.text, f"stream {index} ({SAMPLING[index]}) differs"
            assert got.usage["completion_tokens"] == MAX_TOKENS
        assert cluster.gateway_metric("pdserve_gateway_migrations_total") == max(held.values())
        assert cluster.gateway_metric("pdserve_gateway_local_prefills_total") >= len(PROMPTS)
    finally:
        cluster.gateway_args = GATEWAY_ARGS
        cluster.forget("gateway")
        cluster.ensure()


def test_without_migrations_the_stream_ends_with_an_error_naming_the_node(
    cluster: FaultCluster, reference: list[StreamResult]
) -> None:
    cluster.gateway_args = (*GATEWAY_ARGS, "--migration-limit", "0")
    cluster.forget("gateway")  # started again with the new flag
    try:
        cluster.ensure()
        results, held = run_streams(cluster, kill=True)
        killed = max(held, key=lambda name: held[name])
        dead_id = cluster.node_id(killed)
        failed = [r for r in results if r.error]
        assert len(failed) == held[killed]
        for result in failed:
            assert dead_id in result.error and "--migration-limit" in result.error
        for got, want in zip(results, reference, strict=True):
            if not got.error:
                assert got.text == want.text
    finally:
        cluster.gateway_args = GATEWAY_ARGS
        cluster.forget("gateway")
        cluster.ensure()


@pytest.mark.parametrize(("victim", "moves"), [("decode-0", False), ("decode-1", True)])
def test_sigterm_drains_the_decode_node(
    cluster: FaultCluster, reference: list[StreamResult], victim: str, moves: bool
) -> None:
    """SIGTERM a decode node mid-stream: it takes no new requests (a request sent during the
    drain succeeds elsewhere), finishes its streams (decode-0, a long --drain-timeout) or, its
    timeout run out, aborts them and the gateway moves them (decode-1), and exits 0 with no
    page in use. Either way every client gets the reference text."""
    cluster.ensure()
    moved_before = cluster.gateway_metric("pdserve_gateway_migrations_total")
    node_log, gateway_log = cluster[victim].log_text(), cluster["gateway"].log_text()
    results, threads = start_streams(cluster)
    wait_decoding(cluster, victim)
    with ThreadPoolExecutor(1) as pool:
        exited = pool.submit(cluster.terminate, victim)
        _wait_for_log(cluster, "bootstrap", f"{cluster.node_id(victim)} is draining")
        late = complete(cluster, 0)  # routed around the draining node
        exit_code = exited.result(timeout=120)
    join_streams(threads)
    assert exit_code == 0
    log = cluster[victim].log_text()[len(node_log) :]
    # What the node held when it began to drain, in its own words: a GetLoad before the
    # SIGTERM races with streams that end in between.
    draining = re.search(r"draining \(shutting down\): no new requests; (\d+) in flight", log)
    assert draining, log
    held = int(draining[1])
    assert held >= 1
    for got, want in zip(results, reference, strict=True):
        assert not got.error and got.text == want.text
        assert got.usage["completion_tokens"] == MAX_TOKENS
    assert late == reference[0].text
    moved = cluster.gateway_metric("pdserve_gateway_migrations_total") - moved_before
    assert "drained: no request in flight, no page in use" in log
    assert ("aborted" in log) == moves
    if not moves:
        assert moved == 0
        return
    assert f"aborted {held} in-flight requests" in log
    # The streams the node gave up, in the gateway's words: those that had streamed tokens
    # move; one aborted while it still waited for its KV is sent again from scratch (a retry,
    # not a move). A stream that reached the node after its drain began was refused there
    # ("failed before its first token") and went elsewhere: the node never held it.
    gateway = cluster["gateway"].log_text()[len(gateway_log) :]
    streamed = {}
    for result in results:
        failed = rf"request {re.escape(result.rid)}-0 attempt 1 failed after (\d+) streamed tokens"
        found = re.search(failed + ".*", gateway)
        if found and "failed before its first token" not in found[0]:
            streamed[result.rid] = int(found[1])
    assert len(streamed) == held, (streamed, held)
    assert moved == sum(1 for tokens in streamed.values() if tokens > 0)


def complete(cluster: FaultCluster, index: int) -> str:
    """Request `index`, not streamed: its text."""
    payload = {"model": cluster.model_name, **body(index), "stream": False}
    payload.pop("stream_options")
    response = httpx.post(cluster.url + "/v1/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def _wait_for_log(cluster: FaultCluster, name: str, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in cluster[name].log_text():
        assert time.monotonic() < deadline, f"{name}'s log never said {text!r}"
        time.sleep(0.1)


def test_sigterm_on_the_gateway_finishes_its_streams(
    cluster: FaultCluster, reference: list[StreamResult]
) -> None:
    """SIGTERM the gateway mid-stream: /health fails and a new request gets 503 with
    Retry-After at once, the streams in flight finish with the reference text, and the
    gateway exits 0."""
    cluster.ensure()
    seen: dict[str, object] = {}

    def stop_gateway(_victim: str) -> None:
        with ThreadPoolExecutor(1) as pool:
            exited = pool.submit(cluster.terminate, "gateway")
            deadline = time.monotonic() + 30
            while httpx.get(cluster.url + "/health", timeout=10).status_code != 503:
                assert time.monotonic() < deadline, "/health still answers 200"
                time.sleep(0.05)
            payload = {"model": cluster.model_name, **body(0), "stream": False}
            payload.pop("stream_options")
            refused = httpx.post(cluster.url + "/v1/completions", json=payload, timeout=30)
            seen["refused"] = (refused.status_code, refused.headers.get("retry-after"))
            seen["exit"] = exited.result(timeout=120)

    try:
        results, _ = run_streams(cluster, "decode-0", stop_gateway)
    finally:
        cluster.ensure()  # the next user finds a gateway
    assert seen == {"refused": (503, "1"), "exit": 0}
    for got, want in zip(results, reference, strict=True):
        assert not got.error and got.text == want.text
