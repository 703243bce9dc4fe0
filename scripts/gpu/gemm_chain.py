"""Decode GEMMs timed as a step runs them: 32 layers' distinct weights in one CUDA graph, no flush.

    PYTHONUNBUFFERED=1 python3 -m scripts.gpu.gemm_chain --rows 16,64,256 --out "$OUT/chain.md" \
        [--table-out tiles.json]

`tune_decode_kernels.py` times one weight at a time with L2 flushed (a 256 MiB write) before
each replay; the flush's dirty lines are written back while the timed kernel reads, so its
figures sit below the engine's (qkv at 64 rows: 29.8 us there, 21.3 us in a profiled step).
Here each variant runs once per layer over 32 separate weight copies inside one graph, as in a
decode step: every weight streams from HBM once per replay and nothing else competes. Each GEMM
is preceded by the RMSNorm kernel the step runs before it, so a kernel's neighbour is what it
is in the step (a GEMM after a GEMM would favour cuBLAS, whose kernels start back to back, over
the Triton kernels' programmatic dependent launch). Time per layer = replay time / 32 (median
of the replays), the norm included (the same in every variant).

Per row count (Llama-3-8B shapes, bf16):
1. the gated MLP's first half: cuBLAS gate_up + the SiLU kernel (the engine today) against the
   fused `gate_up_silu` kernel (engine/models/gpu_linear_kernels.py) over a tile sweep; every
   tile is first checked against the fp32 reference (`tune_decode_kernels.matches`), and the
   share of outputs bitwise equal to the engine's path is reported;
2. the whole MLP (first half + cuBLAS down_proj) with the best fused tile against the engine's;
3. qkv_proj, o_proj and down_proj: cuBLAS against the skinny split-K kernel's tiles.
Floor: the weights read once at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.models import dependent_launch
from engine.models.elementwise import rms_norm, silu_and_mul
from engine.models.gemm_tiles import GemmTile, GpuTiles
from scripts.gpu.tune_decode_kernels import SMEM_BYTES, Run, Target, gemm_candidates, matches

HIDDEN, INTER, QKV, LAYERS = 4096, 14336, 6144, 32


def chain_us(step: Callable[[int], object], layers: int = LAYERS, replays: int = 20) -> float:
    """Median time per layer of `step(layer)` for every layer, captured in one CUDA graph."""
    for layer in range(layers):
        step(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            step(layer)
    graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / layers)
    graph.reset()
    return statistics.median(samples)


def norm(x: torch.Tensor) -> torch.Tensor:
    """The RMSNorm kernel that comes before each decode GEMM in a layer (a Triton kernel with
    programmatic dependent launch, as in the step), so each chained GEMM has the step's
    neighbour and not another GEMM."""
    return rms_norm(x, _ones(x.shape[-1], x.dtype), 1e-5)


@functools.cache
def _ones(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device="cuda")  # made once: no fill kernel in the chain


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    us = chain_us(lambda _: dst.copy_(src), layers=4)
    return 2 * src.nbytes / (us * 1e-6) / 1e9


def fused_tiles(m: int) -> list[GemmTile]:
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = []
    for bn, bk, warps in itertools.product((16, 32, 64), (64, 128, 256), (4, 8)):
        per_stage = (block_m + 2 * bn) * bk * 2
        for stages in (3, 4, 5):
            if stages * per_stage <= SMEM_BYTES:
                tiles.append(GemmTile(block_m, bn, bk, 1, num_warps=warps, num_stages=stages))
    return tiles


def pct(nbytes: int, us: float, gbps: float) -> str:
    return f"{100 * nbytes / (us * 1e-6) / 1e9 / gbps:.1f}%"


def mlp_rows(rep: Run, m: int, gbps: float, budget_share: float, won: GpuTiles) -> None:
    from engine.models.gpu_linear_kernels import gate_up_silu

    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    w_up = [
        (torch.randn(2 * INTER, HIDDEN, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    w_down = [
        (torch.randn(HIDDEN, INTER, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    engine_act = silu_and_mul(F.linear(x, w_up[0]))
    gate, up = F.linear(x.float(), w_up[0].float()).split(INTER, dim=-1)
    ref = F.silu(gate) * up
    up_bytes = w_up[0].nbytes
    base_us = chain_us(lambda i: silu_and_mul(F.linear(norm(x), w_up[i])))
    rep.log(f"M={m} cuBLAS gate_up + SiLU: {base_us:.1f} us ({pct(up_bytes, base_us, gbps)})")
    timed: dict[GemmTile, tuple[float, float]] = {}
    for tile in fused_tiles(m):
        if rep.over_budget(budget_share):
            break
        try:
            out = gate_up_silu(x, w_up[0], tile)
            ok, err = matches(out, ref)
            if not ok:
                rep.log(f"  {tile.describe()}: WRONG (rel err {err:.1e})")
                continue
            same = float((out == engine_act).float().mean())
            timed[tile] = (chain_us(lambda i, t=tile: gate_up_silu(norm(x), w_up[i], t)), same)
        except Exception as exc:  # a tile the compiler refuses is skipped, not fatal
            rep.log(f"  {tile.describe()}: {type(exc).__name__}: {str(exc)[:120]}")
    if not timed:
        rep.lines.append(f"| {m} | {base_us:.1f} | no fused tile ran | | | | |")
        return
    best = min(timed, key=lambda t: timed[t][0])
    best_us, same = timed[best]
    rep.log(f"M={m} fused best {best.describe()}: {best_us:.1f} us of {len(timed)} tiles")
    if best_us < base_us:
        won.gate_up_silu[m] = best
    mlp_base = chain_us(lambda i: F.linear(silu_and_mul(F.linear(norm(x), w_up[i])), w_down[i]))
    mlp_fused = chain_us(lambda i: F.linear(gate_up_silu(norm(x), w_up[i], best), w_down[i]))
    mlp_bytes = up_bytes + w_down[0].nbytes
    rep.lines.append(
        f"| {m} | {base_us:.1f} ({pct(up_bytes, base_us, gbps)}) | {best_us:.1f} "
        f"({pct(up_bytes, best_us, gbps)}) | {best.describe()} | {100 * same:.1f}% | "
        f"{mlp_base:.1f} ({pct(mlp_bytes, mlp_base, gbps)}) | "
        f"{mlp_fused:.1f} ({pct(mlp_bytes, mlp_fused, gbps)}) |"
    )


def gemm_rows(rep: Run, m: int, gbps: float, budget_share: float, won: GpuTiles) -> None:
    from engine.models.gpu_linear_kernels import skinny_linear

    for name, (n, k) in {
        "qkv_proj": (QKV, HIDDEN),
        "o_proj": (HIDDEN, HIDDEN),
        "down_proj": (HIDDEN, INTER),
    }.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        ws = [
            (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
            for _ in range(LAYERS)
        ]
        ref = F.linear(x.float(), ws[0].float())
        cublas = chain_us(lambda i, ws=ws, x=x: F.linear(norm(x), ws[i]))
        timed: dict[GemmTile, float] = {}
        for tile in gemm_candidates(m, n, k):
            if rep.over_budget(budget_share):
                break
            try:
                if not matches(skinny_linear(x, ws[0], None, tile), ref)[0]:
                    continue
                timed[tile] = chain_us(
                    lambda i, t=tile, ws=ws, x=x: skinny_linear(norm(x), ws[i], None, t)
                )
            except Exception as exc:
                rep.log(f"  {name} {tile.describe()}: {type(exc).__name__}: {str(exc)[:120]}")
        nbytes = ws[0].nbytes
        floor = nbytes / (gbps * 1e9) * 1e6
        best = min(timed, key=lambda t: timed[t]) if timed else None
        won.linear.setdefault((n, k), {})[m] = (
            best if best is not None and timed[best] < cublas else None
        )
        best_cell = (
            f"{timed[best]:.1f} ({pct(nbytes, timed[best], gbps)}) | {best.describe()}"
            if best
            else "- | -"
        )
        rep.log(f"M={m} {name}: cuBLAS {cublas:.1f} us, Triton best {best_cell}")
        rep.lines.append(
            f"| {m} | {name} | {floor:.1f} | {cublas:.1f} ({pct(nbytes, cublas, gbps)}) "
            f"| {best_cell} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="16,64,256")
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--table-out",
        type=Path,
        default=None,
        help="write the winners as gemm_tiles.GpuTiles JSON (for decode_accounting --gemm-tiles; "
        "what goes into gemm_tiles.MEASURED)",
    )
    args = parser.parse_args()
    won = GpuTiles(linear={}, gate_up_silu={})
    rows = [int(r) for r in args.rows.split(",")]
    rep = Run(Target(), args.budget_s)
    gbps = copy_gbps()
    rep.log(f"copy bandwidth {gbps:.0f} GB/s")
    props = torch.cuda.get_device_properties(0)
    pdl_on = dependent_launch.enabled(torch.empty(0, device="cuda"))
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rep.lines += [
        f"# Decode GEMMs in a 32-layer chain ({stamp})",
        "",
        f"GPU {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
        f"programmatic dependent launch {'on' if pdl_on else 'off'}; "
        f"copy bandwidth {gbps:.0f} GB/s (the % columns: weights read once at that rate). "
        f"Command: `python3 -m scripts.gpu.gemm_chain --rows {args.rows}`.",
        "",
        "## Gated MLP: cuBLAS gate_up + SiLU kernel against the fused gate_up_silu kernel",
        "",
        "| rows | gate_up + SiLU us/layer | fused best us/layer | fused tile "
        "| outputs equal to the engine's | whole MLP today us | whole MLP fused us |",
        "|---:|---:|---:|---|---:|---:|---:|",
    ]  # fmt: skip
    for i, m in enumerate(rows):
        mlp_rows(rep, m, gbps, 0.55 * (i + 1) / len(rows), won)
        torch.cuda.empty_cache()
    rep.lines += [
        "",
        "## qkv / o_proj / down: cuBLAS against the skinny split-K Triton kernel",
        "",
        "| rows | GEMM | floor us | cuBLAS us/layer | Triton best us/layer | tile |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for i, m in enumerate(rows):
        gemm_rows(rep, m, gbps, 0.55 + 0.45 * (i + 1) / len(rows), won)
        torch.cuda.empty_cache()
    text = "\n".join(rep.lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.table_out:
        table = {"gpu": props.name, "pdl": pdl_on, **won.to_json()}
        args.table_out.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
