"""Concurrency: sends the sessions of a workload at their arrival times (planner/arrivals.py)
and collects their traces.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from planner.arrivals import LoadConfig, LoadError, schedule
from planner.datasets import Session
from planner.metrics import RequestTrace, percentile

from .client import ClientConfig, send


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
