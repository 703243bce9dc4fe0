"""A decode step's time by component, before and after step preparation in the CUDA graph.

    python3 -m scripts.gpu.decode_accounting [--batches 16,64,256] [--context 1024] \
        [--backends triton,flashinfer] [--steps 16] [--windows 2] [--kernels] [--out table.md] \
        [--linear-kernel triton] [--gemm-tiles tiles.json] [--tokens-out tokens.json]

`PDSERVE_PDL=0` in the environment runs the same step without programmatic dependent launch
(engine/models/dependent_launch.py): two runs with and without it, compared by their tables and
their `--tokens-out` files (which must be equal), are its A/B.

Issue 26 item 1 asks for decode at >= 85% of the HBM roofline and a per-component table before
and after moving the step's metadata preparation and sampling into the captured graph
(`EngineConfig.graph_step_prep`, engine/step_prep.py). For a Llama-3-8B-shaped model (dummy
bf16 weights, page size 16) and each attention backend (FlashInfer only when it imports; a row
says so otherwise), one offline engine holds two graph runners over the same weights and KV
pool: "before" (today's graphs: the step's tensors built on the host, copied in, sampled
outside) and "after" (one packed host-to-device copy, prep and greedy argmax inside the graph).
For each batch size B at context `--context`:

1. the gate: B greedy requests of 383 prompt tokens, 6 new tokens each, run eagerly (no graph),
   with the before graphs, with the after graphs, and with the after graphs under the overlap
   scheduler: all four should give the same tokens, and the after path's must be the before
   path's (same kernels, bit for bit). Every row of that B carries the verdict ("yes"; or
   "after == before; eager k/B" when only the eager run differs: another split-KV partition can
   flip a bf16 near tie; or **NO**);
2. B requests of `context - 1` random prompt tokens are prefilled, then `--windows` windows of
   `--steps` decode steps per path, the two paths alternating window by window (contexts grow
   by one token a step: the floor of each row is taken at its own mean context), with the
   normal scheduler (serial: schedule, build, launch, sample, read back, then the next step) and
   with the overlap scheduler (the engine's default on CUDA), wall time from a device sync to a
   device sync over the window;
3. the host's part, timed inside the serial windows: batch building (`build_batch`), the launch
   (`forward` / `forward_tokens`: host-to-device copies, metadata, plan, graph launch) and the
   sampling launch (`sample_tokens`; none after: the graph took the argmax);
4. the graph's replay alone (the GPU's part of a step, no host work) for both paths, and the
   argmax kernel that the before path runs outside its graph.

Percent of roofline = floor / time, the floor being every weight read once plus the batch's K/V
read once, at the HBM copy bandwidth measured first. `--kernels` adds the per-kernel accounting
of an eager step under torch.profiler (GEMMs, attention, KV store, elementwise, against their own
floors; Triton; the "before" table of benchmarks/gpu-2026-11-26-decode-accounting-h100.md).
A section that fails prints its error and the rest still runs. Progress lines carry the seconds
since the start; the whole run is sized to stay under 4 minutes on an H100.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import re
import statistics
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton  # type: ignore[import-untyped]
from torch.profiler import ProfilerActivity, profile

import engine.overlap
import engine.sampling
from engine import LLM, SamplingParams
from engine.attention import AttentionBackend, attention_backend_class
from engine.cuda_graph import DecodeGraphRunner
from engine.models import dependent_launch, gemm_tiles, loader
from engine.models.linear_backends import (
    LINEAR_KERNELS,
    linear_rewriter,
    resolve_linear_kernel,
)
from engine.overlap import OverlapScheduler
from engine.request import Req
from engine.scheduler import Scheduler
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
from scripts.tiny_models import LLAMA3_8B as LLAMA3_8B_HF_CONFIG
from scripts.tiny_models import write_llama_config

PATHS = ("before", "after")
# 383 prompt tokens: eager and graph Triton decode then choose the same split count at B >= 16
# on 132 SMs (the graph's is sized for the longest context), so their tokens can be compared.
GATE_PROMPT, GATE_NEW_TOKENS = 383, 6
_START = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f} s] {msg}", flush=True)


def device_ms(fn: Callable[[], object], warmup: int = 3, repeats: int = 20) -> float:
    """Median time of `fn` between CUDA events (perf_counter on the CPU)."""
    if torch.cuda.is_available():
        return cuda_time_ms(fn, warmup=warmup, repeats=repeats)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- the engine and its two graph runners -----------------------------------------------------
@dataclass
class Bench:
    """One engine, its two schedulers over one runner, and the two graph runners."""

    llm: LLM
    serial: Scheduler
    overlap: OverlapScheduler
    graphs: dict[str, DecodeGraphRunner | None]
    kv_token_bytes: int
    weight_bytes: Callable[[int], int]  # batch -> bytes every step reads besides the KV

    def use(self, path: str) -> None:
        self.llm.runner.graph_runner = self.graphs[path]

    def floor_ms(self, batch: int, context: float, copy_bw: float) -> float:
        moved = self.weight_bytes(batch) + batch * context * self.kv_token_bytes
        return moved / copy_bw * 1e3


def build_bench(
    llm: LLM, backend: AttentionBackend, graphs: Callable[..., DecodeGraphRunner]
) -> Bench:
    """`llm` running `backend`, with a before and an after graph runner made by `graphs`
    (`DecodeGraphRunner`'s signature: tests pass an eager stand-in)."""
    runner = llm.runner
    runner.attn_backend = backend
    before = graphs(runner.model, runner.context_length, pad_slot=0, step_prep=False)
    after = graphs(runner.model, runner.context_length, pad_slot=0, step_prep=True)
    runner.graph_runner = before
    layout = runner.kv_layout
    elem = torch.empty((), dtype=layout.dtype).element_size()
    kv_token_bytes = layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * elem
    assert isinstance(llm.scheduler, Scheduler) and not isinstance(llm.scheduler, OverlapScheduler)
    overlap = OverlapScheduler(llm.config, runner, llm.scheduler.stop_checker)
    paths: dict[str, DecodeGraphRunner | None] = {"eager": None, "before": before, "after": after}
    return Bench(llm, llm.scheduler, overlap, paths, kv_token_bytes,
                 lambda b: weight_bytes(runner.model, b))  # fmt: skip


@contextmanager
def dummy_weights_on_device() -> Iterator[None]:
    """The loader's dummy weights drawn on the model's device: its CPU generator takes most of
    a minute for 8B parameters, a GPU's a second (the values differ, the shapes do not)."""
    real = loader._init_dummy

    def on_device(model: torch.nn.Module) -> None:
        gens: dict[torch.device, torch.Generator] = {}
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    param.fill_(1.0)
                    continue
                gen = gens.setdefault(
                    param.device, torch.Generator(device=param.device).manual_seed(0)
                )
                param.uniform_(-0.05, 0.05, generator=gen)

    loader._init_dummy = on_device
    try:
        yield
    finally:
        loader._init_dummy = real


def build_llm(max_batch: int, context: int, max_new: int, linear_kernel: str = "auto") -> LLM:
    """The Llama-3-8B-shaped engine on the GPU, Triton attention, today's graphs."""
    model_dir = Path(tempfile.mkdtemp()) / "llama3-8b-shaped"
    write_llama_config(model_dir, LLAMA3_8B_HF_CONFIG)
    with dummy_weights_on_device():
        return LLM(str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda",
                   attention_backend="triton", page_size=16,
                   max_total_tokens=max_batch * (context + max_new + 32),
                   max_running_requests=max_batch, chunked_prefill_size=16384,
                   enable_prefix_cache=False, overlap_schedule=False,
                   linear_kernel=linear_kernel)  # fmt: skip


# ---- the gate ---------------------------------------------------------------------------------
@dataclass
class Gate:
    """`paths_ok`: the after path's tokens (serial and overlapped) are the before path's, every
    request (the same kernels: must be bit-identical). `eager_same`: requests whose eager
    tokens are the before path's too (a different split-KV partition can flip a bf16 near tie
    over 32 layers of random weights; the Triton gate's prompt length makes the split counts
    of eager and graph agree)."""

    paths_ok: bool
    eager_same: int
    batch: int
    detail: str
    tokens: list[list[int]] = field(default_factory=list)  # the after path's, serial

    @property
    def ok(self) -> bool:
        return self.paths_ok and self.eager_same == self.batch

    @property
    def mark(self) -> str:
        if self.ok:
            return "yes"
        if self.paths_ok:
            return f"after == before; eager {self.eager_same}/{self.batch}"
        return "**NO**"


def gate(bench: Bench, batch: int, vocab: int) -> Gate:
    """Greedy tokens of `batch` requests: eager == before == after, and after == before under the
    overlap scheduler."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab, (GATE_PROMPT,), generator=gen).tolist()
               for _ in range(batch)]  # fmt: skip
    params = SamplingParams(max_new_tokens=GATE_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    llm = bench.llm
    outs: dict[str, list[list[int]]] = {}
    for name, path, scheduler in (
        ("eager", "eager", bench.serial),
        ("before", "before", bench.serial),
        ("after", "after", bench.serial),
        ("before, overlapped", "before", bench.overlap),
        ("after, overlapped", "after", bench.overlap),
    ):
        bench.use(path)
        llm.scheduler = scheduler
        try:
            outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
            llm.check_integrity()
        finally:
            llm.scheduler = bench.serial
    # The overlap scheduler may batch a prefill that spans chunks differently from the serial
    # one (those steps run eagerly), so each scheduler's after path is held to its own before.
    refs = {"after, overlapped": outs["before, overlapped"]}
    same = {
        name: sum(a == b for a, b in zip(out, refs.get(name, outs["before"]), strict=True))
        for name, out in outs.items()
    }
    paths_ok = same["after"] == same["after, overlapped"] == batch
    detail = (
        ", ".join(
            f"{name} {n}/{batch}"
            for name, n in same.items()
            if name not in ("before", "before, overlapped")
        )
        + f" (the overlapped after path against the overlapped before path, which matches the"
        f" serial before path in {same['before, overlapped']}/{batch})"
    )
    return Gate(
        paths_ok,
        same["eager"],
        batch,
        f"requests identical to the before path: {detail}",
        outs["after"],
    )


# ---- timed windows ----------------------------------------------------------------------------
@dataclass
class HostTimes:
    """Host seconds spent in each part of the timed steps."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: int = 0

    def ms(self, part: str) -> float:
        return self.seconds[part] / max(1, self.steps) * 1e3


@contextmanager
def timed_host(bench: Bench, into: HostTimes) -> Iterator[None]:
    """Time the runner's batch building and launch and the sampling launch, by shadowing
    them (instance attributes and module names) while the block runs."""
    runner = bench.llm.runner
    real_sample = engine.sampling.sample_tokens

    def timer(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                into.seconds[part] += time.perf_counter() - t0

        return timed

    runner.build_batch = timer("build", runner.build_batch)  # type: ignore[method-assign]
    runner.forward = timer("launch", runner.forward)  # type: ignore[method-assign]
    runner.forward_tokens = timer("launch", runner.forward_tokens)  # type: ignore[method-assign]
    sample = timer("sample", real_sample)
    engine.sampling.sample_tokens = sample  # type: ignore[assignment]
    engine.overlap.sample_tokens = sample  # type: ignore[assignment]
    try:
        yield
    finally:
        del runner.build_batch, runner.forward, runner.forward_tokens
        engine.sampling.sample_tokens = real_sample  # type: ignore[assignment]
        engine.overlap.sample_tokens = real_sample  # type: ignore[assignment]


@dataclass
class Window:
    ms: float  # per step
    context: float  # mean context length over the window's steps


def window(scheduler: Scheduler, reqs: list[Req], steps: int) -> Window:
    sync()
    ctx0 = statistics.mean(r.kv_len for r in reqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        scheduler.step()
    sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    return Window(ms, (ctx0 + statistics.mean(r.kv_len for r in reqs)) / 2 + 1)


@dataclass
class PathFigures:
    serial: list[Window] = field(default_factory=list)
    overlapped: list[Window] = field(default_factory=list)
    host: HostTimes = field(default_factory=HostTimes)
    replay_ms: float = 0.0
    replay_context: float = 0.0
    argmax_ms: float | None = None  # the before path's sampling kernel, outside the graph


def best(windows: list[Window]) -> Window:
    return min(windows, key=lambda w: w.ms)


def measure(bench: Bench, batch: int, context: int, steps: int, windows: int,
            vocab: int) -> dict[str, PathFigures]:  # fmt: skip
    """Prefill `batch` requests of `context - 1` tokens, then the timed windows of both paths,
    serial then overlapped, and the replays alone."""
    llm, serial, overlap = bench.llm, bench.serial, bench.overlap
    gen = torch.Generator().manual_seed(1000 + batch)
    warm = 3
    new_tokens = 2 * len(PATHS) * (windows * steps + warm) + 8
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    reqs = [llm._make_req(torch.randint(0, vocab, (context - 1,), generator=gen).tolist(), params)
            for _ in range(batch)]  # fmt: skip
    bench.use("before")
    for req in reqs:
        serial.add_request(req)
    while any(not r.output_ids for r in reqs) or serial.waiting:
        serial.step()
    progress(f"  B={batch}: prefilled {batch} x {context - 1} tokens")
    figs = {path: PathFigures() for path in PATHS}
    for path in PATHS:  # captures each path's graph of this bucket
        bench.use(path)
        for _ in range(warm):
            serial.step()
    for _ in range(windows):
        for path in PATHS:
            bench.use(path)
            with timed_host(bench, figs[path].host):
                figs[path].serial.append(window(serial, reqs, steps))
            figs[path].host.steps += steps
    with torch.inference_mode():  # (a CUDA graph needs none; the CPU test's stand-in does)
        for path in PATHS:
            runner = bench.graphs[path]
            assert runner is not None
            entry = runner.graphs[runner.bucket_of(batch)]
            figs[path].replay_context = statistics.mean(r.kv_len for r in reqs)
            figs[path].replay_ms = device_ms(entry.graph.replay)
        logits = bench.graphs["before"].graphs[batch].logits  # type: ignore[union-attr]
        figs["before"].argmax_ms = device_ms(lambda: logits.argmax(dim=-1))
    progress(f"  B={batch}: serial windows and replays done")
    overlap.running, serial.running = serial.running, []
    for path in PATHS:
        bench.use(path)
        for _ in range(warm):
            overlap.step()
    for _ in range(windows):
        for path in PATHS:
            bench.use(path)
            figs[path].overlapped.append(window(overlap, reqs, steps))
    for req in reqs:
        overlap.abort(req.rid)
    while overlap.has_work:
        overlap.step()
    sync()
    llm.check_integrity()
    bench.use("before")
    return figs


# ---- the table --------------------------------------------------------------------------------
def rows_of(bench: Bench, backend: str, batch: int, figs: dict[str, PathFigures],
            check: Gate, copy_bw: float) -> list[str]:  # fmt: skip
    mark = check.mark
    b, a = figs["before"], figs["after"]

    def row(what: str, before: float | None, after: float | None, ctx: float | None = None,
            after_note: str = "") -> str:  # fmt: skip
        cells = [f"{v:.3f}" if v is not None else after_note or "-" for v in (before, after)]
        pct = ["", ""]
        floor = ""
        if ctx is not None:
            fl = bench.floor_ms(batch, ctx, copy_bw)
            floor = f"{fl:.3f}"
            pct = [f"{fl / v:.1%}" if v else "" for v in (before, after)]
        return (f"| {backend} | {batch} | {what} | {cells[0]} | {cells[1]} | {floor} | "
                f"{pct[0]} | {pct[1]} | {mark} |")  # fmt: skip

    sb, sa = best(b.serial), best(a.serial)
    ob, oa = best(b.overlapped), best(a.overlapped)
    host_b = sum(b.host.ms(p) for p in ("build", "launch", "sample"))
    host_a = sum(a.host.ms(p) for p in ("build", "launch", "sample"))
    return [
        row("graph replay alone (GPU)", b.replay_ms, a.replay_ms, b.replay_context),
        row("argmax outside the graph (GPU)", b.argmax_ms, None, after_note="in the graph"),
        row("host: batch building (build_batch)", b.host.ms("build"), a.host.ms("build")),
        row(
            "host: launch (H2D copies, metadata, plan, graph launch)",
            b.host.ms("launch"),
            a.host.ms("launch"),
        ),
        row("host: sampling launch (sample_tokens)", b.host.ms("sample"), a.host.ms("sample")),
        row("host: the three above", host_b, host_a),
        row(
            f"engine step, serial (ctx {sb.context:.0f} / {sa.context:.0f})",
            sb.ms,
            sa.ms,
            (sb.context + sa.context) / 2,
        ),
        row(
            f"engine step, overlapped (ctx {ob.context:.0f} / {oa.context:.0f})",
            ob.ms,
            oa.ms,
            (ob.context + oa.context) / 2,
        ),
    ]


TABLE_HEAD = [
    "| backend | B | component | before ms | after ms | floor ms | before % of floor | "
    "after % of floor | gate |",
    "|---|---:|---|---:|---:|---:|---:|---:|---|",
]


def run_backend(llm: LLM, backend: str, args: argparse.Namespace, copy_bw: float,
                out: Report) -> None:  # fmt: skip
    """Every batch size with `backend` (a class of `engine.attention`) on `llm`'s weights and KV."""
    batches = [int(b) for b in args.batches.split(",")]
    runner = llm.runner
    cls = attention_backend_class(backend)
    bench = build_bench(llm, cls(runner.kv_cache, runner.req_to_token), DecodeGraphRunner)
    vocab = llm.model_config.vocab_size
    try:
        for batch in batches:

            def one(batch: int = batch) -> None:
                check = gate(bench, batch, vocab)
                progress(f"{backend} B={batch}: gate {check.mark}: "
                         f"{check.detail}")  # fmt: skip
                out.checks.append(f"| {backend} | {batch} | {check.detail} | "
                                  f"{check.mark} |")  # fmt: skip
                out.tokens[f"{backend} B={batch}"] = check.tokens
                figs = measure(bench, batch, args.context, args.steps, args.windows, vocab)
                rows = rows_of(bench, backend, batch, figs, check, copy_bw)
                out.rows += rows
                print("\n".join(rows), flush=True)

            out.section(f"{backend} B={batch}", one)
    finally:
        runner.graph_runner = None  # this backend's graphs and their pools go
        bench.graphs.clear()
        gc.collect()
        torch.cuda.empty_cache()


@dataclass
class Report:
    rows: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)
    kernel_raw: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)  # the gates' greedy tokens

    def section(self, name: str, fn: Callable[[], object]) -> None:
        progress(f"== {name}")
        try:
            fn()
        except Exception as exc:  # a failed section is reported, the run goes on
            traceback.print_exc()
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
            progress(f"{name} FAILED: {type(exc).__name__}: {exc}")


# ---- per-kernel accounting of an eager step (--kernels) -----------------------------------------
PROFILED_STEPS = 5
# Kernel name -> component; the first pattern that matches wins (names of cuBLAS/CUTLASS GEMMs
# vary by GPU and version, so they are matched loosely and listed in the raw table).
COMPONENTS = (
    ("attention", re.compile(r"_decode_split_kernel|_decode_merge_kernel|flash|attn", re.I)),
    ("kv store", re.compile(r"_store_kv_kernel")),
    # the fused gate_up + SiLU kernel is a GEMM: its floor is its weight
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|sm90_|sm80_|matmul|splitK|gate_up", re.I)),
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


def kernel_table(
    batches: list[int], context: int, copy_bw: float, out: Report, linear_kernel: str = "auto"
) -> None:
    model = build_dummy_model()
    linear_rewriter(linear_kernel, torch.device("cuda"), torch.bfloat16)(model)
    for batch in batches:

        def one(batch: int = batch) -> None:
            rows, raw = account(model, copy_bw, batch, context)
            out.kernels += rows
            out.kernel_raw += raw
            print("\n".join(rows), flush=True)

        out.section(f"kernels B={batch}", one)


def markdown(args: argparse.Namespace, copy_bw: float, out: Report) -> str:
    lines = [
        f"GPU: {torch.cuda.get_device_name()}; HBM copy bandwidth {copy_bw / 1e9:.0f} GB/s "
        f"(2 GiB read + written); context {args.context}; Llama-3-8B shape, dummy bf16 "
        f"weights, page size 16; {args.windows} windows of {args.steps} decode steps per path "
        f"(best window shown); linear kernel {args.linear_kernel} (resolved: "
        f"{resolve_linear_kernel(args.linear_kernel, torch.device('cuda'), torch.bfloat16)}, "
        f"{'measured' if gemm_tiles.measured_for(torch.cuda.get_device_name()) else 'no measured'}"
        f" tiles for this GPU{' from ' + str(args.gemm_tiles) if args.gemm_tiles else ''}); "
        f"programmatic dependent "
        f"launch {'on' if dependent_launch.enabled(torch.empty(0, device='cuda')) else 'off'}; "
        f"torch {torch.__version__}, Triton {triton.__version__}.",
        "",
        "## Gate: greedy tokens, eager == before == after graphs; after == before, overlapped",
        "",
        "| backend | B | check | pass |",
        "|---|---:|---|---|",
        *out.checks,
        "",
        "## Before and after, per component (before: host-built step, argmax outside the "
        "graph; after: one packed copy, prep and argmax in the graph)",
        "",
        *TABLE_HEAD,
        *out.rows,
    ]
    if out.kernels:
        lines += ["", "## Kernels of an eager step (Triton attention; the linear kernel above)",
                  "", *KERNEL_HEAD,
                  *out.kernels, "", "Top kernels per batch:", "", *RAW_HEAD,
                  *out.kernel_raw]  # fmt: skip
    if out.errors:
        lines += ["", "## Sections that failed", "", *[f"- {e}" for e in out.errors]]
    return "\n".join(lines) + "\n"


KERNEL_HEAD = [
    "| batch | component | kernels / step | ms / step | share of replay | floor ms | % of floor |",
    "|---|---|---:|---:|---:|---:|---:|",
]
RAW_HEAD = ["| batch | component | launches | ms / step | kernel |", "|---|---|---:|---:|---|"]


def engine_sections(args: argparse.Namespace, copy_bw: float, out: Report) -> None:
    """One engine (its weights and KV freed on return), every backend on it."""
    batches = [int(b) for b in args.batches.split(",")]
    max_new = 2 * len(PATHS) * (args.windows * args.steps + 3) + 8
    progress("building the engine (dummy Llama-3-8B-shaped weights)")
    llm = build_llm(max(batches), args.context, max_new, args.linear_kernel)
    progress("engine built")
    for backend in args.backends.split(","):
        if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
            note = "not run: flashinfer-python is not installed (scripts/gpu/flashinfer_wheels.py)"
            out.rows.append(f"| flashinfer | - | {note} | | | | | | |")
            out.checks.append(f"| flashinfer | - | {note} | - |")
            progress(f"flashinfer: {note}")
            continue
        out.section(backend, lambda backend=backend: run_backend(llm, backend, args, copy_bw, out))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--batches", default="16,64,256", help="decode batch sizes (buckets)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--backends", default="triton,flashinfer")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed window")
    parser.add_argument("--windows", type=int, default=2, help="timed windows per path")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also the per-kernel accounting of an eager step (torch.profiler)",
    )
    parser.add_argument("--linear-kernel", default="auto", choices=LINEAR_KERNELS,
                        help="EngineConfig.linear_kernel (docs/decode-kernels.md)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--gemm-tiles", type=Path, default=None,
                        help="measured tiles for this GPU (gemm_chain --table-out JSON), "
                        "used instead of gemm_tiles.MEASURED")  # fmt: skip
    parser.add_argument("--tokens-out", type=Path, default=None,
                        help="write the gate's greedy tokens (JSON) to compare runs")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_accounting needs a CUDA GPU (the graphs are CUDA graphs)")
    if args.gemm_tiles is not None:
        data = json.loads(args.gemm_tiles.read_text())
        gemm_tiles.MEASURED[torch.cuda.get_device_name()] = gemm_tiles.GpuTiles.from_json(data)
    ms, moved = copy_ms()
    copy_bw = moved / (ms / 1e3)
    torch.cuda.empty_cache()
    progress(f"HBM copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    out = Report()
    out.section("engine", lambda: engine_sections(args, copy_bw, out))
    gc.collect()  # the engine's weights, KV and graphs
    torch.cuda.empty_cache()
    if args.kernels:
        batches = [int(b) for b in args.batches.split(",")]
        out.section(
            "kernels",
            lambda: kernel_table(batches, args.context, copy_bw, out, args.linear_kernel),
        )
    text = markdown(args, copy_bw, out)
    print(text, flush=True)
    if args.out is not None:
        args.out.write_text(text)
    if args.tokens_out is not None:
        args.tokens_out.write_text(json.dumps(out.tokens))
    progress("done")


if __name__ == "__main__":
    main()
