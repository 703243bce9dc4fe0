"""One benchmark run from frozen configs: workload -> load -> traces -> summary."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from planner.arrivals import LoadConfig
from planner.datasets import DatasetConfig, Session, build_sessions
from planner.metrics import SLO, Summary, summarize

from .client import ClientConfig
from .load import LoadResult, run_load
from .procstat import ProcessCpu
from .workers import run_load_in_workers


@dataclass(frozen=True)
class BenchmarkConfig:
    dataset: DatasetConfig
    load: LoadConfig
    client: ClientConfig
    slo: SLO

    def settings(self) -> dict[str, Any]:
        """Flat settings for the JSON output (the API key left out)."""
        flat: dict[str, Any] = {}
        for part in (self.dataset, self.load, self.client, self.slo):
            flat.update({k: v for k, v in asdict(part).items() if k != "api_key"})
        flat["path"] = str(self.dataset.path) if self.dataset.path else None
        return flat


@dataclass
class BenchmarkRun:
    config: BenchmarkConfig
    load: LoadResult
    summary: Summary
    clients: list[ProcessCpu] = field(default_factory=list)  # CPU of each client process


def run_benchmark(
    config: BenchmarkConfig,
    sessions: list[Session] | None = None,
    progress: bool = True,
    workers: int = 1,
) -> BenchmarkRun:
    """Run the workload (built from config.dataset unless given) against config.client, from
    this process or from `workers` client processes (scripts/serving/workers.py)."""
    if sessions is None:
        sessions = build_sessions(config.dataset)
    if workers > 1:
        result, clients = run_load_in_workers(sessions, config.client, config.load, workers)
    else:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        result = asyncio.run(run_load(sessions, config.client, config.load, progress))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        clients = [ProcessCpu("client", [os.getpid()], cpu, wall, "", result.loop_lag_p99_ms)]
    summary = summarize(result.traces, result.duration_s, config.slo)
    return BenchmarkRun(config, result, summary, clients)


def warm(bench: BenchmarkConfig, count: int) -> None:
    """A few unmeasured requests (other seed) so first-request costs stay out of a measurement."""
    if count == 0:
        return
    dataset = replace(bench.dataset, num_sessions=count, seed=bench.dataset.seed + 1)
    load = replace(bench.load, num_sessions=count, duration_s=None, request_rate=float("inf"))
    run_benchmark(replace(bench, dataset=dataset, load=load), progress=False)
