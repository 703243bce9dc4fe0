"""Pick the gateway's `--max-inflight` from a latency SLO, by measurement.

The gateway admits at most K requests at a time (429 beyond), so the nodes never batch more than
K requests (x n choices): an admitted request's E2E is about TTFT(<= K prompts queued) +
max_tokens x ITL(batch K), and both grow with K. This script runs closed loops of K concurrent
clients against a gateway started with a high `--max-inflight` (so that it admits them all) and
reports, per K, throughput and E2E percentiles; the recommended limit is the largest K up to
which every measured K meets the E2E p99 of `--slo-e2e-ms` (it stops at the first miss). Under
overload the gateway then keeps admitted requests at that operating point and answers the rest
429 at once (tests/test_overload.py).

    pd-cluster --gateway-args "--max-inflight 1024" &
    python -m scripts.serving.admission_limit --base-url http://127.0.0.1:PORT --slo-e2e-ms 800

The client is a bare HTTP/1.1 one (a fresh connection per request) so that on a small machine
the load generator costs little CPU beside the cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    concurrency: int
    throughput: float  # requests/s
    p50_s: float
    p99_s: float
    errors: int


async def post(base_url: str, path: str, body: dict[str, object], key: str) -> int:
    host, port = base_url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (path.encode(), host.encode(), auth, len(data), data)
        )
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
    return int(raw.split(b" ", 2)[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


async def closed_loop(args: argparse.Namespace, concurrency: int) -> Point:
    pending = iter(range(args.requests))
    latencies: list[float] = []
    errors = 0

    async def client() -> None:
        nonlocal errors
        for i in pending:
            body = {
                "model": args.model,
                "prompt": f"Request {i}: {args.prompt}",
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            start = time.monotonic()
            status = await post(args.base_url, "/v1/completions", body, args.api_key)
            if status == 200:
                latencies.append(time.monotonic() - start)
            else:
                errors += 1

    start = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.monotonic() - start
    return Point(
        concurrency,
        len(latencies) / elapsed,
        percentile(latencies, 0.5),
        percentile(latencies, 0.99),
        errors,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default="", help="default: the first of /v1/models")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="K values to measure")
    parser.add_argument("--requests", type=int, default=32, help="requests per K")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt", default="write a long story about a dragon and a knight")
    parser.add_argument("--slo-e2e-ms", type=float, required=True)
    return parser


def served_model(base_url: str, key: str) -> str:
    import urllib.request

    request = urllib.request.Request(base_url.rstrip("/") + "/v1/models")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(json.loads(response.read())["data"][0]["id"])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.model = args.model or served_model(args.base_url, args.api_key)
    levels = [int(k) for k in args.concurrency.split(",")]
    slo_s = args.slo_e2e_ms / 1000
    asyncio.run(closed_loop(argparse.Namespace(**{**vars(args), "requests": 2}), 1))  # warm-up
    print(f"{'K':>4} {'req/s':>7} {'E2E p50 ms':>11} {'E2E p99 ms':>11} {'errors':>6}  SLO met")
    best = 0
    for k in levels:
        point = asyncio.run(closed_loop(args, k))
        met = point.p99_s <= slo_s and point.errors == 0
        print(
            f"{k:>4} {point.throughput:>7.2f} {point.p50_s * 1e3:>11.0f} "
            f"{point.p99_s * 1e3:>11.0f} {point.errors:>6}  {'yes' if met else 'no'}"
        )
        if not met:
            break  # a larger K only adds queueing: the first miss bounds the limit
        best = k
    if best == 0:
        print(f"no K meets an E2E p99 of {args.slo_e2e_ms:g} ms: add nodes or relax the SLO")
        return 1
    print(f"recommended: gateway-server --max-inflight {best} (E2E p99 <= {args.slo_e2e_ms:g} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
