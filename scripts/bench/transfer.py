"""KV transfer and PD handoff benchmarks on loopback (issue: disaggregation).

Part 1, transfer throughput: runs `scripts.bench.transfer_raw` (two processes, real engines), which
moves the default model's KV for a 2,000-token prompt laid out as the engine lays it out
(737,280-byte pages of 16 tokens; also page size 1) beside one descriptor of the same bytes.

Part 2, PD handoff overhead: TTFT through a prefill/decode pair minus TTFT of the decode node
prefilling locally (colocated), for 512- and 2,000-token prompts, p50 over --requests requests
each (one at a time, the two paths alternating request by request, fresh random prompts so
no prefix cache hits), per backend.

    .venv/bin/python -m scripts.bench.transfer                 # both parts, both backends
    .venv/bin/python -m scripts.bench.transfer --skip-raw --requests 20 --backends mooncake
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import torch

from engine.model_fetch import ensure_default_model
from gateway.dispatch.pd_client import pd_generate
from gateway.process.launcher import PDTrio, loopback_transports, pd_trio
from gateway.routing.nodes import NodeTarget
from proto import node_pb2, node_pb2_grpc


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="mooncake,nixl")
    p.add_argument("--lengths", default="512,2000")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--skip-raw", action="store_true")
    p.add_argument("--skip-handoff", action="store_true")
    return p.parse_args()


async def _ttfts(cluster: PDTrio, prompts: list[list[int]]) -> tuple[list[float], list[float]]:
    """TTFTs (colocated, PD), alternating the two paths request by request so that load from
    elsewhere on the machine falls on both alike."""
    sampling = node_pb2.SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    async with (
        grpc.aio.insecure_channel(cluster.decode.address) as d_chan,
        grpc.aio.insecure_channel(cluster.prefill.address) as p_chan,
    ):
        decode = NodeTarget(cluster.decode_id, node_pb2_grpc.NodeStub(d_chan))
        prefill = NodeTarget(cluster.prefill_id, node_pb2_grpc.NodeStub(p_chan))
        out: tuple[list[float], list[float]] = ([], [])
        for i, prompt in enumerate(prompts):
            pd = i % 2 == 1
            result = await pd_generate(decode, prefill if pd else None, prompt, sampling)
            if result.finished is None or result.finished.finish_reason != "length":
                raise SystemExit(f"request failed: {result.finished} {result.prefill_error}")
            out[pd].append(result.ttft_s)
        return out


def _prompts(gen: torch.Generator, length: int, count: int) -> list[list[int]]:
    return [torch.randint(100, 20000, (length,), generator=gen).tolist() for _ in range(count)]


def handoff(backend: str, lengths: list[int], requests: int, chunk: int) -> list[str]:
    model = ensure_default_model()
    gen = torch.Generator().manual_seed(0)
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        pd_trio(
            Path(tmp),
            model,
            backend,
            node_args=["--max-total-tokens", "32768", "--chunked-prefill-size", str(chunk)],
        ) as cluster,
    ):
        for n in lengths:
            print(
                f"[{backend}] {n}-token prompts: colocated and PD alternating ({requests} each)",
                flush=True,
            )
            asyncio.run(_ttfts(cluster, _prompts(gen, n, 2)))  # warm up both paths
            colo_s, pd_s = asyncio.run(_ttfts(cluster, _prompts(gen, n, 2 * requests)))
            colo, pd = statistics.median(colo_s), statistics.median(pd_s)
            over = pd - colo
            rows.append(
                f"| {backend} | {n} | {colo * 1e3:.0f} | {pd * 1e3:.0f} | {over * 1e3:+.0f} | "
                f"{over / colo * 100:+.1f}% |"
            )
            print(rows[-1], flush=True)
        cluster.check_no_leaks()
    return rows


def main() -> None:
    args = parse_args()
    loopback_transports()
    if not args.skip_raw:
        raw = ["-m", "scripts.bench.transfer_raw", "--backends", args.backends]
        subprocess.run([sys.executable, *raw], check=True)
    if args.skip_handoff:
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for backend in args.backends.split(","):
        rows += handoff(backend, lengths, args.requests, args.chunked_prefill_size)
    print(
        "\n| backend | prompt tokens | TTFT colocated p50 (ms) | TTFT PD p50 (ms) | overhead | % |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
