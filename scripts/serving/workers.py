"""Several client processes share one load: `bench_serving --workers N`.

A client process spends ~50 CPU-us per streamed token (49 measured on the H100 host:
benchmarks/gpu-2026-11-25-serve-vs-engine-before-h100.md), so one tops out near 17k tokens/s
at 85% of a core, less on a busy host; 50k tokens/s needs `--workers 4` or more. N processes
lift that ceiling. The schedule (scripts/serving/load.py, `arrival_times`) is drawn
once, here, and dealt round robin: worker k sends sessions k, k+N, k+2N... at their arrival
times. `--max-concurrency C` is split as evenly as it goes (C // N, the first C % N workers one
more), so the total in flight never exceeds C; with equal requests it is reached as with one
process. All workers start on one clock: the parent waits until each is ready (imports done),
then sets the common zero, a perf_counter value (CLOCK_MONOTONIC is the same in every process of
a host), so the merged traces are on one time line and the usual summary is computed over them.

Each worker measures its own CPU time over the run (`time.process_time`: all its threads) and
returns it with its traces, so the report can say when a client was saturated.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any

from planner.arrivals import LoadConfig, LoadError, schedule
from planner.datasets import Session
from planner.metrics import RequestTrace

from .client import ClientConfig
from .load import LoadResult, Slice, run_slice
from .procstat import ProcessCpu

_START_MARGIN_S = 0.2  # between "go" and the common zero: every worker is awake by then
_READY_TIMEOUT_S = 120.0


class WorkerError(RuntimeError):
    """A client process died or did not start; the message names it."""


@dataclass(frozen=True)
class WorkerJob:
    number: int
    sessions: Sequence[Session]
    client: ClientConfig
    part: Slice


@dataclass
class WorkerOutcome:
    number: int
    pid: int
    traces: list[RequestTrace]
    duration_s: float
    cpu_s: float
    wall_s: float
    loop_lag_p99_ms: float = 0.0
    error: str = ""


def deal(times: Sequence[float], workers: int, max_concurrency: int | None) -> list[Slice]:
    """Round-robin slices of the schedule, with max_concurrency split among them."""
    if workers < 1:
        raise LoadError(f"--workers must be >= 1, got {workers}")
    if max_concurrency is not None and max_concurrency < workers:
        raise LoadError(
            f"--max-concurrency {max_concurrency} is below --workers {workers}: each client "
            "process needs at least one slot; lower --workers"
        )
    slices = []
    for k in range(workers):
        cap = None
        if max_concurrency is not None:
            cap = max_concurrency // workers + (1 if k < max_concurrency % workers else 0)
        indices = tuple(range(k, len(times), workers))
        slices.append(Slice(indices, tuple(times[i] for i in indices), cap))
    return slices


def _worker(job: WorkerJob, ready: mp.Queue, go: Event, zero: Any, out: mp.Queue) -> None:
    """One client process: report ready, wait for the common zero, send its slice."""
    import os

    ready.put(job.number)
    go.wait()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    try:
        result = asyncio.run(run_slice(job.sessions, job.client, job.part, zero.value))
        traces, duration, lag, error = result.traces, result.duration_s, result.loop_lag_p99_ms, ""
    except Exception as exc:  # reported by the parent with the worker's number
        traces, duration, lag, error = [], 0.0, 0.0, f"{type(exc).__name__}: {exc}"
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    out.put(WorkerOutcome(job.number, os.getpid(), traces, duration, cpu, wall, lag, error))


def run_load_in_workers(
    sessions: Sequence[Session], client: ClientConfig, load: LoadConfig, workers: int
) -> tuple[LoadResult, list[ProcessCpu]]:
    """The load of `run_load`, sent by `workers` processes; the merged result and each
    worker's CPU."""
    if not sessions:
        raise LoadError("the workload has no sessions")
    slices = deal(schedule(sessions, load), workers, load.max_concurrency)
    ctx = mp.get_context("spawn")  # no fork of a process that may hold threads
    ready, out = ctx.Queue(), ctx.Queue()
    go, zero = ctx.Event(), ctx.Value("d", 0.0)
    procs = [
        ctx.Process(
            target=_worker,
            args=(WorkerJob(k, sessions, client, part), ready, go, zero, out),
            name=f"bench-client-{k}",
            daemon=True,
        )
        for k, part in enumerate(slices)
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            ready.get(timeout=_READY_TIMEOUT_S)
        zero.value = time.perf_counter() + _START_MARGIN_S
        go.set()
        outcomes = _collect(procs, out)
    except queue.Empty:
        raise WorkerError(
            f"a client process did not start within {_READY_TIMEOUT_S:.0f} s"
        ) from None
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    failed = [o for o in outcomes if o.error]
    if failed:
        raise WorkerError(f"client process {failed[0].number} failed: {failed[0].error}")
    traces = sorted((t for o in outcomes for t in o.traces), key=lambda t: (t.sent, t.session))
    duration = max(o.duration_s for o in outcomes)
    lag = max(o.loop_lag_p99_ms for o in outcomes)
    result = LoadResult(traces, duration, sum(len(s.indices) for s in slices), lag)
    usage = [
        ProcessCpu(f"client-{o.number}", [o.pid], o.cpu_s, o.wall_s, "", o.loop_lag_p99_ms)
        for o in outcomes
    ]
    return result, usage


def _collect(procs: Sequence[BaseProcess], out: mp.Queue) -> list[WorkerOutcome]:
    outcomes: list[WorkerOutcome] = []
    while len(outcomes) < len(procs):
        try:
            outcomes.append(out.get(timeout=1.0))
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                raise WorkerError(
                    f"{dead[0].name} exited with code {dead[0].exitcode} before reporting"
                ) from None
    return sorted(outcomes, key=lambda o: o.number)
