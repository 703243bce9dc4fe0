"""When the sessions of a workload arrive: the schedule the load tool sends and the simulator
replays (the same seed, the same arrivals).

Sessions arrive as a Poisson process of `request_rate` per second (`inf`: all at once); with
`burstiness` b != 1 the gaps are gamma-distributed with shape b and the same mean (b < 1:
burstier, b > 1: more regular). `max_concurrency` caps the sessions in progress: an arrival
waits for a free slot. A run stops after `num_sessions` arrivals, or after `duration_s` of
arrivals (the workload is cycled) and then waits for what is in flight (the load tool:
scripts/serving/load.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .datasets import Session


class LoadError(ValueError):
    """Load options that cannot describe a run; the message names the flag and the limit."""


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # sessions per second
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_sessions: int | None = 100  # None: run for duration_s
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:  # also rejects nan
            raise LoadError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise LoadError(f"--burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise LoadError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if (self.num_sessions is None) == (self.duration_s is None):
            raise LoadError("give exactly one of --num-prompts and --duration")
        if self.duration_s is not None and not (0 < self.duration_s < math.inf):
            raise LoadError(
                f"--duration must be a positive number of seconds, got {self.duration_s}"
            )
        if self.num_sessions is not None and self.num_sessions < 1:
            raise LoadError(f"--num-prompts must be >= 1, got {self.num_sessions}")


def arrival_gaps(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Seconds between consecutive arrivals: gamma(shape=b, scale=1/(rate*b)), mean 1/rate."""
    while True:
        if math.isinf(rate):
            yield 0.0
        else:
            yield float(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


def arrival_times(load: LoadConfig) -> list[float]:
    """Seconds after the start at which each session arrives: the whole schedule, drawn once
    (so that several client processes can share it)."""
    if load.duration_s is not None and math.isinf(load.request_rate):
        raise LoadError("--duration needs a finite --request-rate (inf sends everything at once)")
    gaps = arrival_gaps(load.request_rate, load.burstiness, np.random.default_rng(load.seed))
    times: list[float] = []
    at = 0.0
    while load.num_sessions is None or len(times) < load.num_sessions:
        at += next(gaps)
        if load.duration_s is not None and at >= load.duration_s:
            break
        times.append(at)
    return times


def schedule(sessions: Sequence[Session], load: LoadConfig) -> list[float]:
    """The arrival times: a trace's own (every session carries one: the mooncake dataset),
    else `arrival_times(load)`."""
    if sessions and all(s.arrival_s is not None for s in sessions):
        times = sorted(float(s.arrival_s or 0.0) for s in sessions)
        if load.duration_s is not None:
            return [t for t in times if t < load.duration_s]
        return times[: load.num_sessions]
    return arrival_times(load)
