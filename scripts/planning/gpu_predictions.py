"""The planner's predicted goodput of PD against colocated for 2, 4 and 8 GPUs on three workloads,
from a node profile measured on a GPU (`plan_capacity profile --device cuda`).

    python -m scripts.planning.gpu_predictions \\
        --profile benchmarks/gpu-2026-11-25-two-gpu-h100/profile-8b.json [--gpus 2 4 8]

Workloads (random token prompts, lengths +- 20%, Poisson arrivals for `--duration` seconds):
- chat: 512 tokens in, 256 out;
- rag: 4,096 in, 256 out;
- agent: 8,192 in (6,554 of them the prefix of one of 16 agent sessions: 80% reuse), 128 out.
  The simulator computes a session's prefix once and then only each request's own 1,638
  tokens, as `kv_aware` routing would (scripts/planning/simulator.py).
SLO: TTFT <= 1 s (agent: 2 s) and TPOT <= 20 ms, met by >= 90% of the requests. Each split of
the GPU budget (every P:D, and colocated) is bisected for its highest such rate; the table gives
colocated's, the best disaggregated split's and their ratio. Nodes have one GPU each (no
sharing); the host's own work is not modelled (`--host-cores 0`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.planning.planner import max_rate
from scripts.planning.profile import NodeProfile
from scripts.planning.simulator import HostConfig
from scripts.planning.sweep import Split, parse_splits
from scripts.serving.datasets import DatasetConfig
from scripts.serving.load import LoadConfig
from scripts.serving.metrics import SLO


@dataclass(frozen=True)
class Workload:
    name: str
    dataset: DatasetConfig
    slo: SLO

    def describe(self) -> str:
        d = self.dataset
        prompt = d.input_len + (d.prefix_len if d.name == "prefix" else 0)
        reuse = f", {d.prefix_len / prompt:.0%} shared prefix" if d.name == "prefix" else ""
        return f"{prompt} in / {d.output_len} out{reuse}"


AGENT_SESSIONS = 16  # concurrent agent sessions, each its own shared prefix


def workloads(sessions: int) -> list[Workload]:
    slo = SLO(ttft_ms=1000.0, tpot_ms=20.0)
    return [
        Workload(
            "chat",
            DatasetConfig("random", sessions, input_len=512, output_len=256, range_ratio=0.2),
            slo,
        ),
        Workload(
            "rag",
            DatasetConfig("random", sessions, input_len=4096, output_len=256, range_ratio=0.2),
            slo,
        ),
        Workload(
            "agent",
            DatasetConfig(
                "prefix",
                sessions,
                input_len=1638,
                output_len=128,
                prefix_len=6554,
                prefix_group_size=sessions // AGENT_SESSIONS,
                range_ratio=0.2,
            ),
            SLO(ttft_ms=2000.0, tpot_ms=20.0),
        ),
    ]


def predict(profile: NodeProfile, workload: Workload, gpus: int, duration: float,
            attainment: float) -> dict[Split, float]:  # fmt: skip
    load = LoadConfig(request_rate=1.0, num_sessions=None, duration_s=duration)
    high = 60.0 * gpus  # req/s: above what any split of this budget sustains here
    return {
        split: max_rate(
            profile, split, workload.dataset, load, workload.slo, HostConfig(), attainment, high
        )
        for split in parse_splits("all", gpus)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--gpus", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--slo-attainment", type=float, default=0.9)
    parser.add_argument("--workloads", nargs="+", default=["chat", "rag", "agent"])
    args = parser.parse_args()
    profile = NodeProfile.load(args.profile)
    lines = [
        "| workload | GPUs | colocated max rate | best PD split | its max rate | PD / colocated "
        "| every split (req/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload in (w for w in workloads(sessions=4096) if w.name in args.workloads):
        for gpus in args.gpus:
            started = time.monotonic()
            rates = predict(profile, workload, gpus, args.duration, args.slo_attainment)
            colocated = rates[Split(0, gpus)]
            pd_split, pd_rate = max(
                ((s, r) for s, r in rates.items() if not s.colocated), key=lambda sr: sr[1]
            )
            ratio = f"{pd_rate / colocated:.2f}x" if colocated > 0 else "-"
            every = ", ".join(f"{s.name} {r:.1f}" for s, r in rates.items())
            lines.append(f"| {workload.name}: {workload.describe()} | {gpus} | {colocated:.1f} "
                         f"| {pd_split.name} | {pd_rate:.1f} | {ratio} | {every} |")  # fmt: skip
            print(lines[-1], f"({time.monotonic() - started:.0f} s)", flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
