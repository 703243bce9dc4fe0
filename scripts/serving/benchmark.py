"""One benchmark run from frozen configs: workload -> load -> traces -> summary."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, replace
from typing import Any

from .client import ClientConfig
from .datasets import DatasetConfig, Session, build_sessions
from .load import LoadConfig, LoadResult, run_load
from .metrics import SLO, Summary, summarize


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


def run_benchmark(
    config: BenchmarkConfig, sessions: list[Session] | None = None, progress: bool = True
) -> BenchmarkRun:
    """Run the workload (built from config.dataset unless given) against config.client."""
    if sessions is None:
        sessions = build_sessions(config.dataset)
    result = asyncio.run(run_load(sessions, config.client, config.load, progress))
    return BenchmarkRun(config, result, summarize(result.traces, result.duration_s, config.slo))


def warm(bench: BenchmarkConfig, count: int) -> None:
    """A few unmeasured requests (other seed) so first-request costs stay out of a measurement."""
    if count == 0:
        return
    dataset = replace(bench.dataset, num_sessions=count, seed=bench.dataset.seed + 1)
    load = replace(bench.load, num_sessions=count, duration_s=None, request_rate=float("inf"))
    run_benchmark(replace(bench, dataset=dataset, load=load), progress=False)
