"""The decode step's kernels against their HBM floors on one GPU: skinny GEMMs, split-KV attention.

    PYTHONUNBUFFERED=1 python3 -m scripts.gpu.tune_decode_kernels --out "$OUT/decode_kernels.md"

Llama-3-8B shapes, bf16. One run (about 3 minutes on an H100; `--budget-s` stops sweeps early):
1. copy bandwidth: a 2 GiB device-to-device copy (bytes read + written), the ceiling of every
   "% of floor" below;
2. GEMMs (qkv, o_proj, gate_up, down, lm_head) at 16/64/256 rows: cuBLAS (F.linear) against the
   skinny split-K Triton kernel of `linear_kernel="triton"` (engine/models/gpu_linear_kernels.py)
   over a small tile list made for streaming weights at few rows, and against the tile the engine
   picks (`gemm_tiles.choose_tile`). Every variant is first checked against an fp32 F.linear
   (bf16 tolerances: `matches`); a variant that fails is not timed. Floor: the weight read
   once. The table ends with the winners as a `gemm_tiles.TileTable` literal;
3. decode attention, B=16/64/256 at context 1024, page 16, 32 q / 8 kv heads, head dim 128: the
   project's Triton split-KV kernel at its defaults, its split count swept (`DecodeTuning`
   blocks per SM), then its launch settings at the best split count; each checked against the
   torch-native backend first. Floor: the batch's K and V read once;
4. FlashInfer's decode on the same cache when flashinfer imports ("not installed" otherwise).

Times: CUDA events around a CUDA-graph replay of the call (no launch gaps, as inside the engine's
graphs), median of many, L2 flushed before each (`triton.testing.do_bench`). The flush is a
256 MiB write whose dirty lines are written back while the timed kernel reads, so GEMM times
here run above the engine's (qkv at 64 rows on an H100: 29.8 us here, 21.3 us profiled in a
step); `scripts/gpu/gemm_chain.py` times GEMMs over 32 distinct weights in one graph instead,
as a step runs them, and is the one to choose tiles by. The attention
cache has 2 layers (the page layout of the pool, far smaller than 32); every number is one
layer's. A section that fails prints its error and the run goes on with the next.

`--smoke` runs the same code on the CPU under Triton's interpreter (set TRITON_INTERPRET=1) with
tiny shapes and float32, timed by the wall clock: it proves the script, not the kernels' speed
(tests/test_decode_kernels.py runs it).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention.triton_reference import DEFAULT_DECODE_TUNING, DecodePlan, DecodeTuning
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.kv_cache import KVLayout, PagedKVCache, ReqToTokenPool
from engine.models.gemm_tiles import GemmTile, choose_tile

LLAMA3_8B_GEMMS = {  # name: (N, K) of the weight, times per step
    "qkv_proj": (6144, 4096, 32),
    "o_proj": (4096, 4096, 32),
    "gate_up_proj": (28672, 4096, 32),
    "down_proj": (4096, 14336, 32),
    "lm_head": (128256, 4096, 1),
}
BF16_REL_TOL = 2e-2  # ||out - ref|| / ||ref||
BF16_RTOL, BF16_ATOL = 2e-2, 1e-2  # and every element: |out - ref| <= atol * max|ref| + rtol|ref|
MAX_WORKSPACE_BYTES = 256 << 20  # split-K partials beyond this are not tried
SMEM_BYTES = 200 << 10  # pipeline stages are cut to fit an H100's 228 KiB with headroom
LAYER = 1
GEMM_BUDGET_SHARE = 0.6


@dataclass(frozen=True)
class Target:
    """What the run measures on: the GPU at Llama-3-8B shapes, or a CPU smoke run."""

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    gemms: dict[str, tuple[int, int, int]] = field(default_factory=lambda: LLAMA3_8B_GEMMS)
    context: int = 1024
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    copy_elems: int = 1 << 30  # 2 GiB of bf16

    @classmethod
    def smoke(cls) -> Target:
        gemms = {name: (n // 256 + 3, k // 64, t) for name, (n, k, t) in LLAMA3_8B_GEMMS.items()}
        return cls("cpu", torch.float32, gemms, context=40, q_heads=4, kv_heads=2, head_dim=16,
                   page_size=4, copy_elems=1 << 20)  # fmt: skip

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def num_sms(self) -> int:
        if not self.gpu:
            return 4
        return int(torch.cuda.get_device_properties(0).multi_processor_count)

    def time_ms(self, fn: Callable[[], object]) -> float:
        """GPU: median of CUDA-graph replays, L2 flushed before each; CPU: median wall clock."""
        if not self.gpu:
            fn()
            samples = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e3)
            return statistics.median(samples)
        import triton  # type: ignore[import-untyped]

        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        try:
            ms: float = triton.testing.do_bench(
                graph.replay, warmup=10, rep=60, return_mode="median"
            )
        finally:
            graph.reset()
        return ms

    def free_memory(self) -> None:
        if self.gpu:
            torch.cuda.empty_cache()


@dataclass
class Run:
    """Progress, budget and the report's lines."""

    target: Target
    budget_s: float
    start: float = field(default_factory=time.monotonic)
    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {msg}", flush=True)

    def over_budget(self, share: float = 1.0) -> bool:
        """Past `share` of the budget: start no new sweep variant (the GEMMs stop at 60%, so
        the attention sweep keeps time of its own)."""
        return time.monotonic() - self.start > share * self.budget_s

    def failed(self, what: str, exc: Exception) -> None:
        self.log(f"{what} FAILED: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        self.errors.append(f"{what}: {type(exc).__name__}: {exc}"[:300])
        self.target.free_memory()

    def section(self, name: str, body: Callable[[], None]) -> None:
        self.log(f"section {name}")
        try:
            body()
        except Exception as exc:  # one failing section must not cost the others
            self.failed(f"section {name}", exc)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def matches(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """(within bf16 tolerances, the relative error): finite, the norm-relative error below
    BF16_REL_TOL and every element within rtol/atol of the reference."""
    out32, ref32 = out.float(), ref.float()
    err = rel_err(out32, ref32)
    atol = BF16_ATOL * float(ref32.abs().max())
    close = torch.allclose(out32, ref32, rtol=BF16_RTOL, atol=atol)
    return bool(torch.isfinite(out32).all()) and err < BF16_REL_TOL and close, err


def copy_bandwidth(run: Run) -> float:
    src = torch.randn(run.target.copy_elems, device=run.target.device).to(run.target.dtype)
    dst = torch.empty_like(src)
    ms = run.target.time_ms(lambda: dst.copy_(src))
    moved = 2 * src.nbytes
    bw = moved / (ms * 1e-3)
    run.log(f"copy bandwidth {bw / 1e9:.0f} GB/s ({moved >> 20} MiB read + written, {ms:.3f} ms)")
    run.lines += [f"Copy bandwidth: **{bw / 1e9:.0f} GB/s** ({moved >> 20} MiB read + written)", ""]
    return bw


# ---- GEMMs ------------------------------------------------------------------------------------
def gemm_candidates(m: int, n: int, k: int) -> list[GemmTile]:
    """Tiles for streaming a weight at few rows: the row tile covers the rows, 32-128 weight
    rows and 128-256 K per step, split-K 1-8, stages as many as fit shared memory."""
    block_ms = (16,) if m <= 16 else (64,) if m <= 64 else (64, 128)
    splits = (1, 2, 4, 8) if m <= 64 else (1, 2)
    block_ks = (128, 256) if m <= 64 else (128,)
    tiles, seen = [], set()
    for bm, bn, bk, split in itertools.product(block_ms, (32, 64, 128), block_ks, splits):
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

    target = run.target
    n, k, _ = target.gemms[name]
    gen = torch.Generator(device=target.device).manual_seed(0)
    x = torch.randn(m, k, device=target.device, generator=gen).to(target.dtype)
    w = (torch.randn(n, k, device=target.device, generator=gen) * 0.02).to(target.dtype)
    ref = F.linear(x.float(), w.float())
    cublas_err = rel_err(F.linear(x, w), ref)
    res = GemmResult(name, m, target.time_ms(lambda: F.linear(x, w)))
    engine_tile = choose_tile(m, n, k, target.num_sms())
    timed: dict[GemmTile, float] = {}
    for tile in [engine_tile, *gemm_candidates(m, n, k)]:
        if tile in timed or (tile != engine_tile and run.over_budget(GEMM_BUDGET_SHARE)):
            continue
        try:
            ok, err = matches(skinny_linear(x, w, None, tile), ref)
            if not ok:
                run.log(f"  {name} M={m} {tile.describe()}: WRONG, rel err {err:.2e}")
                res.failed += 1
                continue
            timed[tile] = target.time_ms(functools.partial(skinny_linear, x, w, None, tile))
        except Exception as exc:
            run.log(f"  {name} M={m} {tile.describe()}: {type(exc).__name__}: {exc}"[:200])
            res.failed += 1
    if engine_tile in timed:
        res.engine_ms, res.engine_tile = timed[engine_tile], engine_tile.describe()
    if timed:
        best = min(timed, key=lambda t: timed[t])
        res.best_ms, res.best = timed[best], best
    nbytes = n * k * w.element_size()

    def rate(ms: float) -> str:
        per_s = nbytes / (ms * 1e-3)
        return f"{ms * 1e3:.1f} us {per_s / 1e9:.0f} GB/s {100 * per_s / copy_bw:.0f}%"

    run.log(f"gemm {name} [{n}x{k}] M={m}: cuBLAS {rate(res.cublas_ms)} of copy (rel err "
            f"{cublas_err:.1e}); Triton best {rate(res.best_ms)} {res.best_tile}; engine pick "
            f"{rate(res.engine_ms)} {res.engine_tile}; {len(timed)} tiles timed, "
            f"{res.failed} failed")  # fmt: skip
    return res


def gemm_section(run: Run, copy_bw: float, rows: list[int]) -> None:
    results = []
    for m, name in itertools.product(rows, run.target.gemms):
        try:
            results.append(bench_gemm(run, name, m, copy_bw))
        except Exception as exc:
            run.failed(f"gemm {name} M={m}", exc)
        run.target.free_memory()
    bytes_per = torch.empty(0, dtype=run.target.dtype).element_size()
    run.lines += gemm_table(results, copy_bw, run.target.gemms, bytes_per)


def gemm_table(
    results: list[GemmResult],
    copy_bw: float,
    gemms: dict[str, tuple[int, int, int]] = LLAMA3_8B_GEMMS,
    bytes_per: int = 2,
) -> list[str]:
    lines = [
        "## GEMMs: cuBLAS vs the skinny split-K Triton kernel (weight read once = floor)",
        "",
        "| M | GEMM [N x K] | floor us | cuBLAS us | GB/s | % | Triton best us | GB/s | % "
        "| best tile | engine pick us | % | winner |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    step: dict[int, list[float]] = {}
    for r in results:
        n, k, times = gemms[r.name]
        floor = n * k * bytes_per / copy_bw * 1e6

        def pct(us: float, floor: float = floor) -> str:
            return f"{100 * floor / us:.1f}%" if us == us else "-"  # NaN: not timed

        def gbs(us: float, nbytes: int = n * k * bytes_per) -> str:
            return f"{nbytes / us / 1e3:.0f}" if us == us else "-"

        best_us, eng_us, cub_us = r.best_ms * 1e3, r.engine_ms * 1e3, r.cublas_ms * 1e3
        winner = "Triton" if r.triton_wins else "cuBLAS"
        lines.append(f"| {r.m} | {r.name} [{n}x{k}] | {floor:.1f} | {cub_us:.1f} | {gbs(cub_us)} "
                     f"| {pct(cub_us)} | {best_us:.1f} | {gbs(best_us)} | {pct(best_us)} "
                     f"| {r.best_tile} | {eng_us:.1f} | {pct(eng_us)} | {winner} |")  # fmt: skip
        acc = step.setdefault(r.m, [0.0, 0.0, 0.0, 0.0])
        for i, us in enumerate((floor, cub_us, min(cub_us, best_us), min(cub_us, eng_us))):
            acc[i] += times * us / 1e3
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
    return [*lines, "", *tile_table(results, gemms)]


def tile_table(results: list[GemmResult], gemms: dict[str, tuple[int, int, int]]) -> list[str]:
    """The winners as a `gemm_tiles.TileTable` literal (None: cuBLAS won), for
    `replace_linears(model, table=...)` or a measured table in engine/models/gemm_tiles.py."""
    lines = ["Winners as a `TileTable` (engine/models/gemm_tiles.py):", "", "```python", "{"]
    shapes: dict[tuple[int, int], list[str]] = {}
    for r in results:
        n, k, _ = gemms[r.name]
        tile = repr(r.best) if r.triton_wins else "None"
        shapes.setdefault((n, k), []).append(f"{r.m}: {tile}")
    for (n, k), entries in shapes.items():
        lines.append(f"    ({n}, {k}): {{{', '.join(entries)}}},")
    return [*lines, "}", "```", ""]


# ---- attention --------------------------------------------------------------------------------
@dataclass
class AttentionCase:
    """`bs` requests of `target.context` tokens on shuffled pages of a random 2-layer cache,
    the new tokens' q/k/v and the torch-native backend's output (its forward stored k/v)."""

    cache: PagedKVCache
    pool: ReqToTokenPool
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref: torch.Tensor

    @property
    def kv_bytes(self) -> int:
        bs, context = self.q.shape[0], self.batch.seq_lens[0]
        return bs * context * self.k[0].numel() * self.k.element_size() * 2


def attention_case(t: Target, bs: int) -> AttentionCase:
    from engine.attention.torch_native import TorchNativeBackend

    dev, ps = torch.device(t.device), t.page_size
    pages_per_req = -(-t.context // ps)
    cache = PagedKVCache(
        KVLayout(2, t.kv_heads, t.head_dim, ps, t.dtype), 1 + bs * pages_per_req, dev
    )
    gen = torch.Generator(device=t.device).manual_seed(bs)
    for chunk in cache.buffer.split(1024):
        chunk.normal_(generator=gen)
    pool = ReqToTokenPool(bs + 1, t.context + ps, dev)
    order = torch.randperm(bs * pages_per_req, generator=torch.Generator().manual_seed(bs)) + 1
    locs = (order.view(bs, pages_per_req, 1) * ps + torch.arange(ps)).view(bs, -1)[:, : t.context]
    pool.table[1:, : t.context] = locs.to(dev)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(bs, dtype=torch.int64, device=dev),
        positions=torch.full((bs,), t.context - 1, device=dev), out_cache_loc=locs[:, -1].to(dev),
        req_slots=list(range(1, bs + 1)), seq_lens=[t.context] * bs, extend_lens=[1] * bs,
        attn_backend=None,  # type: ignore[arg-type]
    )  # fmt: skip
    q, k, v = (torch.randn(bs, h, t.head_dim, device=dev, generator=gen).to(t.dtype)
               for h in (t.q_heads, t.kv_heads, t.kv_heads))  # fmt: skip
    backend = TorchNativeBackend(cache, pool)
    batch = replace(batch, attn_backend=backend)
    backend.init_metadata(batch)
    ref = backend.forward(q, k, v, LAYER, batch)  # stores the new K/V: the cache is complete
    return AttentionCase(cache, pool, batch, q, k, v, ref)


def attention_section(run: Run, copy_bw: float, batches: list[int]) -> None:
    t = run.target
    run.lines += [f"## Decode attention: the Triton split-KV kernel's knobs (K/V read once = "
                  f"floor; one layer, context {t.context}, page {t.page_size})", "",
                  "| B | variant | splits | BLOCK_N / warps / stages | us | GB/s | % of floor |",
                  "|---|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for bs in batches:
        try:
            case = attention_case(t, bs)
            tune_attention_batch(run, case, copy_bw)
            flashinfer_batch(run, case, copy_bw)
        except Exception as exc:
            run.failed(f"attention B={bs}", exc)
        t.free_memory()
    run.lines.append("")


def time_decode(run: Run, case: AttentionCase, tuning: DecodeTuning) -> float | None:
    """us of the Triton decode with `tuning`, after its output matched the reference; None when
    it failed or was wrong."""
    from engine.attention import triton_kernels

    bs, t = case.q.shape[0], run.target
    splits = tuning.num_splits(bs, t.kv_heads, t.context, t.num_sms())
    plan = DecodePlan(
        torch.tensor(case.batch.req_slots, dtype=torch.int32, device=t.device),
        torch.tensor(case.batch.seq_lens, dtype=torch.int32, device=t.device),
        splits,
    )
    plan.ensure_workspace(t.q_heads, t.head_dim)
    out, cfg = torch.empty_like(case.q), tuning.launch_config()
    k_view, v_view = case.cache.k_view(LAYER), case.cache.v_view(LAYER)

    def call() -> None:
        triton_kernels.paged_decode(case.q, k_view, v_view, case.pool.table, plan, out, cfg)

    try:
        call()
        ok, err = matches(out, case.ref)
        if not ok:
            run.log(f"  B={bs} splits {splits} {cfg}: WRONG, rel err {err:.2e}")
            return None
        return t.time_ms(call) * 1e3
    except Exception as exc:
        run.log(f"  B={bs} splits {splits} {cfg}: {type(exc).__name__}: {exc}"[:200])
        return None


def tune_attention_batch(run: Run, case: AttentionCase, copy_bw: float) -> None:
    bs, t = case.q.shape[0], run.target
    floor_us = case.kv_bytes / copy_bw * 1e6

    def row(label: str, tuning: DecodeTuning, us: float) -> None:
        splits = tuning.num_splits(bs, t.kv_heads, t.context, t.num_sms())
        cfg = f"{tuning.block_n} / {tuning.num_warps} / {tuning.num_stages}"
        gbs = case.kv_bytes / us / 1e3
        run.lines.append(f"| {bs} | {label} | {splits} | {cfg} | {us:.1f} | {gbs:.0f} | "
                         f"{100 * floor_us / us:.1f}% |")  # fmt: skip
        run.log(f"attention B={bs} {label}: splits {splits} {cfg}: {us:.1f} us, "
                f"{case.kv_bytes / us / 1e3:.0f} GB/s, {100 * floor_us / us:.1f}% of the K/V "
                f"floor ({floor_us:.1f} us)")  # fmt: skip

    timed: dict[DecodeTuning, float] = {}
    by_splits: dict[int, DecodeTuning] = {}
    for bpsm in (DEFAULT_DECODE_TUNING.blocks_per_sm, 1, 2, 4, 8, 16, 32):  # the default first
        tuning = replace(DEFAULT_DECODE_TUNING, blocks_per_sm=bpsm)
        by_splits.setdefault(tuning.num_splits(bs, t.kv_heads, t.context, t.num_sms()), tuning)
    for tuning in by_splits.values():
        if tuning != DEFAULT_DECODE_TUNING and run.over_budget():
            continue
        if (us := time_decode(run, case, tuning)) is not None:
            timed[tuning] = us
    if DEFAULT_DECODE_TUNING in timed:
        row("default", DEFAULT_DECODE_TUNING, timed[DEFAULT_DECODE_TUNING])
    split_best = min(timed, key=lambda tuning: timed[tuning])
    for block_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3)):
        tuning = replace(split_best, block_n=block_n, num_warps=warps, num_stages=stages)
        if tuning in timed or run.over_budget():
            continue
        if (us := time_decode(run, case, tuning)) is not None:
            timed[tuning] = us
    best = min(timed, key=lambda tuning: timed[tuning])
    row(f"best of {len(timed)} (blocks/SM {best.blocks_per_sm})", best, timed[best])


def flashinfer_batch(run: Run, case: AttentionCase, copy_bw: float) -> None:
    bs = case.q.shape[0]
    if not run.target.gpu or importlib.util.find_spec("flashinfer") is None:
        why = "not installed" if run.target.gpu else "not run (CPU)"
        run.lines.append(f"| {bs} | FlashInfer decode | | | {why} | | |")
        run.log(f"attention B={bs} FlashInfer: {why}")
        return
    import triton

    from engine.attention.flashinfer_backend import FlashInferBackend

    backend = FlashInferBackend(case.cache, case.pool)
    batch = replace(case.batch, attn_backend=backend)
    backend.init_metadata(batch)
    # Stores the same new K/V again (the values the cache holds), plans, runs once.
    out = backend.forward(case.q, case.k, case.v, LAYER, batch)
    ok, err = matches(out, case.ref)
    if not ok:
        run.lines.append(f"| {bs} | FlashInfer decode | | | WRONG (rel err {err:.1e}) | | |")
        return
    md, view = batch.attn_metadata, backend.layer_views[LAYER]
    ms = triton.testing.do_bench(lambda: md.wrapper.run(case.q, view, out=out), warmup=10,
                                 rep=60, return_mode="median")  # fmt: skip
    floor_us = case.kv_bytes / copy_bw * 1e6
    gbs = case.kv_bytes / ms / 1e6
    run.lines.append(f"| {bs} | FlashInfer decode (eager) | | | {ms * 1e3:.1f} | {gbs:.0f} | "
                     f"{100 * floor_us / (ms * 1e3):.1f}% |")  # fmt: skip
    run.log(f"attention B={bs} FlashInfer: {ms * 1e3:.1f} us (rel err {err:.1e})")


# ---- the run ----------------------------------------------------------------------------------
def header(args: argparse.Namespace) -> list[str]:
    command = (f"python3 -m scripts.gpu.tune_decode_kernels --rows {args.rows} "
               f"--batches {args.batches}{' --smoke' if args.smoke else ''}")  # fmt: skip
    lines = ["# Decode kernels against their HBM floors (scripts/gpu/tune_decode_kernels.py)", ""]
    if args.smoke:
        lines.append("- smoke run on the CPU (Triton interpreter, tiny shapes): no real figures")
    else:
        from scripts.gpu.run_all import environment

        lines += [f"- {k}: {v}" for k, v in environment().items()]
    return [*lines, f"- command: {command}", ""]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--rows", default="16,64,256", help="GEMM row counts (decode batches)")
    parser.add_argument("--batches", default="16,64,256", help="attention batch sizes")
    parser.add_argument(
        "--budget-s", type=float, default=200.0, help="start no new sweep variant after this"
    )
    parser.add_argument("--skip", default="", help="comma list of sections: gemm,attention")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny shapes, TRITON_INTERPRET=1: checks the script",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(
            "--smoke runs the kernels under Triton's interpreter: set TRITON_INTERPRET=1"
        )
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("tune_decode_kernels needs a CUDA GPU (or --smoke on a CPU)")
    run = Run(Target.smoke() if args.smoke else Target(), args.budget_s)
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
    if run.errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
