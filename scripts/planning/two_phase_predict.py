"""What the simulator predicts for the two-phase benchmark: each split's SLO attainment per phase,
and the best a planner could do (the best split of each phase, switches free) against the best
static split over the whole run. The calibration aid of `two_phase --predict`: it runs in
seconds where the measured benchmark takes twenty minutes.

The host model defaults to the one validated against five sweeps on this 2-core CPU
(benchmarks/serving-2026-11-24.md: 8.0% mean goodput error): processor sharing of 2 cores, host
work of 1.60 ms (colocated) / 2.37 ms (with prefill nodes) per streamed token, every step 1.15x
the in-process profile and 10% slower per other step in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scripts.planning.planner import simulate_outcome
from scripts.planning.profile import NodeProfile
from scripts.planning.simulator import HostConfig
from scripts.planning.sweep import Split
from scripts.planning.two_phase_score import Workload
from scripts.serving.datasets import DatasetConfig
from scripts.serving.load import LoadConfig

CALM_HOST = HostConfig(host_cores=2, threads_per_node=1, slowdown=1.15,
                       overhead_s_per_token=1.60e-3, pd_overhead_s_per_token=2.37e-3,
                       co_runner=0.10)  # fmt: skip


@dataclass(frozen=True)
class Prediction:
    split: str
    attainment: tuple[float, ...]  # per phase
    retractions: tuple[int, ...] = ()  # per phase: requests its nodes retracted (KV short)
    recomputed: tuple[int, ...] = ()  # per phase: tokens prefilled again after them

    def goodput(self, workload: Workload) -> float:
        """Requests meeting the SLO per second over the whole run."""
        met = sum(a * p.rate * p.duration_s for a, p in zip(self.attainment, workload.phases,
                                                               strict=True))  # fmt: skip
        return met / workload.total_s


def predict(profile: NodeProfile, workload: Workload, splits: Sequence[Split],
            host: HostConfig) -> list[Prediction]:  # fmt: skip
    rows = []
    for split in splits:
        attainment, retractions, recomputed = [], [], []
        for i, phase in enumerate(workload.phases):
            dataset = DatasetConfig("random", 1000, seed=workload.seed + 1000 * (i + 1),
                                    input_len=phase.input_len, output_len=phase.output_len,
                                    range_ratio=phase.range_ratio)  # fmt: skip
            load = LoadConfig(phase.rate, num_sessions=None, duration_s=phase.duration_s,
                              seed=workload.seed + i)  # fmt: skip
            outcome = simulate_outcome(profile, split, dataset, load, workload.slo, host)
            attainment.append(float(outcome.summary.slo_attainment or 0.0))
            retractions.append(outcome.retractions)
            recomputed.append(outcome.recomputed_tokens)
        rows.append(Prediction(split.name, tuple(attainment), tuple(retractions),
                               tuple(recomputed)))  # fmt: skip
    return rows


def prediction_table(rows: Sequence[Prediction], workload: Workload) -> str:
    names = " | ".join(p.name for p in workload.phases)
    lines = [f"| split | {names} | whole-run goodput req/s | retractions per phase "
             "(tokens prefilled again) |",
             "|---|" + "---:|" * (len(workload.phases) + 2)]  # fmt: skip
    for row in rows:
        cells = " | ".join(f"{a:.0%}" for a in row.attainment)
        retracted = " / ".join(f"{n} ({t})" for n, t in zip(row.retractions, row.recomputed,
                                                               strict=True)) or "-"  # fmt: skip
        lines.append(f"| {row.split} | {cells} | {row.goodput(workload):.3f} | {retracted} |")
    best_static = max(r.goodput(workload) for r in rows)
    ideal = Prediction("ideal planner", tuple(max(r.attainment[i] for r in rows)
                                              for i in range(len(workload.phases))))  # fmt: skip
    cells = " | ".join(f"{a:.0%}" for a in ideal.attainment)
    lines.append(f"| best split per phase, switches free | {cells} | "
                 f"{ideal.goodput(workload):.3f} | |")  # fmt: skip
    lines.append("")
    lines.append(f"ideal planner / best static split: {ideal.goodput(workload) / best_static:.2f}x")
    return "\n".join(lines)
