"""The decode step's kernels against their HBM floors on one GPU: skinny GEMMs, split-KV attention.

    PYTHONUNBUFFERED=1 python3 -m scripts.gpu.tune_decode_kernels --out "$OUT/decode_kernels.md"

Llama-3-8B shapes, bf16. One run (about 3 minutes on an H100; `--budget-s` stops sweeps early):
1. copy bandwidth: a 2 GiB device-to-device copy (bytes read + written), the ceiling of every
   "% of copy" below;
2. GEMMs (qkv, o_proj, gate_up, down, lm_head) at 16/64/256 rows: cuBLAS (F.linear) against the
   skinny split-K Triton kernel of `linear_kernel="triton"` (engine/models/gpu_linear_kernels.py)
   over a small tile list made for streaming weights at few rows, and against the tile the engine
   picks (`gemm_tiles.choose_tile`). Every variant is first checked against an fp32 F.linear
   (bf16 tolerance); a variant that fails is not timed. Floor: the weight read once;
3. decode attention, B=16/64/256 at context 1024, page 16, 32 q / 8 kv heads, head dim 128: the
   project's Triton split-KV kernel at its defaults, its split count swept (`DecodeTuning`
   blocks per SM), then its launch settings at the best split count; each checked against the
   torch-native backend first. Floor: the batch's K and V read once;
4. FlashInfer's decode on the same cache when flashinfer imports ("not installed" otherwise).

Times: CUDA events around a CUDA-graph replay of the call (no launch gaps, as inside the engine's
graphs), median of many, L2 flushed before each (`triton.testing.do_bench`). The attention
cache has 2 layers (the page layout of the pool, far smaller than 32); every number is one
layer's. A section that fails prints its error and the run goes on with the next.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.models.gemm_tiles import GemmTile, choose_tile

if TYPE_CHECKING:
    from scripts.gpu.run_all import PagedSetup

GEMM_SHAPES = {  # name: (N, K) of the weight; layers per step
    "qkv_proj": (6144, 4096, 32),
    "o_proj": (4096, 4096, 32),
    "gate_up_proj": (28672, 4096, 32),
    "down_proj": (4096, 14336, 32),
    "lm_head": (128256, 4096, 1),
}
BF16_REL_TOL = 2e-2
MAX_WORKSPACE_BYTES = 256 << 20  # split-K partials beyond this are not tried
SMEM_BYTES = 200 << 10  # pipeline stages are cut to fit an H100's 228 KiB with headroom


@dataclass
class Run:
    """Progress, budget and the report's lines."""

    budget_s: float
    start: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {msg}", flush=True)

    def over_budget(self) -> bool:
        return time.monotonic() - self.start > self.budget_s

    def section(self, name: str, body: Callable[[], None]) -> None:
        self.log(f"section {name}")
        try:
            body()
        except Exception as exc:  # one failing section must not cost the others
            self.log(f"section {name} FAILED: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()


def graph_ms(fn: Callable[[], object]) -> float:
    """Median ms of `fn` replayed from a CUDA graph, L2 flushed before each replay."""
    import triton  # type: ignore[import-untyped]

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        ms: float = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median")
    finally:
        graph.reset()
    return ms


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def copy_bandwidth(run: Run) -> float:
    import triton

    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    bw = 2 * (1 << 30) * 2 / (ms * 1e-3)
    run.log(f"copy bandwidth {bw / 1e9:.0f} GB/s (2 GiB read + written, {ms:.3f} ms)")
    run.lines += [f"HBM copy bandwidth: **{bw / 1e9:.0f} GB/s** (2 GiB read + written)", ""]
    return bw


# ---- GEMMs ------------------------------------------------------------------------------------
def gemm_candidates(m: int, n: int, k: int) -> list[GemmTile]:
    """Tiles for streaming a weight at few rows: the row tile covers the rows, 64-128 weight
    rows and 128-256 K per step, split-K 1-8, stages as many as fit shared memory."""
    block_ms = (16,) if m <= 16 else (64,) if m <= 64 else (64, 128)
    splits = (1, 2, 4, 8) if m <= 64 else (1, 2)
    block_ks = (128, 256) if m <= 64 else (128,)
    tiles, seen = [], set()
    for bm, bn, bk, split in itertools.product(block_ms, (64, 128), block_ks, splits):
        stages = max(2, min(5, SMEM_BYTES // ((bm + bn) * bk * 2)))
        tile = GemmTile(bm, bn, bk, split, num_warps=8 if bm * bn >= 8192 else 4,
                        num_stages=stages)  # fmt: skip
        key = (bm, bn, bk, tile.num_splits(k))
        if key in seen or tile.num_splits(k) * m * n * 4 > MAX_WORKSPACE_BYTES:
            continue
        seen.add(key)
        tiles.append(tile)
    return tiles


@dataclass
class GemmResult:
    """One GEMM shape at one row count: cuBLAS, the sweep's best tile, the engine's pick."""

    name: str
    m: int
    cublas_ms: float
    best_ms: float = float("nan")
    best: GemmTile | None = None
    engine_ms: float = float("nan")
    engine_tile: str = "-"
    failed: int = 0

    @property
    def best_tile(self) -> str:
        return self.best.describe() if self.best else "-"

    @property
    def triton_wins(self) -> bool:
        return self.best is not None and self.best_ms < self.cublas_ms


def bench_gemm(run: Run, name: str, m: int, copy_bw: float) -> GemmResult:
    from engine.models.gpu_linear_kernels import skinny_linear

    n, k, _ = GEMM_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    cublas_err = rel_err(F.linear(x, w), ref)
    res = GemmResult(name, m, graph_ms(lambda: F.linear(x, w)))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    engine_tile = choose_tile(m, n, k, sms)
    timed: dict[GemmTile, float] = {}
    for tile in [engine_tile, *gemm_candidates(m, n, k)]:
        if tile in timed or run.over_budget():
            continue
        try:
            err = rel_err(skinny_linear(x, w, None, tile), ref)
            if not err < BF16_REL_TOL:
                run.log(f"  {name} M={m} {tile.describe()}: WRONG, rel err {err:.2e}")
                res.failed += 1
                continue
            timed[tile] = graph_ms(functools.partial(skinny_linear, x, w, None, tile))
        except Exception as exc:
            run.log(f"  {name} M={m} {tile.describe()}: {type(exc).__name__}: {exc}"[:200])
            res.failed += 1
    if engine_tile in timed:
        res.engine_ms, res.engine_tile = timed[engine_tile], engine_tile.describe()
    if timed:
        best = min(timed, key=lambda t: timed[t])
        res.best_ms, res.best = timed[best], best
    floor_ms = n * k * 2 / copy_bw * 1e3
    run.log(f"gemm {name} [{n}x{k}] M={m}: cuBLAS {res.cublas_ms * 1e3:.1f} us "
            f"({100 * floor_ms / res.cublas_ms:.0f}% of copy, rel err {cublas_err:.1e}); "
            f"Triton best {res.best_ms * 1e3:.1f} us {res.best_tile} "
            f"({100 * floor_ms / res.best_ms:.0f}%); engine pick {res.engine_ms * 1e3:.1f} us "
            f"{res.engine_tile}; {len(timed)} tiles timed, {res.failed} failed")  # fmt: skip
    return res


def gemm_section(run: Run, copy_bw: float, rows: list[int]) -> None:
    results = []
    for m, name in itertools.product(rows, GEMM_SHAPES):
        try:
            results.append(bench_gemm(run, name, m, copy_bw))
        except Exception as exc:
            run.log(f"gemm {name} M={m} FAILED: {type(exc).__name__}: {exc}")
            run.errors.append(f"gemm {name} M={m}: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()
    run.lines += gemm_table(results, copy_bw)


def gemm_table(results: list[GemmResult], copy_bw: float) -> list[str]:
    lines = [
        "## GEMMs: cuBLAS vs the skinny split-K Triton kernel (weight read once = floor)",
        "",
        "| M | GEMM [N x K] | floor us | cuBLAS us | % | Triton best us | % | best tile "
        "| engine pick us | % | winner |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    step: dict[int, list[float]] = {}
    for r in results:
        n, k, layers = GEMM_SHAPES[r.name]
        floor = n * k * 2 / copy_bw * 1e6

        def pct(us: float, floor: float = floor) -> str:
            return f"{100 * floor / us:.1f}%" if us == us else "-"  # NaN: not timed

        best_us, eng_us, cub_us = r.best_ms * 1e3, r.engine_ms * 1e3, r.cublas_ms * 1e3
        winner = "Triton" if r.triton_wins else "cuBLAS"
        lines.append(f"| {r.m} | {r.name} [{n}x{k}] | {floor:.1f} | {cub_us:.1f} | {pct(cub_us)} "
                     f"| {best_us:.1f} | {pct(best_us)} | {r.best_tile} | {eng_us:.1f} "
                     f"| {pct(eng_us)} | {winner} |")  # fmt: skip
        acc = step.setdefault(r.m, [0.0, 0.0, 0.0, 0.0])
        for i, us in enumerate((floor, cub_us, min(cub_us, best_us), min(cub_us, eng_us))):
            acc[i] += layers * us / 1e3
    lines += [
        "",
        "Per decode step (32 layers + LM head), ms: floor / all cuBLAS / each shape's winner / "
        "cuBLAS or the engine's pick, whichever is faster per shape:",
        "",
    ]
    for m, (floor, cub, best, eng) in sorted(step.items()):
        lines.append(f"- M={m}: floor {floor:.3f}, cuBLAS {cub:.3f} ({100 * floor / cub:.1f}%), "
                     f"winners {best:.3f} ({100 * floor / best:.1f}%), with the engine's picks "
                     f"{eng:.3f} ({100 * floor / eng:.1f}%)")  # fmt: skip
    return [*lines, "", *tile_table(results)]


def tile_table(results: list[GemmResult]) -> list[str]:
    """The winners as a `gemm_tiles.TileTable` literal (None: cuBLAS won), for
    `replace_linears(model, table=...)` or a measured table in engine/models/gemm_tiles.py."""
    lines = ["Winners as a `TileTable` (engine/models/gemm_tiles.py):", "", "```python", "{"]
    shapes: dict[tuple[int, int], list[str]] = {}
    for r in results:
        n, k, _ = GEMM_SHAPES[r.name]
        tile = repr(r.best) if r.triton_wins else "None"
        shapes.setdefault((n, k), []).append(f"{r.m}: {tile}")
    for (n, k), entries in shapes.items():
        lines.append(f"    ({n}, {k}): {{{', '.join(entries)}}},")
    return [*lines, "}", "```", ""]


# ---- attention --------------------------------------------------------------------------------
LAYER = 1
CONTEXT = 1024


@dataclass
class AttentionCase:
    """A random paged cache of `bs` requests at CONTEXT tokens, the new tokens' q/k/v and the
    torch-native backend's output (its forward stored k/v: the cache is complete)."""

    setup: PagedSetup
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref: torch.Tensor

    @property
    def kv_bytes(self) -> int:
        return self.q.shape[0] * CONTEXT * 8 * 128 * 2 * 2


def attention_case(bs: int) -> AttentionCase:
    from engine.attention.torch_native import TorchNativeBackend
    from engine.memory.kv_cache import KVLayout
    from scripts.gpu.run_all import paged_setup

    layout = KVLayout(2, 8, 128, 16, torch.bfloat16)
    setup = paged_setup(layout, [CONTEXT - 1] * bs, [1] * bs, slack_pages=1)
    gen = torch.Generator(device="cuda").manual_seed(bs)
    q, k, v = (torch.randn(bs, h, 128, device="cuda", generator=gen).to(torch.bfloat16)
               for h in (32, 8, 8))  # fmt: skip
    backend = TorchNativeBackend(setup.cache, setup.pool)
    batch = replace(setup.batch, attn_backend=backend)
    backend.init_metadata(batch)
    ref = backend.forward(q, k, v, LAYER, batch)  # stores the new K/V: the cache is complete
    return AttentionCase(setup, q, k, v, ref)


def attention_section(run: Run, copy_bw: float, batches: list[int]) -> None:
    run.lines += ["## Decode attention: the Triton split-KV kernel's knobs (K/V read once = "
                  "floor; one layer, context 1024)", "",
                  "| B | variant | splits | BLOCK_N / warps / stages | us | % of floor |",
                  "|---|---|---:|---|---:|---:|"]  # fmt: skip
    for bs in batches:
        try:
            tune_attention_batch(run, bs, copy_bw)
            flashinfer_batch(run, bs, copy_bw)
        except Exception as exc:
            run.log(f"attention B={bs} FAILED: {type(exc).__name__}: {exc}")
            run.errors.append(f"attention B={bs}: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()
    run.lines.append("")


def tune_attention_batch(run: Run, bs: int, copy_bw: float) -> None:
    from engine.attention import triton_kernels
    from engine.attention.triton_reference import DEFAULT_DECODE_TUNING, DecodePlan, DecodeTuning

    case = attention_case(bs)
    cache, pool = case.setup.cache, case.setup.pool
    k_view, v_view = cache.k_view(LAYER), cache.v_view(LAYER)
    slots = torch.arange(1, bs + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((bs,), CONTEXT, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    floor_us = case.kv_bytes / copy_bw * 1e6

    def time_tuning(tuning: DecodeTuning) -> float | None:
        splits = tuning.num_splits(bs, 8, CONTEXT, sms)
        plan = DecodePlan(slots, seq_lens, splits)
        plan.ensure_workspace(32, 128)
        out = torch.empty_like(case.q)
        cfg = tuning.launch_config()

        def call() -> None:
            triton_kernels.paged_decode(case.q, k_view, v_view, pool.table, plan, out, cfg)

        try:
            call()
            err = rel_err(out, case.ref)
            if not err < BF16_REL_TOL:
                run.log(f"  B={bs} {tuning}: WRONG, rel err {err:.2e}")
                return None
            return graph_ms(call) * 1e3
        except Exception as exc:
            run.log(f"  B={bs} splits {splits} {cfg}: {type(exc).__name__}: {exc}"[:200])
            return None

    def row(label: str, tuning: DecodeTuning, us: float) -> None:
        splits = tuning.num_splits(bs, 8, CONTEXT, sms)
        cfg = f"{tuning.block_n} / {tuning.num_warps} / {tuning.num_stages}"
        run.lines.append(f"| {bs} | {label} | {splits} | {cfg} | {us:.1f} | "
                         f"{100 * floor_us / us:.1f}% |")  # fmt: skip
        run.log(f"attention B={bs} {label}: splits {splits} {cfg}: {us:.1f} us, "
                f"{100 * floor_us / us:.1f}% of the K/V floor ({floor_us:.1f} us)")  # fmt: skip

    timed: dict[DecodeTuning, float] = {}
    by_splits: dict[int, DecodeTuning] = {}
    for bpsm in (4, 1, 2, 8, 16, 32):  # the default first
        tuning = replace(DEFAULT_DECODE_TUNING, blocks_per_sm=bpsm)
        by_splits.setdefault(tuning.num_splits(bs, 8, CONTEXT, sms), tuning)
    for tuning in by_splits.values():
        if (us := time_tuning(tuning)) is not None:
            timed[tuning] = us
    if DEFAULT_DECODE_TUNING in timed:
        row("default", DEFAULT_DECODE_TUNING, timed[DEFAULT_DECODE_TUNING])
    split_best = min(timed, key=lambda t: timed[t])
    for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
        tuning = replace(split_best, block_n=block_n, num_warps=warps, num_stages=stages)
        if tuning not in timed and not run.over_budget() and (us := time_tuning(tuning)):
            timed[tuning] = us
    best = min(timed, key=lambda t: timed[t])
    row(f"best of {len(timed)} (blocks/SM {best.blocks_per_sm})", best, timed[best])


def flashinfer_batch(run: Run, bs: int, copy_bw: float) -> None:
    if importlib.util.find_spec("flashinfer") is None:
        run.lines.append(f"| {bs} | FlashInfer decode | | | not installed | |")
        run.log(f"attention B={bs} FlashInfer: not installed")
        return
    from engine.attention.flashinfer_backend import FlashInferBackend

    case = attention_case(bs)
    backend = FlashInferBackend(case.setup.cache, case.setup.pool)
    batch = replace(case.setup.batch, attn_backend=backend)
    backend.init_metadata(batch)
    # Stores the same new K/V again (the values the cache holds), plans, runs once.
    out = backend.forward(case.q, case.k, case.v, LAYER, batch)
    err = rel_err(out, case.ref)
    if not err < BF16_REL_TOL:
        run.lines.append(f"| {bs} | FlashInfer decode | | | WRONG (rel err {err:.1e}) | |")
        return
    md, view = batch.attn_metadata, backend.layer_views[LAYER]
    import triton

    ms = triton.testing.do_bench(lambda: md.wrapper.run(case.q, view, out=out), warmup=10,
                                 rep=60, return_mode="median")  # fmt: skip
    floor_us = case.kv_bytes / copy_bw * 1e6
    run.lines.append(f"| {bs} | FlashInfer decode (eager) | | | {ms * 1e3:.1f} | "
                     f"{100 * floor_us / (ms * 1e3):.1f}% |")  # fmt: skip
    run.log(f"attention B={bs} FlashInfer: {ms * 1e3:.1f} us (rel err {err:.1e})")


# ---- the run ----------------------------------------------------------------------------------
def header(args: argparse.Namespace) -> list[str]:
    from scripts.gpu.run_all import environment

    env = environment()
    return ["# Decode kernels against their HBM floors (scripts/gpu/tune_decode_kernels.py)", "",
            *[f"- {k}: {v}" for k, v in env.items()],
            f"- command: python3 -m scripts.gpu.tune_decode_kernels --rows {args.rows} "
            f"--batches {args.batches}", ""]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--rows", default="16,64,256", help="GEMM row counts (decode batches)")
    parser.add_argument("--batches", default="16,64,256", help="attention batch sizes")
    parser.add_argument(
        "--budget-s", type=float, default=200.0, help="start no new sweep variant after this"
    )
    parser.add_argument("--skip", default="", help="comma list of sections: gemm,attention")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "tune_decode_kernels needs a CUDA GPU (torch.cuda.is_available() is False)"
        )
    run = Run(args.budget_s)
    run.lines += header(args)
    copy_bw = 0.0

    def measure_copy() -> None:
        nonlocal copy_bw
        copy_bw = copy_bandwidth(run)

    run.section("copy bandwidth", measure_copy)
    if not copy_bw:
        raise SystemExit("no copy bandwidth, no floors: see the error above")
    skip = set(filter(None, args.skip.split(",")))
    rows = [int(r) for r in args.rows.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if "gemm" not in skip:
        run.section("gemm", lambda: gemm_section(run, copy_bw, rows))
    if "attention" not in skip:
        run.section("attention", lambda: attention_section(run, copy_bw, batches))
    if run.errors:
        run.lines += ["## Errors", "", *[f"- {e}" for e in run.errors], ""]
    text = "\n".join(run.lines)
    print(text, flush=True)
    if args.out:
        args.out.write_text(text)
    run.log("done")


if __name__ == "__main__":
    main()
