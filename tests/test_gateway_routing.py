"""Gateway routing on a real 2P2D `pd-cluster` (tiny random-weight llama with the default model's
tokenizer, Mooncake over loopback).

- round_robin on both sides: sequential requests reach all four nodes;
- prefix_aware (a second gateway on the same bootstrap): prompts sharing a prefix all go to one
  prefill node, and its prefix-cache hits show in the responses' cached-token counts;
- a decode node started later joins the routing at once, and leaves it when it stops;
- SIGKILL of an idle prefill node: every later request succeeds (a failed first attempt is
  retried on the other prefill node) and the bootstrap's LEFT event removes the dead node.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from openai.types import Completion

from engine.ports import free_port
from gateway.process.launcher import console_script, node_registered, running_node
from scripts.tiny_models import save_tiny_text_model
from tests.test_gateway import RunningCluster, pd_cluster_process

GATEWAY_ARGS = ["--local-prefill-max-tokens", "0", "--decode-policy", "round_robin"]
SHARED_PREFIX = 96  # tokens: six 16-token pages
LOCAL_PREFILL_MAX = 32  # the prefix gateway lets the decode node prefill prompts this short


@pytest.fixture(scope="module")
def cluster(
    tiny_text_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningCluster]:
    log = tmp_path_factory.mktemp("gateway-2p2d") / "pd-cluster.log"
    args = [*GATEWAY_ARGS, "--prefill-policy", "round_robin"]
    with pd_cluster_process(
        log, tiny_text_model, "mooncake", prefill=2, decode=2, gateway_args=args
    ) as c:
        yield c


@pytest.fixture(scope="module")
def prefix_gateway(
    cluster: RunningCluster, tiny_text_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningCluster]:
    """A second gateway-server on the same bootstrap, routing prefills by prefix."""
    port = free_port()
    command = [console_script("gateway-server"), "--bootstrap", cluster.node_address("bootstrap")]
    command += ["--model", str(tiny_text_model), "--port", str(port), *GATEWAY_ARGS]
    command += ["--prefill-policy", "prefix_aware", "--prefix-block-tokens", "16"]
    command += ["--local-prefill-max-tokens", str(LOCAL_PREFILL_MAX)]
    log = tmp_path_factory.mktemp("gateway-prefix") / "gateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    gateway = RunningCluster(process, f"http://127.0.0.1:{port}", log)
    try:
        while _prefill_count(gateway.url) != 2:
            assert process.poll() is None, log.read_text()
            time.sleep(0.2)
        yield gateway
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def _prefill_count(url: str) -> int | None:
    try:
        return int(httpx.get(url + "/health", timeout=5).json()["prefill"])
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def per_node(gateway: RunningCluster, metric: str, role: str) -> dict[str, float]:
    text = httpx.get(gateway.url + "/metrics").text
    pattern = re.compile(rf'^{metric}\{{node_id="([^"]+)",role="{role}"\}} (\S+)$', re.M)
    return {node: float(value) for node, value in pattern.findall(text)}


def _complete(client: openai.OpenAI, model: str, prompt: list[int]) -> openai.types.Completion:
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )


def _prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (length,), generator=gen).tolist()


def test_round_robin_reaches_all_four_nodes(cluster: RunningCluster, tiny_text_model: Path) -> None:
    client = _client(cluster.url)
    for i in range(8):
        out = _complete(client, tiny_text_model.name, _prompt(i, 40))
        assert out.choices[0].finish_reason == "length"
    requests = "pdserve_gateway_node_requests_total"
    prefill = per_node(cluster, requests, "prefill")
    decode = per_node(cluster, requests, "decode")
    assert len(prefill) == 2 and all(n >= 2 for n in prefill.values()), prefill
    assert len(decode) == 2 and all(n >= 2 for n in decode.values()), decode


def test_prefix_aware_keeps_a_shared_prefix_on_one_prefill_node(
    prefix_gateway: RunningCluster, tiny_text_model: Path
) -> None:
    client = _client(prefix_gateway.url)
    prefix = _prompt(100, SHARED_PREFIX)
    requests = "pdserve_gateway_node_requests_total"
    before = per_node(prefix_gateway, requests, "prefill")
    cached = []
    for i in range(4):
        out = _complete(client, tiny_text_model.name, prefix + _prompt(200 + i, 8))
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    after = per_node(prefix_gateway, requests, "prefill")
    deltas = {node: after[node] - before.get(node, 0) for node in after}
    assert [d for d in deltas.values() if d] == [4], deltas  # one prefill node took them all
    # The first request filled that node's radix cache; the others reuse the shared pages.
    assert all(c >= SHARED_PREFIX - 16 for c in cached[1:]), cached
    hits = per_node(prefix_gateway, "pdserve_gateway_node_cached_tokens_total", "prefill")
    assert sum(hits.values()) >= 3 * (SHARED_PREFIX - 16)


def test_short_prompts_are_prefilled_by_the_decode_node(
    prefix_gateway: RunningCluster, tiny_text_model: Path
) -> None:
    requests = "pdserve_gateway_node_requests_total"
    before = per_node(prefix_gateway, requests, "prefill")
    local = prefix_gateway.metric("pdserve_gateway_local_prefills_total")
    for i in range(3):
        out = _complete(_client(prefix_gateway.url), tiny_text_model.name, _prompt(500 + i, 20))
        assert out.choices[0].finish_reason == "length"
    assert per_node(prefix_gateway, requests, "prefill") == before
    assert prefix_gateway.metric("pdserve_gateway_local_prefills_total") == local + 3


def test_a_decode_node_joining_gets_traffic_without_restart(
    cluster: RunningCluster, tiny_text_model: Path, tmp_path: Path
) -> None:
    client = _client(cluster.url)
    requests = "pdserve_gateway_node_requests_total"
    bootstrap = cluster.node_address("bootstrap")
    args = ["--mode", "disaggregated", "--model", str(tiny_text_model), "--bootstrap", bootstrap]
    args += ["--transfer-backend", "mooncake", "--max-total-tokens", "8192"]
    with running_node(
        "decode-server", args, tmp_path / "decode-new.log", probe=node_registered
    ) as new:
        while httpx.get(cluster.url + "/health").json()["decode"] != 3:
            time.sleep(0.1)
        before = per_node(cluster, requests, "decode")
        for i in range(6):
            _complete(client, tiny_text_model.name, _prompt(700 + i, 40))
        after = per_node(cluster, requests, "decode")
        assert len(after) == 3 and all(after[n] > before.get(n, 0) for n in after), after
        new.process.send_signal(signal.SIGTERM)  # it deregisters: LEFT
        while httpx.get(cluster.url + "/health").json()["decode"] != 2:
            time.sleep(0.1)
    out = _complete(client, tiny_text_model.name, _prompt(800, 40))
    assert out.choices[0].finish_reason == "length"


def test_sigkill_of_an_idle_prefill_node_moves_traffic(
    cluster: RunningCluster, tiny_text_model: Path
) -> None:
    client = _client(cluster.url)
    requests = "pdserve_gateway_node_requests_total"
    victim_pid = cluster.child_pid("prefill-0")
    before = per_node(cluster, requests, "prefill")
    os.kill(victim_pid, signal.SIGKILL)
    for i in range(6):
        out = _complete(client, tiny_text_model.name, _prompt(300 + i, 40))  # raises on any error
        assert out.choices[0].finish_reason == "length"
    after = per_node(cluster, requests, "prefill")
    served = {node: after[node] - before.get(node, 0) for node in after}
    # Every request ended on the survivor; the victim got at most the attempts that failed.
    assert max(served.values()) == 6, served
    # The bootstrap declares the node dead; its LEFT event takes it out of the gateway's table.
    while _prefill_count(cluster.url) != 1:
        time.sleep(0.2)
    out = _complete(client, tiny_text_model.name, _prompt(400, 40))
    assert out.choices[0].finish_reason == "length"

    # No prefill node left at all: the decode nodes prefill locally, still without an error.
    local = cluster.metric("pdserve_gateway_local_prefills_total")
    os.kill(cluster.child_pid("prefill-1"), signal.SIGKILL)
    for i in range(3):
        out = _complete(client, tiny_text_model.name, _prompt(600 + i, 40))
        assert out.choices[0].finish_reason == "length"
    assert cluster.metric("pdserve_gateway_local_prefills_total") == local + 3


def test_a_request_waits_for_the_first_decode_node_with_room(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """Two decode nodes with a cap of one request each, both streaming, and a third request.
    Round robin would send it to the first node, behind that node's stream; the gateway holds
    it (gateway/dispatch/decode_line.py) and sends it to the second node once the client of the
    second stream goes away, so it finishes while the first stream still runs. The streams are
    endless for a test (4,000 tokens of a model of 4,096 positions) and end when the test drops
    them: no race between a stream's end and the third request's arrival (one that ended on
    the node while its client still read its last tokens let the third through unheld)."""
    model = save_tiny_text_model(default_model_dir, tmp_path / "model", positions=4096)
    args = [*GATEWAY_ARGS, "--prefill-policy", "round_robin", "--decode-hold", "30"]
    log = tmp_path / "pd-cluster.log"
    with pd_cluster_process(
        log, model, "mooncake", decode=2, gateway_args=args,
        node_args=["--max-running-requests", "1"],
    ) as cluster, ThreadPoolExecutor(3) as pool:  # fmt: skip
        client = _client(cluster.url)
        requests = "pdserve_gateway_node_requests_total"

        def routed(before: dict[str, float]) -> str:
            """The decode node the next request went to."""
            while (after := per_node(cluster, requests, "decode")) == before:
                time.sleep(0.01)
            (node,) = [n for n in after if after[n] != before.get(n, 0)]
            return node

        def read(chunks: openai.Stream[Completion], drop: threading.Event) -> str | None:
            """The stream's finish reason; "dropped" if `drop` was set before it ended."""
            reason = None
            for chunk in chunks:
                reason = chunk.choices[0].finish_reason
                if drop.is_set() and reason is None:
                    chunks.close()
                    return "dropped"
            return reason

        def stream(seed: int) -> tuple[Future[str | None], str, threading.Event]:
            """An endless streaming request once its first token came (it holds its node's
            slot), the decode node it went to and the event that drops it; the future gives
            its finish reason."""
            before = per_node(cluster, requests, "decode")
            chunks = client.completions.create(
                model=model.name, prompt=_prompt(seed, 40), max_tokens=4000,
                temperature=0, stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            next(iter(chunks))
            drop = threading.Event()
            return pool.submit(read, chunks, drop), routed(before), drop

        first, first_node, drop_first = stream(1)
        second, second_node, drop_second = stream(2)
        assert first_node != second_node
        before = per_node(cluster, requests, "decode")
        third = pool.submit(_complete, client, model.name, _prompt(3, 40))
        deadline = time.monotonic() + 30
        while cluster.metric("pdserve_gateway_decode_held") != 1:  # both nodes are at their cap
            assert time.monotonic() < deadline and not third.done(), "the third was not held"
            time.sleep(0.02)
        assert per_node(cluster, requests, "decode") == before  # not sent anywhere yet
        drop_second.set()
        assert second.result(30) == "dropped"
        third_node = routed(before)  # released when the second node's slot came free
        assert third_node == second_node  # not round robin's pick: behind the first stream
        assert third.result(60).choices[0].finish_reason == "length"
        assert cluster.metric("pdserve_gateway_decode_hold_seconds_count") == 1
        assert cluster.metric("pdserve_gateway_decode_hold_expired_total") == 0
        drop_first.set()
        assert first.result(30) == "dropped"  # still streaming after the third request
