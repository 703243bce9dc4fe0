"""Where a decode step's GPU time goes, by component, against each component's HBM floor.

    python3 -m scripts.gpu.decode_accounting [--batches 16,64,256] [--context 1024] [--out table.md]

Issue 26 item 1 asks for decode at >= 85% of the HBM roofline and a per-component table. For a
Llama-3-8B-shaped model (dummy bf16 weights, Triton attention, page size 16) and each batch size
B at context `--context`, this times:
- the HBM copy bandwidth (2 GiB read + written), which sets every floor below;
- the CUDA graph's replay alone (the GPU's part of a step, no host work);
- each kernel of one eager decode step under torch.profiler (the graph runs the same kernels),
  summed by component: the GEMMs (every weight read once: floor = weight bytes / bandwidth),
  attention (the batch's K/V read once: floor = KV bytes / bandwidth), the KV store, the
  elementwise kernels (norms, rotary, SiLU-and-mul, residual adds, embedding, argmax: no floor
  worth naming, their bytes are the batch's activations), and everything else;
- the gap: replay minus the sum of kernel times, i.e. the graph's launch gaps between kernels.

The table says how far each component is from its own floor and how much of the step it holds,
so the next change goes where the milliseconds are. The engine's whole step (scheduler, batch
building, sampling, overlap) is `engine_step.py`'s; this script is the GPU side.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine.cuda_graph import DecodeGraphRunner
from scripts.gpu.run_all import (
    LLAMA3_8B,
    TritonBackend,
    build_dummy_model,
    copy_ms,
    cuda_time_ms,
    kv_layout,
    paged_setup,
    step_fn,
    weight_bytes,
)

PROFILED_STEPS = 5
# Kernel name -> component; the first pattern that matches wins (names of cuBLAS/CUTLASS GEMMs
# vary by GPU and version, so they are matched loosely and listed in the raw table).
COMPONENTS = (
    ("attention", re.compile(r"_decode_split_kernel|_decode_merge_kernel|flash|attn", re.I)),
    ("kv store", re.compile(r"_store_kv_kernel")),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|sm90_|sm80_|matmul|splitK", re.I)),
    (
        "elementwise",
        re.compile(
            r"rms|rotary|silu|elementwise|vectorized|reduce|argmax|index|"
            r"embedding|cat|copy|fill",
            re.I,
        ),
    ),
)


def component(kernel: str) -> str:
    for name, pattern in COMPONENTS:
        if pattern.search(kernel):
            return name
    return "other"


@dataclass
class KernelTime:
    name: str
    ms: float  # per step
    count: int  # launches per step


def profile_kernels(step) -> list[KernelTime]:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    return [
        KernelTime(e.key, e.device_time_total / PROFILED_STEPS / 1e3, e.count // PROFILED_STEPS)
        for e in kernels
    ]


def account(model, copy_bw: float, batch: int, context: int) -> tuple[list[str], list[str]]:
    """The component rows for one batch size, and the raw kernel rows."""
    c = LLAMA3_8B
    kv_token_bytes = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
    setup = paged_setup(kv_layout(), [context - 1] * batch, [1] * batch, slack_pages=1)
    ids = torch.randint(0, c.vocab_size, (batch,), device="cuda")
    backend = TritonBackend(setup.cache, setup.pool)
    gemm_floor = weight_bytes(model, batch) / copy_bw * 1e3
    attn_floor = batch * context * kv_token_bytes / copy_bw * 1e3
    floor = gemm_floor + attn_floor

    kernels = profile_kernels(step_fn(model, backend, setup.pool, ids, batch, context))
    graphs = DecodeGraphRunner(model, c.max_position_embeddings, pad_slot=0, buckets=(batch,))
    step = step_fn(model, backend, setup.pool, ids, batch, context, graphs)
    step()  # capture
    replay_ms = cuda_time_ms(graphs.graphs[batch].graph.replay, warmup=3, repeats=20)
    step_ms = cuda_time_ms(step, warmup=3, repeats=20)

    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        by[component(k.name)][0] += k.ms
        by[component(k.name)][1] += k.count
    kernel_sum = sum(v[0] for v in by.values())
    floors = {"gemm": gemm_floor, "attention": attn_floor}
    rows = []
    for name in ("gemm", "attention", "kv store", "elementwise", "other"):
        ms, count = by.get(name, [0.0, 0])
        own = floors.get(name)
        rows.append(
            f"| B={batch} | {name} | {count} | {ms:.3f} | {ms / replay_ms:.1%} | "
            f"{f'{own:.3f}' if own else '-'} | {f'{own / ms:.1%}' if own and ms else '-'} |"
        )
    gap = replay_ms - kernel_sum
    rows += [
        f"| B={batch} | sum of kernels (eager, profiled) | {sum(int(v[1]) for v in by.values())} "
        f"| {kernel_sum:.3f} | {kernel_sum / replay_ms:.1%} | {floor:.3f} | "
        f"{floor / kernel_sum:.1%} |",
        f"| B={batch} | gaps inside the graph (replay - kernels) | | {gap:.3f} | "
        f"{gap / replay_ms:.1%} | | |",
        f"| B={batch} | **CUDA graph replay** | | **{replay_ms:.3f}** | 100% | {floor:.3f} | "
        f"**{floor / replay_ms:.1%}** |",
        f"| B={batch} | graph step with the batch built on the host | | {step_ms:.3f} | "
        f"{step_ms / replay_ms:.1%} | {floor:.3f} | {floor / step_ms:.1%} |",
    ]
    raw = [
        f"| B={batch} | {component(k.name)} | {k.count} | {k.ms:.3f} | `{k.name[:90]}` |"
        for k in sorted(kernels, key=lambda k: k.ms, reverse=True)[:25]
    ]
    del setup, graphs, backend
    torch.cuda.empty_cache()
    return rows, raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    args = parser.parse_args()
    ms, moved = copy_ms()
    copy_bw = moved / (ms / 1e3)
    model = build_dummy_model()
    lines = [
        f"GPU: {torch.cuda.get_device_name()}; HBM copy bandwidth {copy_bw / 1e9:.0f} GB/s "
        f"(2 GiB read + written); context {args.context}; Llama-3-8B shape, bf16, Triton "
        "attention, page size 16.",
        "",
        "| batch | component | kernels / step | ms / step | share of replay | floor ms | "
        "% of floor |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    raw_lines = ["| batch | component | launches | ms / step | kernel |", "|---|---|---:|---:|---|"]
    for batch in (int(b) for b in args.batches.split(",")):
        rows, raw = account(model, copy_bw, batch, args.context)
        lines += rows
        raw_lines += raw
        print("\n".join(rows), flush=True)
    text = "\n".join([*lines, "", "Top kernels per batch:", "", *raw_lines]) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
