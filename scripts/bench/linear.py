"""The model's linear layers on this CPU: torch's F.linear against oneDNN over packed weights.

Times one pass over every linear weight of a model shape (default: SmolLM2-135M, fp32: 30 layers
of QKV, O, gate/up and down, plus the LM head) at several row counts, best of `--repeats`, with
the GB/s of weight read and the GFLOP/s; then, in a fresh process per mode, the memory a stream
of `--memory-calls` random row counts (1 to 2,048) leaves behind, with exact row counts and with
engine/models/cpu_linear.py's row buckets. Usage:

    .venv/bin/python -m scripts.bench.linear --rows 1,16,64,512,2048 --repeats 5
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.models.cpu_linear import PackedLinear, bucket_rows, onednn_linear_available


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 576
    intermediate: int = 1536
    layers: int = 30
    q_size: int = 576
    kv_size: int = 192
    vocab: int = 49152

    def weights(self) -> list[tuple[int, int]]:
        """(out, in) of each linear, in forward order."""
        layer = [
            (self.q_size + 2 * self.kv_size, self.hidden),
            (self.hidden, self.q_size),
            (2 * self.intermediate, self.hidden),
            (self.hidden, self.intermediate),
        ]
        return layer * self.layers + [(self.vocab, self.hidden)]


def make_layers(shape: ModelShape) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    layers = []
    for out_f, in_f in shape.weights():
        linear = torch.nn.Linear(in_f, out_f, bias=False)
        torch.nn.init.normal_(linear.weight, std=0.02)
        layers.append(linear)
    return layers


def time_pass(fns: list[Callable[[torch.Tensor], torch.Tensor]], rows: int, repeats: int) -> float:
    inputs = [torch.randn(rows, fn.in_features) for fn in fns]  # type: ignore[attr-defined]
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            for fn, x in zip(fns, inputs, strict=True):
                fn(x)
            best = min(best, time.perf_counter() - start)
    return best


def speed_table(shape: ModelShape, rows_list: list[int], repeats: int) -> str:
    layers = make_layers(shape)
    packed = [PackedLinear(linear) for linear in layers]
    weight_bytes = sum(o * i for o, i in shape.weights()) * 4
    flops_per_row = sum(2 * o * i for o, i in shape.weights())
    lines = [
        "| rows | F.linear ms | oneDNN packed ms | speedup | oneDNN GB/s of weights | GFLOP/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for rows in rows_list:
        aten = time_pass(layers, rows, repeats)  # type: ignore[arg-type]
        onednn = time_pass(packed, rows, repeats)  # type: ignore[arg-type]
        lines.append(
            f"| {rows} | {aten * 1e3:.1f} | {onednn * 1e3:.1f} | {aten / onednn:.2f}x | "
            f"{weight_bytes / onednn / 1e9:.1f} | {flops_per_row * rows / onednn / 1e9:.0f} |"
        )
    return "\n".join(lines)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def memory_run(mode: str, calls: int) -> None:
    """One process: `calls` passes of random row counts through one layer's linears."""
    shape = ModelShape(layers=1)
    packed = [PackedLinear(linear) for linear in make_layers(shape)]
    rng = random.Random(0)
    start = rss_mib()
    marks = []
    with torch.no_grad():
        for call in range(1, calls + 1):
            rows = rng.randint(1, 2048)
            for layer in packed[:-1]:  # the LM head sees one row per request, not a prompt
                x = torch.randn(rows, layer.in_features)
                if mode == "exact":
                    torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
                else:
                    layer(x)
            if call % max(1, calls // 4) == 0:
                marks.append(f"{rss_mib() - start:+.0f}")
    distinct = len({bucket_rows(r) for r in range(1, 2049)}) if mode == "bucketed" else 2048
    print(f"| {mode} | {distinct} | {' / '.join(marks)} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,64,512,2048", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory-calls", type=int, default=1000, help="0: skip the memory part")
    parser.add_argument("--memory-run", choices=["exact", "bucketed"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not onednn_linear_available():
        sys.exit("this torch build has no oneDNN linear ops; nothing to compare")
    if args.memory_run:
        memory_run(args.memory_run, args.memory_calls)
        return
    try:
        rows_list = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if not rows_list or min(rows_list) < 1 or args.repeats < 1:
        parser.error("--rows must be positive and --repeats >= 1")
    print(f"fp32, {torch.get_num_threads()} torch threads, best of {args.repeats}\n")
    print(speed_table(ModelShape(), rows_list, args.repeats))
    if args.memory_calls > 0:
        print(
            f"\nRSS growth (MiB) after each quarter of {args.memory_calls} passes of random row "
            "counts (1-2,048) through one layer's four linears, a fresh process per mode:\n"
        )
        print("| rows | distinct GEMM row counts | growth at 1/4 / 2/4 / 3/4 / 4/4 |")
        print("|---|---:|---|")
        for mode in ("exact", "bucketed"):
            cmd = [sys.executable, "-m", __spec__.name, "--memory-run", mode]
            cmd += ["--memory-calls", str(args.memory_calls)]
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
