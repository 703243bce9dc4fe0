"""Serving benchmark of one node over its gRPC API, plus the scheduler's CPU overhead per step.

Part 1, over gRPC: starts a `decode-server` on 127.0.0.1 (or uses `--target HOST:PORT`) and,
for each concurrency N, runs a closed loop: N client workers each send requests back to back
until `--num-requests` have completed. `--client stream` (the default) sends them as the gateway
does, all on one `GenerateStream` call (`GenerateMux`, gateway/dispatch/pd_client.py); `--client
generate` opens one `Generate` call per request (the only way before 2026-11-25). Prompts are random
token ids in [100, 20000) (no special tokens), different per request so the prefix cache never
helps; decoding is greedy with `ignore_eos`, so every request generates exactly `--output-len`
tokens. Per level:

- throughput: completed requests / wall time of the level, output tokens / wall time;
- TTFT: send -> first TokenChunk; ITL: every gap between consecutive TokenChunk arrivals of a
  request; TPOT: (E2E - TTFT) / (tokens - 1); E2E: send -> end of the stream (Finished);
- server gen tok/s: median of the node's own "decode batch ... gen throughput" log lines written
  during the level, the first one skipped (its window starts before the level); only when this
  script started the node, and "-" when the level logged fewer than two such lines.

Part 2, in-process (no gRPC): builds the engine, puts `--overhead-batch` requests into decode and
times `--overhead-steps` decode steps, on a dedicated thread as the node's engine loop does
(see `measure_overhead`): overhead = mean(step_s - forward_s) / mean(step_s), where
step_s - forward_s is scheduling, batch building, attention metadata, sampling and bookkeeping.
Above 10% (or with `--profile`), the steps are profiled with cProfile, the forward excluded.

The two parts never run at the same time (the node is stopped first). On a shared machine the
numbers are noisy: latencies are percentiles over all requests, and repeated runs differ.

    .venv/bin/python -m scripts.bench.node --concurrency 1,8,32 --output-json bench_node.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import itertools
import json
import os
import pstats
import random
import re
import sys
import tempfile
import time
from collections.abc import AsyncIterable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from gateway.dispatch.pd_client import GenerateMux
from gateway.process.launcher import running_node
from proto import node_pb2, node_pb2_grpc
from scripts.flags import config_from_args

REPO_ROOT = Path(__file__).resolve().parents[2]  # engine paths in the profile are shown from here

TOKEN_ID_RANGE = (100, 20000)  # clear of the special tokens at the start of the vocabulary
OVERHEAD_TARGET = 0.10
OVERHEAD_WARMUP_STEPS = 3
WARMUP_REQUESTS = 2
WARMUP_OUTPUT_LEN = 4
PROFILE_TOP = 15
_GEN_THROUGHPUT = re.compile(r"decode batch: .*gen throughput \(token/s\) ([\d.]+)")


@dataclass(frozen=True)
class BenchConfig:
    target: str | None  # HOST:PORT of a running node; None: start one
    model: str | None  # None: the default model
    server_args: tuple[str, ...]  # extra decode-server flags
    page_size: int
    max_total_tokens: int | None
    input_len: int
    output_len: int
    concurrencies: tuple[int, ...]
    num_requests: int | None  # None: max(2 * concurrency, 8) per level
    seed: int
    startup_timeout_s: float
    request_timeout_s: float
    threads: int | None  # torch threads of the node and of the overhead engine; None: default
    skip_node: bool
    skip_overhead: bool
    overhead_batch: int
    overhead_steps: int
    profile: bool  # profile the decode step even when the overhead is under the target
    output_json: Path | None
    client: str = (
        "stream"  # "stream": one GenerateStream call (GenerateMux); "generate": per request
    )

    def requests_for(self, concurrency: int) -> int:
        return self.num_requests or max(2 * concurrency, 8)


@dataclass
class RequestTiming:
    ttft_s: float
    e2e_s: float
    itl_s: list[float]
    output_tokens: int

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / max(self.output_tokens - 1, 1)


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    failed: int
    duration_s: float
    request_throughput: float  # req/s
    output_throughput: float  # tok/s
    ttft_ms: dict[str, float]  # p50 / p90 / p99
    itl_ms: dict[str, float]
    tpot_p50_ms: float
    e2e_p50_ms: float
    server_gen_tok_s: float | None  # median of the node's decode log lines during the level
    first_error: str = ""


@dataclass
class OverheadResult:
    batch: int
    steps: int
    mean_step_ms: float
    mean_forward_ms: float
    overhead_ms: float  # mean(step_s - forward_s)
    overhead_frac: float  # mean(step_s - forward_s) / mean(step_s)
    median_step_ms: float  # medians: robust to the stalls of a shared machine
    median_overhead_ms: float
    # Thread CPU (time.thread_time) of the engine thread, medians per step: what another
    # process's load does not add, unlike the wall times above.
    cpu_step_ms: float = float("nan")
    cpu_forward_ms: float = float("nan")
    cpu_host_ms: float = float("nan")  # per step: step CPU - forward CPU
    profile: list[dict[str, Any]] = field(default_factory=list)


def log(msg: str) -> None:
    load = os.getloadavg()[0]
    print(f"[bench {time.strftime('%H:%M:%S')} load {load:.1f}] {msg}", file=sys.stderr, flush=True)


def percentiles_ms(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p50, p90, p99 = np.percentile(np.asarray(values_s) * 1e3, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def make_prompts(count: int, length: int, seed: int, label: str) -> list[list[int]]:
    """Distinct random prompts; `label` keeps the sets of warm-up, levels and overhead apart."""
    rng = random.Random(f"bench-node/{seed}/{label}")  # str seeds hash; int seeds drop the sign
    return [[rng.randrange(*TOKEN_ID_RANGE) for _ in range(length)] for _ in range(count)]


# ---- the node under test -------------------------------------------------------------------------
def server_args(cfg: BenchConfig) -> list[str]:
    args = ["--page-size", str(cfg.page_size)]
    if cfg.model:
        args += ["--model", cfg.model]
    if cfg.max_total_tokens:
        args += ["--max-total-tokens", str(cfg.max_total_tokens)]
    return args + list(cfg.server_args)


def server_env(cfg: BenchConfig) -> dict[str, str]:
    if cfg.threads is None:
        return {}
    return {"OMP_NUM_THREADS": str(cfg.threads)}  # torch's intra-op pool follows it


@contextlib.contextmanager
def decode_server(cfg: BenchConfig, log_path: Path) -> Iterator[str]:
    """Start a decode-server, yield its address once healthy, stop it with SIGTERM."""
    args = server_args(cfg)
    log(f"starting decode-server {' '.join(args)} (log: {log_path})")
    with running_node(
        "decode-server",
        args,
        log_path,
        env=server_env(cfg),
        ready_timeout=cfg.startup_timeout_s,
        stop_timeout=60,
    ) as node:
        health = node.stub.Health(node_pb2.HealthRequest(), timeout=10.0)
        log(f"node healthy on {node.address}, model {health.model}")
        yield node.address
        node.terminate()
        if not node.wait(60):
            log("node ignored SIGTERM for 60 s; killing it")
        log(f"node stopped (exit code {node.kill()})")


def server_gen_throughput(log_path: Path | None, start: int, end: int) -> float | None:
    """Median gen throughput of the node's decode log lines between two byte offsets."""
    if log_path is None:
        return None
    with log_path.open("rb") as f:
        f.seek(start)
        text = f.read(end - start).decode(errors="replace")
    # The first line's window reaches back to the previous line, before this level started.
    values = [float(m.group(1)) for m in _GEN_THROUGHPUT.finditer(text)][1:]
    return float(np.median(values)) if values else None


# ---- the closed-loop client ----------------------------------------------------------------------
def generate_request(rid: str, prompt: list[int], output_len: int) -> node_pb2.GenerateRequest:
    sampling = node_pb2.SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    return node_pb2.GenerateRequest(rid=rid, input_ids=prompt, sampling=sampling)


# Opens one request and returns its responses, as a `Generate` call's.
CallOpener = Callable[[node_pb2.GenerateRequest], AsyncIterable[node_pb2.GenerateResponse]]


def call_opener(stub: node_pb2_grpc.NodeStub, client: str) -> CallOpener:
    if client == "generate":
        return lambda request: stub.Generate(request)  # type: ignore[no-any-return]
    return GenerateMux.for_stub(stub).open


async def timed_request(
    open_call: CallOpener, rid: str, prompt: list[int], output_len: int, timeout_s: float
) -> RequestTiming:
    arrivals: list[float] = []
    tokens = 0
    finished: node_pb2.Finished | None = None
    sent = time.perf_counter()
    async with asyncio.timeout(timeout_s):
        async for resp in open_call(generate_request(rid, prompt, output_len)):
            if resp.HasField("chunk"):
                arrivals.append(time.perf_counter())
                tokens += len(resp.chunk.token_ids)
            else:
                finished = resp.finished
    end = time.perf_counter()
    if finished is None or finished.finish_reason != "length" or tokens != output_len:
        reason = f"{finished.finish_reason} {finished.detail!r}" if finished else "no Finished"
        raise RuntimeError(f"request {rid}: {tokens}/{output_len} tokens, finish {reason}")
    itl = [b - a for a, b in itertools.pairwise(arrivals)]
    return RequestTiming(
        ttft_s=arrivals[0] - sent, e2e_s=end - sent, itl_s=itl, output_tokens=tokens
    )


async def closed_loop(
    open_call: CallOpener,
    prompts: list[list[int]],
    concurrency: int,
    output_len: int,
    timeout_s: float,
) -> tuple[list[RequestTiming], list[str], float]:
    """N workers send requests back to back; returns timings, errors and the wall time."""
    pending = iter(enumerate(prompts))
    timings: list[RequestTiming] = []
    errors: list[str] = []
    tag = f"bench-c{concurrency}-{os.getpid()}-{time.monotonic_ns()}"

    async def worker() -> None:
        for i, prompt in pending:  # one shared iterator: each prompt is sent once
            try:
                timing = await timed_request(open_call, f"{tag}-{i}", prompt, output_len, timeout_s)
                timings.append(timing)
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")
            except RuntimeError as exc:
                errors.append(str(exc))
            except TimeoutError:
                errors.append(f"request {tag}-{i}: no end within {timeout_s} s")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings, errors, time.perf_counter() - start


async def ensure_healthy(stub: node_pb2_grpc.NodeStub, log_path: Path | None) -> None:
    """Stop early when the node died (e.g. its engine loop crashed): later levels would hang."""
    where = f"; see its log {log_path}" if log_path else ""
    try:
        health = await stub.Health(node_pb2.HealthRequest(), timeout=10.0)
    except grpc.aio.AioRpcError as exc:
        raise RuntimeError(f"the node stopped answering ({exc.code().name}){where}") from exc
    if not health.ok:
        raise RuntimeError(f"the node reports its engine loop dead{where}")


def summarize(
    concurrency: int, timings: list[RequestTiming], errors: list[str], duration_s: float
) -> LevelResult:
    return LevelResult(
        concurrency=concurrency,
        num_requests=len(timings) + len(errors),
        failed=len(errors),
        duration_s=duration_s,
        request_throughput=len(timings) / duration_s,
        output_throughput=sum(t.output_tokens for t in timings) / duration_s,
        ttft_ms=percentiles_ms([t.ttft_s for t in timings]),
        itl_ms=percentiles_ms([gap for t in timings for gap in t.itl_s]),
        tpot_p50_ms=percentiles_ms([t.tpot_s for t in timings])["p50"],
        e2e_p50_ms=percentiles_ms([t.e2e_s for t in timings])["p50"],
        server_gen_tok_s=None,
        first_error=errors[0] if errors else "",
    )


async def run_level(
    cfg: BenchConfig, stub: node_pb2_grpc.NodeStub, concurrency: int, log_path: Path | None
) -> LevelResult:
    prompts = make_prompts(
        cfg.requests_for(concurrency), cfg.input_len, cfg.seed, f"c{concurrency}"
    )
    log(f"concurrency {concurrency}: {len(prompts)} requests")
    log_start = log_path.stat().st_size if log_path else 0
    timings, errors, duration = await closed_loop(
        call_opener(stub, cfg.client), prompts, concurrency, cfg.output_len, cfg.request_timeout_s
    )
    result = summarize(concurrency, timings, errors, duration)
    log_end = log_path.stat().st_size if log_path else 0
    result.server_gen_tok_s = server_gen_throughput(log_path, log_start, log_end)
    log(f"concurrency {concurrency}: {brief(result)}")
    return result


async def run_levels(cfg: BenchConfig, address: str, log_path: Path | None) -> list[LevelResult]:
    results = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        warm = make_prompts(WARMUP_REQUESTS, cfg.input_len, cfg.seed, "warmup")
        _, errors, _ = await closed_loop(
            call_opener(stub, cfg.client),
            warm,
            WARMUP_REQUESTS,
            WARMUP_OUTPUT_LEN,
            cfg.request_timeout_s,
        )
        if errors:
            raise RuntimeError(f"warm-up request failed: {errors[0]}")
        for concurrency in cfg.concurrencies:
            await ensure_healthy(stub, log_path)
            results.append(await run_level(cfg, stub, concurrency, log_path))
    return results


def brief(r: LevelResult) -> str:
    failed = f", {r.failed} FAILED (first: {r.first_error})" if r.failed else ""
    return (
        f"{r.num_requests} requests in {r.duration_s:.1f} s, {r.request_throughput:.2f} req/s, "
        f"{r.output_throughput:.1f} tok/s, TTFT p50 {r.ttft_ms['p50']:.0f} ms, "
        f"ITL p50 {r.itl_ms['p50']:.1f} ms{failed}"
    )


# ---- scheduler overhead, in-process --------------------------------------------------------------
def build_decode_batch(cfg: BenchConfig, model_path: str) -> Any:
    """An engine whose scheduler holds `overhead_batch` requests, all decoding."""
    from engine.builder import build_engine
    from engine.config import EngineConfig
    from engine.request import Req
    from engine.sampling import RequestSampler, SamplingParams

    batch = cfg.overhead_batch
    steps = OVERHEAD_WARMUP_STEPS + 2 * cfg.overhead_steps  # measured, then maybe profiled
    per_req = cfg.input_len + steps + 2 * cfg.page_size
    capacity = max(cfg.max_total_tokens or 65536, batch * per_req)
    engine = build_engine(
        EngineConfig(model_path=model_path, page_size=cfg.page_size, max_total_tokens=capacity)
    )
    scheduler, vocab = engine.scheduler, engine.model_config.vocab_size
    # Enough tokens that nobody finishes during warm-up, measurement and profiling.
    params = SamplingParams(max_new_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(make_prompts(batch, cfg.input_len, cfg.seed, "overhead")):
        sampler = RequestSampler(params, ids, vocab, scheduler.runner.device)
        scheduler.add_request(
            Req(rid=f"overhead-{i}", prompt_ids=ids, params=params, sampler=sampler)
        )
    while scheduler.waiting or not all(r.is_decoding for r in scheduler.running):
        scheduler.step()
    return scheduler


def decode_steps(
    scheduler: Any, steps: int, batch: int, cpu: list[tuple[float, float]] | None = None
) -> list[Any]:
    """`steps` pure decode steps; their stats. With `cpu`: (step, forward) thread CPU seconds
    of each step appended to it."""
    stats = []
    runner = scheduler.runner
    forward_cpu = 0.0
    real_forward = runner.forward

    def timed_forward(fwd_batch: Any) -> Any:
        nonlocal forward_cpu
        start = time.thread_time()
        try:
            return real_forward(fwd_batch)
        finally:
            forward_cpu += time.thread_time() - start

    if cpu is not None:
        runner.forward = timed_forward  # instance attribute shadows the method meanwhile
    try:
        for _ in range(steps):
            forward_cpu = 0.0
            start = time.thread_time()
            scheduler.step()
            if cpu is not None:
                cpu.append((time.thread_time() - start, forward_cpu))
            stats.append(_pure_decode(scheduler.last_stats, batch))
    finally:
        if cpu is not None:
            del runner.forward
    return stats


def _pure_decode(s: Any, batch: int) -> Any:
    if s.num_decode_reqs != batch or s.num_prefill_reqs:
        raise RuntimeError(f"expected a pure decode step of {batch} requests, got {s}")
    return s


def measure_overhead(cfg: BenchConfig, model_path: str) -> OverheadResult:
    """Build, step and profile on one dedicated thread, as the node's engine loop does.

    OpenMP keeps one thread team per calling thread, so the thread that drives the steps is part
    of what is measured. On a shared machine the absolute step time swings with the load (with
    two OpenMP threads a step waits at every barrier for a descheduled worker); `--threads 1`
    gives steadier absolute figures, and the overhead fraction moves much less than the step.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-loop") as pool:
        return pool.submit(_measure_overhead, cfg, model_path).result()


def _measure_overhead(cfg: BenchConfig, model_path: str) -> OverheadResult:
    import torch

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    log(
        f"overhead: building the engine and {cfg.overhead_batch} decoding requests "
        f"(torch threads: {torch.get_num_threads()})"
    )
    scheduler = build_decode_batch(cfg, model_path)
    decode_steps(scheduler, OVERHEAD_WARMUP_STEPS, cfg.overhead_batch)
    cpu: list[tuple[float, float]] = []
    stats = decode_steps(scheduler, cfg.overhead_steps, cfg.overhead_batch, cpu)
    overheads = [s.step_s - s.forward_s for s in stats]
    mean_step = float(np.mean([s.step_s for s in stats]))
    result = OverheadResult(
        batch=cfg.overhead_batch,
        steps=len(stats),
        mean_step_ms=mean_step * 1e3,
        mean_forward_ms=float(np.mean([s.forward_s for s in stats])) * 1e3,
        overhead_ms=float(np.mean(overheads)) * 1e3,
        overhead_frac=float(np.mean(overheads)) / mean_step,
        median_step_ms=float(np.median([s.step_s for s in stats])) * 1e3,
        median_overhead_ms=float(np.median(overheads)) * 1e3,
        cpu_step_ms=float(np.median([step for step, _ in cpu])) * 1e3,
        cpu_forward_ms=float(np.median([forward for _, forward in cpu])) * 1e3,
        cpu_host_ms=float(np.median([step - forward for step, forward in cpu])) * 1e3,
    )
    log(
        f"overhead: {result.overhead_frac:.1%} ({result.overhead_ms:.2f} ms of "
        f"{result.mean_step_ms:.1f} ms/step)"
    )
    if cfg.profile or result.overhead_frac > OVERHEAD_TARGET:
        log(f"overhead: profiling {cfg.overhead_steps} decode steps (forward excluded)")
        result.profile = profile_steps(scheduler, cfg.overhead_steps, cfg.overhead_batch)
    return result


def profile_steps(scheduler: Any, steps: int, batch: int) -> list[dict[str, Any]]:
    """cProfile of whole decode steps with the profiler paused inside the model forward.

    Timed in CPU time of this thread: on a shared machine wall time also counts the moments the
    thread waits for a core, which land on whatever function happens to run.
    """
    profiler = cProfile.Profile(time.thread_time)
    runner = scheduler.runner
    real_forward = runner.forward

    def forward_unprofiled(fwd_batch: Any) -> Any:
        profiler.disable()
        try:
            return real_forward(fwd_batch)
        finally:
            profiler.enable()

    runner.forward = forward_unprofiled  # instance attribute shadows the method while profiling
    try:
        profiler.enable()
        decode_steps(scheduler, steps, batch)
        profiler.disable()
    finally:
        del runner.forward
    return profile_rows(pstats.Stats(profiler), steps)


def profile_rows(stats: pstats.Stats, steps: int) -> list[dict[str, Any]]:
    """Per step: the functions with the most own time, and the engine's by cumulative time."""
    raw: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in raw.items():
        if func in ("forward_unprofiled", "<method 'disable' of '_lsprof.Profiler' objects>"):
            continue
        where = _short_path(path)
        rows.append(
            {
                "function": f"{where}:{line}({func})" if line else func,
                "engine": where.startswith("engine/"),
                "calls_per_step": ncalls / steps,
                "own_ms_per_step": tottime / steps * 1e3,
                "cum_ms_per_step": cumtime / steps * 1e3,
            }
        )
    by_own = sorted(rows, key=lambda r: -r["own_ms_per_step"])[:PROFILE_TOP]
    engine = [r for r in rows if r["engine"]]
    by_cum = sorted(engine, key=lambda r: -r["cum_ms_per_step"])[:PROFILE_TOP]
    return [dict(r, ranked_by="own") for r in by_own] + [dict(r, ranked_by="cum") for r in by_cum]


def _short_path(path: str) -> str:
    with contextlib.suppress(ValueError):
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    return "/".join(Path(path).parts[-2:]) if path != "~" else "builtin"


# ---- report --------------------------------------------------------------------------------------
def format_levels(results: list[LevelResult]) -> str:
    lines = [
        "| concurrency | requests | failed | req/s | output tok/s | TTFT p50 / p90 / p99 ms "
        "| ITL p50 / p90 / p99 ms | TPOT p50 ms | E2E p50 ms | server gen tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ttft = " / ".join(f"{r.ttft_ms[p]:.0f}" for p in ("p50", "p90", "p99"))
        itl = " / ".join(f"{r.itl_ms[p]:.1f}" for p in ("p50", "p90", "p99"))
        server = f"{r.server_gen_tok_s:.1f}" if r.server_gen_tok_s is not None else "-"
        lines.append(
            f"| {r.concurrency} | {r.num_requests} | {r.failed} | {r.request_throughput:.2f} "
            f"| {r.output_throughput:.1f} | {ttft} | {itl} | {r.tpot_p50_ms:.1f} "
            f"| {r.e2e_p50_ms:.0f} | {server} |"
        )
    return "\n".join(lines)


def format_overhead(o: OverheadResult) -> str:
    verdict = "ok" if o.overhead_frac <= OVERHEAD_TARGET else "OVER TARGET"
    median_frac = o.median_overhead_ms / o.median_step_ms if o.median_step_ms else 0.0
    lines = [
        "| batch | decode steps | step ms (mean / median) | forward ms (mean) "
        "| overhead ms/step (mean / median) | overhead fraction (of means / of medians) "
        f"| target < {OVERHEAD_TARGET:.0%} |",
        "|---:|---:|---:|---:|---:|---:|---|",
        f"| {o.batch} | {o.steps} | {o.mean_step_ms:.2f} / {o.median_step_ms:.2f} "
        f"| {o.mean_forward_ms:.2f} | {o.overhead_ms:.2f} / {o.median_overhead_ms:.2f} "
        f"| {o.overhead_frac:.1%} / {median_frac:.1%} | {verdict} |",
        "",
        "Engine-thread CPU per decode step (medians; another process's load does not add to it):",
        "",
        "| step CPU ms | forward CPU ms | host CPU ms (step - forward) |",
        "|---:|---:|---:|",
        f"| {o.cpu_step_ms:.2f} | {o.cpu_forward_ms:.2f} | {o.cpu_host_ms:.2f} |",
    ]
    return "\n".join(lines)


def format_profile(rows: list[dict[str, Any]]) -> str:
    lines = []
    for ranked_by, title in (("own", "own time"), ("cum", "cumulative time, engine code")):
        lines += [
            f"\nTop non-forward costs per decode step by {title}, in engine-thread CPU ms "
            "(cProfile inflates Python calls):\n",
            "| function | calls/step | own ms/step | cum ms/step |",
            "|---|---:|---:|---:|",
        ]
        for r in (r for r in rows if r["ranked_by"] == ranked_by):
            lines.append(
                f"| `{r['function']}` | {r['calls_per_step']:.0f} | {r['own_ms_per_step']:.3f} "
                f"| {r['cum_ms_per_step']:.3f} |"
            )
    return "\n".join(lines)


def write_json(
    cfg: BenchConfig, levels: list[LevelResult], overhead: OverheadResult | None
) -> None:
    assert cfg.output_json is not None
    payload = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "load_average_1m_at_end": os.getloadavg()[0],
        "levels": [asdict(r) for r in levels],
        "overhead": asdict(overhead) if overhead else None,
    }
    cfg.output_json.write_text(json.dumps(payload, indent=2) + "\n")
    log(f"wrote {cfg.output_json}")


# ---- driver --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--target", default=None, help="HOST:PORT of a running node (default: start one)"
    )
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=None, help="node KV capacity in tokens")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra decode-server flag, e.g. --server-arg=--schedule-policy=lpm",
    )
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client worker counts")
    p.add_argument("--num-requests", type=int, default=None, help="per level (default: max(2N, 8))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for Health"
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (OMP_NUM_THREADS of the node, set_num_threads in-process); "
        "default: torch's, one per core",
    )
    p.add_argument("--skip-node", action="store_true", help="skip the gRPC part (overhead only)")
    p.add_argument("--skip-overhead", action="store_true", help="skip the in-process overhead part")
    p.add_argument("--overhead-batch", type=int, default=32)
    p.add_argument("--overhead-steps", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="profile the decode step even under 10%%")
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument(
        "--client",
        choices=["stream", "generate"],
        default="stream",
        help="stream: every request on one GenerateStream call, as the gateway sends them; "
        "generate: one Generate call per request",
    )
    return p


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    p = build_parser()
    args = p.parse_args(argv)
    levels = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    if not levels or min(levels) < 1:
        p.error(f"--concurrency must be positive integers, got {args.concurrency!r}")
    if args.input_len < 1 or args.output_len < 2:
        p.error("need --input-len >= 1 and --output-len >= 2 (ITL needs two tokens)")
    if args.overhead_batch < 1 or args.overhead_steps < 1:
        p.error("need --overhead-batch >= 1 and --overhead-steps >= 1")
    return config_from_args(
        BenchConfig,
        args,
        server_args=tuple(args.server_arg),
        concurrencies=levels,
        startup_timeout_s=args.startup_timeout,
        request_timeout_s=args.request_timeout,
    )


def bench_node(cfg: BenchConfig) -> list[LevelResult]:
    if cfg.target is not None:
        log(f"benchmarking the running node at {cfg.target}")
        return asyncio.run(run_levels(cfg, cfg.target, None))
    fd, name = tempfile.mkstemp(prefix="bench-node-", suffix=".log")
    os.close(fd)
    log_path = Path(name)
    with decode_server(cfg, log_path) as address:
        return asyncio.run(run_levels(cfg, address, log_path))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    levels = [] if cfg.skip_node else bench_node(cfg)
    overhead = None
    if not cfg.skip_overhead:
        from engine.model_fetch import resolve_model

        overhead = measure_overhead(cfg, resolve_model(cfg.model))
    if levels:
        print(format_levels(levels) + "\n")
    if overhead is not None:
        print(format_overhead(overhead))
        if overhead.profile:
            print(format_profile(overhead.profile))
    if cfg.output_json is not None:
        write_json(cfg, levels, overhead)
    return 1 if any(r.failed for r in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
