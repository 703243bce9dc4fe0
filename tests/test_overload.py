"""Overload at 10x capacity against a real cluster (issue 8, item 4).

A `pd-cluster` (1 prefill + 1 decode, tiny random-weight model with the real tokenizer; every
request goes through the prefill node) runs with an admission limit of `MAX_INFLIGHT`
requests. How the limit follows from a latency SLO: the gateway admits at most K requests, so
the decode batch never holds more than K sequences (x n) and a request's E2E is about
TTFT(<= K prompts queued) + max_tokens x ITL(batch K). Measure the E2E p99 at concurrency K;
the SLO the limit is set for is that p99 with headroom (`SLO_HEADROOM`); an operator picks the
largest K whose measured p99 stays within their SLO and passes it as `--max-inflight K`.

1. Capacity: a closed loop of K clients measures throughput C (requests/s) and E2E p99.
2. Overload: an open loop offers Poisson arrivals at 10 x C for a few seconds while the RSS of
   every process is sampled.

Asserted (structural facts only; the timings are printed for the report, never asserted):
every admitted request completes with exactly its max_tokens; every other answer is 429 or 503
with a Retry-After header and OpenAI's error shape; some were rejected; the gateway's in-flight
count returns to 0; neither node keeps a page; no process grows its RSS by more than a generous
bound (no queue grows with the offered load).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from scripts.tiny_models import tiny_chat_model
from tests.hardening import assert_openai_error, cluster_process, rss_bytes
from tests.test_gateway import RunningCluster, node_stub, wait_idle

MAX_INFLIGHT = 4
MAX_TOKENS = 16
OVERLOAD_FACTOR = 10
OVERLOAD_S = 6.0
CAPACITY_REQUESTS = 16
SLO_HEADROOM = 1.5
RSS_GROWTH_BOUND = 256 << 20  # bytes per process: generous; a per-request leak at 10x exceeds it
PROCESSES = ("bootstrap", "prefill-0", "decode-0", "gateway")


@dataclass
class Outcome:
    status: int
    latency_s: float
    retry_after: str | None = None
    completion_tokens: int = 0
    finish_reason: str = ""


@pytest.fixture(scope="module")
def cluster(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningCluster]:
    tmp = tmp_path_factory.mktemp("overload")
    model = tiny_chat_model(default_model_dir, tmp / "model")
    gateway_args = ["--max-inflight", str(MAX_INFLIGHT), "--local-prefill-max-tokens", "0"]
    with cluster_process(tmp / "pd-cluster.log", model, gateway_args=gateway_args) as running:
        yield running


def _body(i: int) -> dict[str, object]:
    return {
        "model": "model",
        "prompt": f"Request {i}: write a long story about a dragon and a knight",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }


async def _post(url: str, body: dict[str, object]) -> tuple[int, dict[str, str], bytes]:
    """POST /v1/completions on a fresh connection: a bare HTTP/1.1 client, so that the load
    generator (on the same 2 cores as the cluster) spends as little CPU per request as it can."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(data), data)
        )
        await writer.drain()
        raw = await reader.read()  # the gateway closes after the answer
    finally:
        writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, payload


async def _send(url: str, i: int) -> Outcome:
    start = time.monotonic()
    status, headers, payload = await _post(url, _body(i))
    outcome = Outcome(status, time.monotonic() - start, headers.get("retry-after"))
    body = json.loads(payload)
    if status == 200:
        outcome.completion_tokens = body["usage"]["completion_tokens"]
        outcome.finish_reason = body["choices"][0]["finish_reason"]
    else:
        assert_openai_error(status, body)
    return outcome


async def _closed_loop(url: str) -> tuple[float, list[Outcome]]:
    """K clients back to back: (requests/s, outcomes)."""
    counter = iter(range(CAPACITY_REQUESTS))
    outcomes: list[Outcome] = []

    async def client() -> None:
        for i in counter:
            outcomes.append(await _send(url, i))

    await _send(url, -1)  # warm-up (first request on fresh channels)
    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(MAX_INFLIGHT)))
    elapsed = time.monotonic() - start
    return len(outcomes) / elapsed, outcomes


async def _open_loop(url: str, rate: float, duration_s: float) -> list[Outcome]:
    rng = random.Random(4)
    tasks = []
    start = time.monotonic()
    next_at = 0.0
    i = 0
    while next_at < duration_s:
        await asyncio.sleep(max(0.0, start + next_at - time.monotonic()))
        tasks.append(asyncio.create_task(_send(url, i)))
        i += 1
        next_at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


class RSSSampler:
    def __init__(self, pids: dict[str, int], interval_s: float = 0.25) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.samples: dict[str, list[int]] = {name: [] for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for name, pid in self.pids.items():
                self.samples[name].append(rss_bytes(pid))

    def __enter__(self) -> RSSSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _rejection_probe(url: str, probes: int = 40) -> list[float]:
    """With the gateway held at its limit by K long requests, time `probes` sequential
    requests on one keep-alive connection: the gateway's own rejection latency, without the
    open loop's client-side queueing."""
    long_body = {**_body(0), "max_tokens": 400}
    latencies: list[float] = []

    async def hold(http: httpx.AsyncClient) -> None:
        response = await http.post(url + "/v1/completions", json=long_body)
        assert response.status_code == 200, response.text

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            holders = [asyncio.create_task(hold(http)) for _ in range(MAX_INFLIGHT)]
            while (await http.get(url + "/health")).json()["inflight"] < MAX_INFLIGHT:
                await asyncio.sleep(0.02)
            async with httpx.AsyncClient(timeout=30) as probe:
                for i in range(probes):
                    if all(h.done() for h in holders):
                        break
                    start = time.monotonic()
                    response = await probe.post(url + "/v1/completions", json=_body(i))
                    latencies.append(time.monotonic() - start)
                    assert response.status_code == 429, response.text
                    assert response.headers["retry-after"].isdigit()
            await asyncio.gather(*holders)

    asyncio.run(run())
    return latencies


def test_overload_10x_capacity(cluster: RunningCluster) -> None:
    url = cluster.url
    capacity, baseline = asyncio.run(_closed_loop(url))
    assert all(o.status == 200 for o in baseline), [o.status for o in baseline]
    base_e2e = [o.latency_s for o in baseline]
    slo_s = SLO_HEADROOM * _pct(base_e2e, 0.99)

    pids = {name: cluster.child_pid(name) for name in PROCESSES}
    before = {name: rss_bytes(pid) for name, pid in pids.items()}
    rate = OVERLOAD_FACTOR * capacity
    with RSSSampler(pids) as sampler:
        outcomes = asyncio.run(_open_loop(url, rate, OVERLOAD_S))
    after = {name: rss_bytes(pid) for name, pid in pids.items()}

    accepted = [o for o in outcomes if o.status == 200]
    rejected = [o for o in outcomes if o.status != 200]
    assert {o.status for o in rejected} <= {429, 503}, sorted({o.status for o in rejected})
    assert all(o.retry_after and o.retry_after.isdigit() for o in rejected)
    assert rejected, "10x the capacity was offered but nothing was rejected"
    assert accepted, "nothing was admitted under overload"
    for o in accepted:
        assert (o.completion_tokens, o.finish_reason) == (MAX_TOKENS, "length")
    health = httpx.get(url + "/health", timeout=10).json()
    assert health["inflight"] == 0, health
    for name in ("prefill-0", "decode-0"):
        check = wait_idle(node_stub(cluster.node_address(name)))
        assert check.ok and check.used_pages == 0, (name, check)
    peak = {name: max(samples or [after[name]]) for name, samples in sampler.samples.items()}
    for name in PROCESSES:
        assert peak[name] - before[name] < RSS_GROWTH_BOUND, (name, before[name], peak[name])

    probe_s = _rejection_probe(url)
    assert probe_s, "the gateway was never held at its limit"
    acc_e2e = [o.latency_s for o in accepted]
    rej_s = [o.latency_s for o in rejected]
    mib = 1 << 20
    print(
        f"\noverload figures: max_inflight={MAX_INFLIGHT} max_tokens={MAX_TOKENS}\n"
        f"  capacity {capacity:.2f} req/s (closed loop of {MAX_INFLIGHT}); E2E p50 "
        f"{_pct(base_e2e, 0.5):.3f} s p99 {_pct(base_e2e, 0.99):.3f} s -> SLO {slo_s:.3f} s\n"
        f"  offered {rate:.1f} req/s for {OVERLOAD_S:.0f} s: {len(outcomes)} sent, "
        f"{len(accepted)} admitted, {len(rejected)} rejected "
        f"({sum(o.status == 429 for o in rejected)} x 429, "
        f"{sum(o.status == 503 for o in rejected)} x 503)\n"
        f"  admitted E2E p50 {_pct(acc_e2e, 0.5):.3f} s p99 {_pct(acc_e2e, 0.99):.3f} s max "
        f"{max(acc_e2e):.3f} s; within SLO: {sum(e <= slo_s for e in acc_e2e)}/{len(acc_e2e)}\n"
        f"  rejection latency p50 {_pct(rej_s, 0.5) * 1e3:.1f} ms p99 "
        f"{_pct(rej_s, 0.99) * 1e3:.1f} ms max {max(rej_s) * 1e3:.1f} ms; "
        f"mean {statistics.fmean(rej_s) * 1e3:.1f} ms (client side, open loop)\n"
        f"  rejection at the limit, {len(probe_s)} sequential probes: p50 "
        f"{_pct(probe_s, 0.5) * 1e3:.1f} ms p99 {_pct(probe_s, 0.99) * 1e3:.1f} ms\n"
        + "\n".join(
            f"  RSS {name}: before {before[name] / mib:.0f} MiB, peak {peak[name] / mib:.0f} MiB,"
            f" after {after[name] / mib:.0f} MiB"
            for name in PROCESSES
        )
    )
