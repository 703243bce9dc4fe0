"""Arrivals and concurrency: sends the sessions of a workload and collects their traces.

Sessions arrive as a Poisson process of `request_rate` per second (`inf`: all at once); with
`burstiness` b != 1 the gaps are gamma-distributed with shape b and the same mean (b < 1:
burstier, b > 1: more regular). `max_concurrency` caps the sessions in progress: an arrival
waits for a free slot. A run stops after `num_sessions` arrivals, or after `duration_s` of
arrivals (the workload is cycled) and then waits for what is in flight.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np
from tqdm import tqdm

from .client import ClientConfig, send
from .datasets import Session
from .metrics import RequestTrace, percentile


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
    (so that several client processes can share it, scripts/serving/workers.py)."""
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


@dataclass
class LoadResult:
    traces: list[RequestTrace]
    duration_s: float  # first arrival -> last completion
    sessions_started: int
    loop_lag_p99_ms: float = 0.0  # how late the client's event loop woke (LagProbe)


@dataclass
class LagProbe:
    """How late this process's event loop runs a timer: a client that cannot keep up (CPU
    saturated, or waiting for a CPU on a busy host, which its CPU time does not show) wakes
    late and stamps late times on what it receives."""

    period_s: float = 0.05
    lags_s: list[float] = field(default_factory=list)

    async def run(self) -> None:
        while True:
            due = time.perf_counter() + self.period_s
            await asyncio.sleep(self.period_s)
            self.lags_s.append(max(0.0, time.perf_counter() - due))

    @property
    def p99_ms(self) -> float:
        return percentile(self.lags_s, 99) * 1e3 if self.lags_s else 0.0


@dataclass(frozen=True)
class Slice:
    """The part of a schedule one client process sends: session numbers and their arrivals."""

    indices: tuple[int, ...]
    times: tuple[float, ...]
    max_concurrency: int | None

    @classmethod
    def whole(cls, times: Sequence[float], max_concurrency: int | None) -> Slice:
        return cls(tuple(range(len(times))), tuple(times), max_concurrency)


async def run_load(
    sessions: Sequence[Session],
    client: ClientConfig,
    load: LoadConfig,
    progress: bool = True,
) -> LoadResult:
    if not sessions:
        raise LoadError("the workload has no sessions")
    part = Slice.whole(schedule(sessions, load), load.max_concurrency)
    return await run_slice(sessions, client, part, time.perf_counter(), progress)


async def run_slice(
    sessions: Sequence[Session],
    client: ClientConfig,
    part: Slice,
    zero: float,
    progress: bool = False,
) -> LoadResult:
    """Send the sessions of `part` at their arrival times after `zero` (a perf_counter value:
    CLOCK_MONOTONIC, the same in every process of the host)."""
    slots = asyncio.Semaphore(part.max_concurrency or 1 << 30)
    total = sum(len(sessions[i % len(sessions)].turns) for i in part.indices)
    bar = tqdm(total=total, disable=not progress, desc="requests", unit="req", leave=False)
    traces: list[RequestTrace] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {client.api_key}"} if client.api_key else {}
    async with httpx.AsyncClient(
        base_url=client.base_url, timeout=client.timeout_s, limits=limits, headers=headers
    ) as http:
        probe = LagProbe()
        probing = asyncio.create_task(probe.run())
        tasks = []
        for index, at in zip(part.indices, part.times, strict=True):
            delay = at - (time.perf_counter() - zero)
            if delay > 0:
                await asyncio.sleep(delay)
            session = sessions[index % len(sessions)]
            tasks.append(asyncio.create_task(_session(http, client, session, index, zero, slots)))
            tasks[-1].add_done_callback(lambda t: bar.update(len(t.result())))
        for task in tasks:
            traces.extend(await task)
        duration = time.perf_counter() - zero
        probing.cancel()
    bar.close()
    return LoadResult(traces, duration, len(part.indices), probe.p99_ms)


async def _session(
    http: httpx.AsyncClient,
    client: ClientConfig,
    session: Session,
    index: int,
    zero: float,
    slots: asyncio.Semaphore,
) -> list[RequestTrace]:
    traces = []
    history: list[dict[str, str]] = []
    async with slots:
        for turn, spec in enumerate(session.turns):
            if turn and session.think_s:
                await asyncio.sleep(session.think_s)  # the user reads and types
            trace, reply = await send(http, client, spec, history, zero, session.system)
            trace.session, trace.turn = index, turn
            traces.append(trace)
            if not trace.ok:
                break  # the conversation cannot go on without this reply
            history += [
                {"role": "user", "content": str(spec.prompt)},
                {"role": "assistant", "content": reply},
            ]
    return traces
