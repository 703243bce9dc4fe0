"""Latency the gateway adds: streaming through gateway-server vs gRPC straight to the decode node.

Starts a cluster with `gateway.process.cluster` (bootstrap + one decode node + the gateway; no
prefill node, so the decode node prefills locally on both paths and the only difference is the
gateway) and sends the same greedy request (a fixed token-id prompt, `ignore_eos`, N new tokens)
over both paths:

- direct: `Node.Generate` over gRPC, as the gateway itself calls it;
- gateway: `POST /v1/completions` with `stream: true`, SSE parsed by an httpx client.

Per token (the gateway's hop): both requests are sent at the same time, so the decode node runs
them in the same batch and emits token k of both in the same step; the gap between the two
arrivals at this client is what the gateway adds to that token (its processing plus the HTTP
hop), free of engine jitter. If the two requests joined the batch in different steps, the
arrivals are aligned by that whole number of steps (a step takes far longer than the hop).

Per request: the two paths alternately, one request at a time; the TTFT and end-to-end
differences of each pair (these include the engine's step-to-step jitter).

    .venv/bin/python -m scripts.bench.gateway [--model DIR] [--runs 20] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from gateway.process.cluster import Cluster, ClusterConfig
from proto import node_pb2, node_pb2_grpc


@dataclass
class Run:
    sent: float  # perf_counter() when the request was sent
    times: list[float]  # perf_counter() at the arrival of each token

    @property
    def arrivals(self) -> list[float]:
        """Seconds since the request was sent, one per token."""
        return [t - self.sent for t in self.times]

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.times[-1] - self.sent


async def direct_run(stub: node_pb2_grpc.NodeStub, prompt: list[int], tokens: int) -> Run:
    # logprobs on both paths: the gateway path needs them to map SSE chunks to tokens.
    sampling = node_pb2.SamplingParams(
        max_new_tokens=tokens, temperature=0, ignore_eos=True, logprobs=True
    )
    request = node_pb2.GenerateRequest(input_ids=prompt, sampling=sampling)
    times: list[float] = []
    sent = time.perf_counter()
    async for response in stub.Generate(request):
        if response.HasField("chunk"):
            now = time.perf_counter()
            times.extend(now for _ in response.chunk.token_ids)
    return Run(sent, times)


async def gateway_run(http: httpx.AsyncClient, model: str, prompt: list[int], tokens: int) -> Run:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,  # makes every chunk carry its tokens, so chunks map to tokens
    }
    times: list[float] = []
    sent = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            choice = json.loads(line[6:])["choices"][0]
            count = len((choice.get("logprobs") or {}).get("tokens", []))
            times.extend(now for _ in range(count))
    return Run(sent, times)


def hop_delays(direct: Run, gw: Run, max_shift: int = 4) -> list[float]:
    """Per token: gateway arrival minus direct arrival of the same engine step."""
    best: list[float] = []
    for shift in range(-max_shift, max_shift + 1):
        diffs = [
            gw.times[k] - direct.times[k + shift]
            for k in range(len(gw.times))
            if 0 <= k + shift < len(direct.times)
        ]
        if diffs and (not best or abs(statistics.median(diffs)) < abs(statistics.median(best))):
            best = diffs
    return best


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summary(name: str, values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    row = {"p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99), "mean_ms": statistics.fmean(ms)}
    print(f"{name:<34} p50 {row['p50_ms']:8.3f} ms   p99 {row['p99_ms']:8.3f} ms   n={len(ms)}")
    return row


async def bench(url: str, decode_address: str, model: str, args: argparse.Namespace) -> dict:
    prompt = [(i * 7919) % 20000 + 100 for i in range(args.prompt_tokens)]
    async with (
        grpc.aio.insecure_channel(decode_address) as channel,
        httpx.AsyncClient(base_url=url, timeout=300) as http,
    ):
        stub = node_pb2_grpc.NodeStub(channel)
        for _ in range(args.warmup):
            await direct_run(stub, prompt, args.tokens)
            await gateway_run(http, model, prompt, args.tokens)
        delays: list[float] = []
        for _ in range(args.runs):
            gw_task = asyncio.create_task(gateway_run(http, model, prompt, args.tokens))
            direct_task = asyncio.create_task(direct_run(stub, prompt, args.tokens))
            delays += hop_delays(await direct_task, await gw_task)
        pairs = []
        for i in range(args.runs):
            if i % 2:  # alternate the order so drift hits both paths alike
                gw = await gateway_run(http, model, prompt, args.tokens)
                direct = await direct_run(stub, prompt, args.tokens)
            else:
                direct = await direct_run(stub, prompt, args.tokens)
                gw = await gateway_run(http, model, prompt, args.tokens)
            assert len(gw.arrivals) == len(direct.arrivals) == args.tokens
            pairs.append((direct, gw))
    gaps = []
    for direct, gw in pairs:
        gaps += [
            (gw.arrivals[k] - gw.arrivals[k - 1]) - (direct.arrivals[k] - direct.arrivals[k - 1])
            for k in range(1, args.tokens)
        ]
    direct_itl = [
        r.arrivals[k] - r.arrivals[k - 1] for r, _ in pairs for k in range(1, args.tokens)
    ]
    print(
        f"\n{args.runs} runs per path, {args.prompt_tokens}-token prompt, {args.tokens} tokens each"
    )
    return {
        "per_token_added_delay": summary("per token: gateway hop (same step)", delays),
        "per_token_added_gap": summary("per token: added inter-token gap", gaps),
        "per_request_added_ttft": summary(
            "per request: added TTFT", [g.ttft - d.ttft for d, g in pairs]
        ),
        "per_request_added_e2e": summary(
            "per request: added end-to-end", [g.e2e - d.e2e for d, g in pairs]
        ),
        "direct_itl": summary("(direct inter-token latency)", direct_itl),
        "direct_ttft": summary("(direct TTFT)", [d.ttft for d, _ in pairs]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    config = ClusterConfig(
        prefill=0,
        decode=1,
        backend="mooncake",
        model=args.model,
        port=0,
        max_total_tokens=8192,
        gateway_args=("--local-prefill-max-tokens", "1000000"),
        log_dir=log_dir,
    )
    with open(log_dir / "cluster.out", "w") as out:
        cluster = Cluster(config, out=out)
        try:
            url = cluster.start(threading.Event())
            decode = next(c for c in cluster.children if c.name == "decode-0")
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            print(f"cluster up ({url}, decode node {decode.address}); logs in {log_dir}")
            figures = asyncio.run(bench(url, decode.address, model, args))
        finally:
            cluster.stop()
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
