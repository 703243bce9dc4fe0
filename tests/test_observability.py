"""Observability of a real 1P1D `pd-cluster` (tiny random-weight llama with the default model's
tokenizer, Mooncake over loopback, every prompt through the prefill node).

- every process serves /metrics (the bootstrap and the nodes on the `--metrics-port` pd-cluster
  gives them and prints; the gateway on its API port); after N requests, scraped with
  prometheus_client's text parser, the counters moved by exactly the right amounts on all four;
- the timing breakdown (native `meta_info.timing`, OpenAI `Server-Timing` header) adds up to
  the E2E the client measured, within a few ms, and its parts are consistent;
- every log line of every process has the one format, and one request's room appears in the
  lines of the gateway, the bootstrap and both nodes;
- a prefill node whose KV writes all fail (`--inject-transfer-failures 1.0`), joined to the same
  bootstrap: one request through it moves its failure counter by exactly 1, and the bootstrap's
  and the decode node's failed-room counters by 1. (Last: it changes the routing.)
"""

from __future__ import annotations

import asyncio
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.ports import free_port
from gateway.dispatch.pd_client import PDResult, pd_generate
from gateway.dispatch.timeline import SEGMENTS
from gateway.process.launcher import node_registered, running_node
from gateway.requests.text import TextCodec
from gateway.routing.nodes import NodeTarget
from proto import node_pb2, node_pb2_grpc
from tests.test_gateway import RunningCluster, pd_cluster_process

N = 4  # requests of the counting test
MAX_TOKENS = 5
PAGE_SIZE = 16  # the nodes' default
CHUNK = 16  # prefill chunk: every prompt takes several
TIMING_TOLERANCE_S = 0.010  # client-measured E2E minus the breakdown's sum (HTTP in and out)
TRANSFER_SKEW_S = 0.010  # D may get its call this much after P
WORDS = ["apple", "river", "mountain", "violin", "copper", "lantern", "meadow", "harbor"]
PROCESSES = ("gateway", "bootstrap", "prefill-0", "decode-0")
LOG_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ "
    r"room=(-|\d+) "
)
PYTHON_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d[ T]|(DEBUG|INFO|WARNING|ERROR|CRITICAL):\S)")


# -- scraping ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scrape:
    samples: list[tuple[str, dict[str, str], float]]

    def get(self, name: str, **labels: str) -> float:
        """Sum of the samples named `name` whose labels include `labels` (0 if none)."""
        return sum(
            value
            for sample, sample_labels, value in self.samples
            if sample == name and all(sample_labels.get(k) == v for k, v in labels.items())
        )


def scrape(url: str) -> Scrape:
    response = httpx.get(url, timeout=10)
    response.raise_for_status()
    samples = [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    ]
    return Scrape(samples)


@dataclass
class Cluster:
    running: RunningCluster
    metrics: dict[str, str]  # process name -> its /metrics URL
    model: str  # the served model name

    @property
    def url(self) -> str:
        return self.running.url

    def scrape_all(self) -> dict[str, Scrape]:
        return {name: scrape(url) for name, url in self.metrics.items()}

    def log_lines(self, name: str) -> list[str]:
        prefix = f"[{name}] "
        return [
            line[len(prefix) :]
            for line in self.running.log().splitlines()
            if line.startswith(prefix)
        ]


def eventually(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll until `check()` (only against hangs: nothing here asserts how fast)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_text_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log = tmp_path_factory.mktemp("observability") / "pd-cluster.log"
    gateway_args = ["--local-prefill-max-tokens", "0", "--log-level", "debug"]
    node_args = ["--log-level", "debug", "--chunked-prefill-size", str(CHUNK)]
    with pd_cluster_process(
        log, tiny_text_model, "mooncake", gateway_args=gateway_args, node_args=node_args
    ) as running:
        eventually(lambda: "[pd-cluster] metrics gateway" in running.log(), "metrics lines")
        urls = dict(re.findall(r"^\[pd-cluster\] metrics (\S+) (\S+)$", running.log(), re.M))
        assert set(urls) == set(PROCESSES), urls
        yield Cluster(running, urls, tiny_text_model.name)


def _prompt(i: int) -> str:
    """Distinct from the first word on: no prefix-cache hit on either node."""
    words = [WORDS[(i + k) % len(WORDS)] for k in range(30)]
    return f"{WORDS[i % len(WORDS)].upper()} {i}: " + " ".join(words)


def _complete(cluster: Cluster, prompt: str, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    body = {
        "model": cluster.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


# -- tests ------------------------------------------------------------------------------------


def _one_token_tail(codec: TextCodec, prompt: str) -> str:
    """The prompt, lengthened until its last prefill chunk is a single token."""
    while len(codec.encode_prompt(prompt)) % CHUNK != 1:
        prompt += " x"
    return prompt


def test_counters_move_by_exactly_n_requests(cluster: Cluster, tiny_text_model: Path) -> None:
    codec = TextCodec.load(str(tiny_text_model))
    prompts = [_prompt(i) for i in range(N)]
    prompts[0] = _one_token_tail(codec, prompts[0])  # a 1-token chunk is still prefill
    before = cluster.scrape_all()
    prompt_tokens = []
    for prompt in prompts:
        out = _complete(cluster, prompt).json()
        assert out["usage"]["completion_tokens"] == MAX_TOKENS
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        prompt_tokens.append(out["usage"]["prompt_tokens"])
    after = cluster.scrape_all()
    assert prompt_tokens[0] % CHUNK == 1, prompt_tokens

    def delta(process: str, name: str, **labels: str) -> float:
        return after[process].get(name, **labels) - before[process].get(name, **labels)

    # gateway
    assert delta("gateway", "pdserve_gateway_requests_total", endpoint="completions") == N
    assert delta("gateway", "pdserve_gateway_requests_total", status="200") == N
    assert delta("gateway", "pdserve_gateway_e2e_seconds_count") == N
    assert delta("gateway", "pdserve_gateway_time_to_first_token_seconds_count") == N
    itl = "pdserve_gateway_inter_token_latency_seconds_count"
    assert delta("gateway", itl) == N * (MAX_TOKENS - 1)  # one chunk per token
    assert delta("gateway", "pdserve_gateway_node_requests_total", role="prefill") == N
    assert delta("gateway", "pdserve_gateway_node_requests_total", role="decode") == N
    assert delta("gateway", "pdserve_gateway_completion_tokens_total") == N * MAX_TOKENS
    # counted at admission (pd-planner's offered load) and, for the budgets, at the end too
    assert delta("gateway", "pdserve_gateway_admitted_choices_total") == N
    admitted_prompt = delta("gateway", "pdserve_gateway_admitted_prompt_tokens_total")
    assert admitted_prompt == sum(prompt_tokens)
    assert delta("gateway", "pdserve_gateway_admitted_max_tokens_total") == N * MAX_TOKENS
    assert delta("gateway", "pdserve_gateway_finished_max_tokens_total") == N * MAX_TOKENS
    assert delta("gateway", "pdserve_gateway_retries_total") == 0
    assert delta("gateway", "pdserve_gateway_local_prefills_total") == 0
    assert after["gateway"].get("pdserve_gateway_inflight") == 0
    # prefill node: one room and one transfer per request; every prompt token computed
    assert after["prefill-0"].get("pdserve_node_info", role="prefill") == 1
    assert delta("prefill-0", "pdserve_node_requests_finished_total", reason="prefilled") == N
    chunks = sum(math.ceil(p / CHUNK) for p in prompt_tokens)
    assert delta("prefill-0", "pdserve_node_prefill_chunks_total") == chunks
    assert delta("prefill-0", "pdserve_node_prefill_tokens_total") == sum(prompt_tokens)
    assert delta("prefill-0", "pdserve_node_cache_hit_tokens_total") == 0
    assert delta("prefill-0", "pdserve_node_decode_tokens_total") == 0
    assert delta("prefill-0", "pdserve_prefill_bootstrap_wait_seconds_count") == N
    assert delta("prefill-0", "pdserve_prefill_transfer_seconds_count") == N
    assert delta("prefill-0", "pdserve_prefill_rooms_total", outcome="done") == N
    assert delta("prefill-0", "pdserve_prefill_rooms_total", outcome="failed") == 0
    pages = sum(math.ceil(p / PAGE_SIZE) for p in prompt_tokens)
    assert delta("prefill-0", "pdserve_prefill_transfer_pages_total") == pages
    assert delta("prefill-0", "pdserve_prefill_transfer_bytes_total") > 0
    assert delta("prefill-0", "pdserve_prefill_transfer_failures_total") == 0
    # decode node: the first token comes from P, the other MAX_TOKENS - 1 are decoded here
    assert after["decode-0"].get("pdserve_node_info", role="decode") == 1
    assert delta("decode-0", "pdserve_node_requests_finished_total", reason="length") == N
    assert delta("decode-0", "pdserve_node_decode_tokens_total") == N * (MAX_TOKENS - 1)
    assert delta("decode-0", "pdserve_node_prefill_tokens_total") == 0
    assert delta("decode-0", "pdserve_decode_prealloc_wait_seconds_count") == N
    assert delta("decode-0", "pdserve_decode_transfer_wait_seconds_count") == N
    assert delta("decode-0", "pdserve_decode_rooms_total", outcome="done") == N
    assert delta("decode-0", "pdserve_decode_transfer_failures_total") == 0
    assert delta("decode-0", "pdserve_node_retractions_total") == 0
    # bootstrap: N rooms opened, rendezvoused, closed DONE; none left open
    assert delta("bootstrap", "pdserve_bootstrap_rooms_opened_total") == N
    assert delta("bootstrap", "pdserve_bootstrap_rendezvous_seconds_count") == N
    assert delta("bootstrap", "pdserve_bootstrap_rooms_closed_total", state="DONE") == N
    assert delta("bootstrap", "pdserve_bootstrap_rooms_closed_total", state="FAILED") == 0
    assert after["bootstrap"].get("pdserve_bootstrap_rooms_open") == 0
    assert after["bootstrap"].get("pdserve_bootstrap_live_nodes", role="prefill") == 1
    assert after["bootstrap"].get("pdserve_bootstrap_live_nodes", role="decode") == 1
    eventually(
        lambda: scrape(cluster.metrics["bootstrap"]).get("pdserve_bootstrap_heartbeats_total") > 0,
        "the bootstrap counts heartbeats",
    )

    def idle() -> bool:
        now = cluster.scrape_all()
        gauges = [
            now["prefill-0"].get("pdserve_prefill_bootstrap_queue"),
            now["prefill-0"].get("pdserve_prefill_active_requests"),
            now["prefill-0"].get("pdserve_prefill_inflight_requests"),
            now["decode-0"].get("pdserve_decode_prealloc_queue"),
            now["decode-0"].get("pdserve_decode_transfer_queue"),
            now["decode-0"].get("pdserve_node_running_requests"),
        ]
        return not any(gauges)

    eventually(idle, "the PD queue gauges read 0 once the requests are done")


def _check_breakdown(timing: dict[str, float], client_e2e: float) -> float:
    """Checks one request's breakdown; returns the client's E2E minus the breakdown's sum."""
    total = sum(timing[s] for s in SEGMENTS)
    assert abs(total - timing["e2e"]) < 1e-4, timing
    assert timing["e2e"] <= client_e2e, (timing, client_e2e)
    for name in SEGMENTS:
        if name != "transfer":  # a difference of two nodes' spans, see below
            assert timing[name] >= 0, (name, timing)
    for measured in ("gateway_queue", "prefill", "decode_first", "decode", "transfer_kv"):
        assert timing[measured] > 0, (measured, timing)
    return client_e2e - total


def test_timing_breakdown_adds_up_to_the_measured_e2e(cluster: Cluster) -> None:
    """A gap in the breakdown shows in every request, a stall of this busy machine in one:
    the median request must add up within a few ms."""
    # One client, connected before the clock starts: E2E is the request, not the TLS context
    # httpx builds per client or the TCP handshake.
    client = httpx.Client(base_url=cluster.url, timeout=120)
    client.get("/health")
    gaps, kv_slack = [], []
    for i in range(5):
        body = {
            "text": _prompt(100 + i),
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True},
        }
        t0 = time.perf_counter()
        response = client.post("/generate", json=body)
        client_e2e = time.perf_counter() - t0
        assert response.status_code == 200, response.text
        timing = response.json()["meta_info"]["timing"]
        gaps.append(_check_breakdown(timing, client_e2e))
        kv_slack.append(timing["transfer"] - timing["transfer_kv"])
    assert statistics.median(gaps) < TIMING_TOLERANCE_S, gaps
    # The KV writes happen inside D's wait that `transfer` is the rest of; it is only off by
    # how much later D got the request than P (both calls leave the gateway together).
    assert statistics.median(kv_slack) > -TRANSFER_SKEW_S, kv_slack

    body = {"model": cluster.model, "prompt": _prompt(200), "max_tokens": MAX_TOKENS}
    t0 = time.perf_counter()
    response = client.post("/v1/completions", json={**body, "ignore_eos": True})
    client_e2e = time.perf_counter() - t0
    assert response.status_code == 200, response.text
    header = response.headers["server-timing"]
    timing = {n: float(ms) / 1000 for n, ms in re.findall(r"(\w+);dur=(-?[0-9.]+)", header)}
    assert set(timing) == {*SEGMENTS, "e2e", "transfer_kv"}, header
    _check_breakdown(timing, client_e2e + 1e-3)  # the header rounds to the microsecond

    # Streamed: the same value in an SSE comment just before `data: [DONE]`.
    t0 = time.perf_counter()
    response = client.post(
        "/v1/completions", json={**body, "prompt": _prompt(201), "stream": True, "ignore_eos": True}
    )
    client_e2e = time.perf_counter() - t0
    assert response.status_code == 200, response.text
    frames = response.text.strip().split("\n\n")
    assert frames[-1] == "data: [DONE]" and frames[-2].startswith(": Server-Timing: "), frames[-3:]
    timing = {n: float(ms) / 1000 for n, ms in re.findall(r"(\w+);dur=(-?[0-9.]+)", frames[-2])}
    assert set(timing) == {*SEGMENTS, "e2e", "transfer_kv"}, frames[-2]
    _check_breakdown(timing, client_e2e + 1e-3)


def test_every_process_logs_one_format_with_the_room(cluster: Cluster) -> None:
    body = {"text": _prompt(300), "sampling_params": {"max_new_tokens": 2}}
    response = httpx.post(cluster.url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    rid = response.json()["meta_info"]["id"]
    room = ""

    def room_in_gateway_log() -> bool:
        nonlocal room
        for line in cluster.log_lines("gateway"):
            if f"request {rid}-0 " in line and "finished" in line:
                room = LOG_LINE.match(line).group(2)  # type: ignore[union-attr]
                return True
        return False

    eventually(room_in_gateway_log, "the gateway's line about the request")
    assert room.isdigit(), room
    for name in PROCESSES:
        eventually(
            lambda name=name: any(f" room={room} " in line for line in cluster.log_lines(name)),
            f"{name} logs a line with room={room}",
        )
        for line in cluster.log_lines(name):
            # Python's formats (ours, an old one, the default `LEVEL:name:msg`) must all be
            # ours; C libraries (Mooncake's glog) write their own lines to the same stderr.
            if PYTHON_LOG_LINE.match(line):
                assert LOG_LINE.match(line), f"{name}: {line!r}"


def test_injected_transfer_failure_counts_once(
    cluster: Cluster, tiny_text_model: Path, tmp_path: Path
) -> None:
    bootstrap = cluster.running.node_address("bootstrap")
    decode_address = cluster.running.node_address("decode-0")
    metrics_port = free_port()
    args = ["--model", str(tiny_text_model), "--bootstrap", bootstrap, "--transfer-backend"]
    args += ["mooncake", "--max-total-tokens", "8192", "--inject-transfer-failures", "1.0"]
    args += ["--metrics-port", str(metrics_port)]
    with running_node(
        "prefill-server", args, tmp_path / "prefill-failing.log", probe=node_registered
    ) as failing:
        failing_url = f"http://127.0.0.1:{metrics_port}/metrics"
        before = {**cluster.scrape_all(), "failing": scrape(failing_url)}
        prefill_id = failing.stub.Health(node_pb2.HealthRequest(), timeout=5).node_id
        result = _generate_through(decode_address, failing.address, prefill_id)
        assert result.prefill_error, "every KV write was to fail"
        assert "KV write" in result.prefill_error, result.prefill_error

        def now(process: str, name: str, **labels: str) -> float:
            url = failing_url if process == "failing" else cluster.metrics[process]
            return scrape(url).get(name, **labels) - before[process].get(name, **labels)

        failures = "pdserve_prefill_transfer_failures_total"
        assert now("failing", failures, reason="write_failed") == 1
        assert now("failing", failures) == 1
        assert now("failing", "pdserve_prefill_rooms_total", outcome="failed") == 1
        assert now("failing", "pdserve_node_requests_finished_total", reason="abort") == 1
        closed = "pdserve_bootstrap_rooms_closed_total"
        eventually(
            lambda: now("bootstrap", closed, state="FAILED") == 1, "bootstrap closes it FAILED"
        )
        rooms = "pdserve_decode_rooms_total"
        eventually(lambda: now("decode-0", rooms, outcome="failed") == 1, "D counts it failed")
        assert now("bootstrap", "pdserve_bootstrap_rooms_opened_total") == 1
        assert now("bootstrap", closed, state="DONE") == 0
        assert now("decode-0", "pdserve_decode_transfer_failures_total") == 1
        assert now("decode-0", rooms, outcome="done") == 0
        assert now("prefill-0", failures) == 0


def _generate_through(decode_address: str, prefill_address: str, prefill_id: str) -> PDResult:
    async def run() -> PDResult:
        async with (
            grpc.aio.insecure_channel(decode_address) as d_chan,
            grpc.aio.insecure_channel(prefill_address) as p_chan,
        ):
            d_stub = node_pb2_grpc.NodeStub(d_chan)
            health = await d_stub.Health(node_pb2.HealthRequest(), timeout=5)
            decode = NodeTarget(health.node_id, d_stub)
            prefill = NodeTarget(prefill_id, node_pb2_grpc.NodeStub(p_chan))
            sampling = node_pb2.SamplingParams(max_new_tokens=4)
            return await pd_generate(decode, prefill, list(range(3, 43)), sampling)

    return asyncio.run(run())
