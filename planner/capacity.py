"""The planner's pieces on top of the simulator: workloads as arrivals, max rates, validation."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .arrivals import LoadConfig, arrival_gaps
from .datasets import SHAPES, DatasetConfig, build_sessions, build_shapes
from .metrics import SLO, Summary, summarize
from .profile import NodeProfile
from .simulator import Arrival, HostConfig, Simulation
from .splits import Split


class PlanError(ValueError):
    """Planner input that cannot be simulated; the message names the option."""


def _shapes(dataset: DatasetConfig) -> tuple[tuple[int, int, int], ...]:
    """(prompt_len, output_len, prefix group) of each of the dataset's sessions. A generated
    dataset's are kept: the planner simulates one at many rates and splits (a prefix dataset's
    shapes still draw its token ids, to keep the generator's order)."""
    return _generated_shapes(dataset) if dataset.path is None else _build_shapes(dataset)


def _build_shapes(dataset: DatasetConfig) -> tuple[tuple[int, int, int], ...]:
    if dataset.name in SHAPES:  # without building the prompts
        return tuple(build_shapes(dataset))
    sessions = build_sessions(dataset)
    if any(len(s.turns) != 1 for s in sessions):
        raise PlanError("the simulator models single-turn requests: not --dataset multiturn")
    return tuple((s.turns[0].prompt_len, s.turns[0].output_len, s.group) for s in sessions)


_generated_shapes = functools.lru_cache(maxsize=8)(_build_shapes)


def arrivals(dataset: DatasetConfig, load: LoadConfig) -> list[Arrival]:
    """The arrivals bench_serving would make for this workload (same seed, same lengths)."""
    shapes = _shapes(dataset)
    gaps = arrival_gaps(load.request_rate, load.burstiness, np.random.default_rng(load.seed))
    out: list[Arrival] = []
    seen: set[int] = set()  # prefix groups already prefilled once
    at = 0.0
    while load.num_sessions is None or len(out) < load.num_sessions:
        at += next(gaps)
        if load.duration_s is not None and at >= load.duration_s:
            break
        prompt_len, output_len, group = shapes[len(out) % len(shapes)]
        cached = 0
        if dataset.name == "prefix":  # the group's shared prefix, cached after its first use
            cached = dataset.prefix_len if group in seen else 0
            seen.add(group)
        out.append(Arrival(at, prompt_len, output_len, cached))
    return out


@dataclass(frozen=True)
class SimOutcome:
    summary: Summary
    retractions: int  # on every node over the whole simulated run, warm-up included
    recomputed_tokens: int  # prefilled again after those retractions


def simulate(
    profile: NodeProfile,
    split: Split,
    dataset: DatasetConfig,
    load: LoadConfig,
    slo: SLO,
    host: HostConfig,
    score_after_s: float = 0.0,
) -> Summary:
    """The simulated run's summary. With `score_after_s`, only the requests that arrive from
    then on are scored (the earlier ones fill the queues and batches: a steady state, where a
    run from an empty cluster flatters an overloaded split)."""
    return simulate_outcome(profile, split, dataset, load, slo, host, score_after_s).summary


def simulate_outcome(
    profile: NodeProfile,
    split: Split,
    dataset: DatasetConfig,
    load: LoadConfig,
    slo: SLO,
    host: HostConfig,
    score_after_s: float = 0.0,
) -> SimOutcome:
    """`simulate`'s summary with the run's retractions beside it."""
    sim = Simulation(profile, split.prefill, split.decode, host, load.max_concurrency)
    traces = sim.run(arrivals(dataset, load))
    scored = [t for t in traces if t.sent >= score_after_s] or traces[-1:]
    duration = max(t.done for t in scored) - min(score_after_s, min(t.sent for t in scored))
    summary = summarize(scored, max(duration, 1e-9), slo)
    recomputed = sum(node.recomputed_tokens for node in sim.nodes)
    return SimOutcome(summary, sim.retractions, recomputed)


def max_rate(
    profile: NodeProfile,
    split: Split,
    dataset: DatasetConfig,
    load: LoadConfig,
    slo: SLO,
    host: HostConfig,
    attainment: float,
    high: float,
    iterations: int = 12,
) -> float:
    """Bisection for the highest rate with >= attainment of the requests meeting the SLOs."""

    def ok(rate: float) -> bool:
        s = simulate(profile, split, dataset, replace(load, request_rate=rate), slo, host)
        return (s.slo_attainment or 0.0) >= attainment

    low = 0.0
    if ok(high):
        return high
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def workload_from_settings(settings: dict[str, Any]) -> tuple[DatasetConfig, LoadConfig, SLO]:
    """The dataset, load and SLOs of a bench_serving / tune_ratio JSON's settings."""
    try:
        fields = DatasetConfig.__dataclass_fields__
        raw = {k: settings[k] for k in fields if k in settings and k != "path"}
        raw["num_sessions"] = raw.get("num_sessions") or 1000
        dataset = DatasetConfig(**raw)
        load = LoadConfig(
            request_rate=1.0,
            burstiness=float(settings.get("burstiness", 1.0)),
            max_concurrency=settings.get("max_concurrency"),
            num_sessions=settings.get("num_sessions"),
            duration_s=settings.get("duration_s"),
            seed=int(settings.get("seed", 0)),
        )
        slo = SLO(settings.get("ttft_ms"), settings.get("tpot_ms"), settings.get("e2e_ms"))
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"the measured file's settings do not describe a workload: {exc}") from None
    return dataset, load, slo


@dataclass
class Comparison:
    split: Split
    rate: float
    runs: tuple[float, ...]  # measured goodput (req/s) of each repeated run
    predicted: float
    band: tuple[float, float] | None = None  # predicted with every step slower / faster

    def fragile(self, target: float) -> bool:
        """The prediction moves by more than `target` within its speed band: a profile that
        far off (noise, another hour on a shared host) changes the answer."""
        if self.band is None:
            return False
        ref = max(self.predicted, 1e-9)
        return max(abs(b - self.predicted) for b in self.band) / ref > target

    @property
    def measured(self) -> float:
        return float(np.mean(self.runs))

    @property
    def spread(self) -> float | None:
        """(max - min) / mean of the repeated runs: how far the measurement itself moves."""
        if len(self.runs) < 2 or self.measured <= 0:
            return None
        return (max(self.runs) - min(self.runs)) / self.measured

    @property
    def error(self) -> float | None:
        """Relative error of the prediction against the runs' mean (None: nothing measured)."""
        if self.measured <= 0:
            return None if self.predicted <= 0 else math.inf
        return (self.predicted - self.measured) / self.measured


def _percent(value: float | None) -> str:
    if value is None:
        return "n/a"
    return "inf" if math.isinf(value) else f"{value:+.0%}"


def comparison_table(rows: Sequence[Comparison], target: float) -> str:
    runs = max(len(r.runs) for r in rows)
    banded = any(r.band is not None for r in rows)
    lines = [
        f"{'split':<14}{'rate':>7}{'measured':>10}{'runs (min-max)':>16}{'spread':>8}"
        f"{'predicted':>11}{'error':>9}" + (f"{'speed band':>14}" if banded else ""),
        "-" * (89 if banded else 75),
    ]
    for row in rows:
        shown = f"{min(row.runs):.3f}-{max(row.runs):.3f}" if runs > 1 else ""
        spread = "" if row.spread is None else f"{row.spread:.0%}"
        band = "" if row.band is None else f"{min(row.band):.3f}-{max(row.band):.3f}"
        lines.append(
            f"{row.split.name:<14}{row.rate:>7.2f}{row.measured:>10.3f}{shown:>16}{spread:>8}"
            f"{row.predicted:>11.3f}{_percent(row.error):>9}" + (f"{band:>14}" if banded else "")
        )
    errors = [abs(r.error) for r in rows if r.error is not None and math.isfinite(r.error)]
    if errors:
        within = sum(1 for e in errors if e <= target)
        lines.append(
            f"mean |error| {np.mean(errors):.1%}, max {max(errors):.1%}; "
            f"{within}/{len(errors)} points within {target:.0%} (of the mean of {runs} run(s))"
        )
    repeatable = [r for r in rows if r.spread is not None and r.spread <= target]
    if runs > 1 and repeatable:
        errs = [abs(r.error) for r in repeatable if r.error is not None]
        lines.append(
            f"points whose runs agree within {target:.0%}: {len(repeatable)}; there mean "
            f"|error| {np.mean(errs):.1%}, {sum(e <= target for e in errs)}/{len(errs)} within "
            f"{target:.0%}"
        )
    if banded:
        fragile = sum(r.fragile(target) for r in rows)
        lines.append(
            f"points whose prediction moves more than {target:.0%} within the speed band: "
            f"{fragile}/{len(rows)}"
        )
    return "\n".join(lines)


def calibrate_slowdown(
    profile: NodeProfile,
    split: Split,
    dataset: DatasetConfig,
    load: LoadConfig,
    host: HostConfig,
    measured_e2e_ms: float,
    iterations: int = 20,
) -> float:
    """The step-time factor that makes the simulated mean E2E equal the measured one.

    Calibrates the profile (taken on an idle host, in-process) to the host as it was during a
    real run (other load, the gateway and the client on the same cores). Mean E2E grows with
    the factor, so a bisection on log(factor) in [1/8, 16] finds it.
    """
    low, high = math.log(1 / 8), math.log(16)
    for _ in range(iterations):
        mid = (low + high) / 2
        trial = replace(host, slowdown=math.exp(mid))
        e2e = simulate(profile, split, dataset, load, SLO(), trial).e2e_ms.mean
        low, high = (mid, high) if e2e < measured_e2e_ms else (low, mid)
    return math.exp((low + high) / 2)
