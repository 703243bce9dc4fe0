"""Search two-phase workloads for one in which a planner can beat every static split: the
simulator's attainment per split for each candidate phase A (prefill-heavy) and phase B
(decode-heavy) under each node capacity and SLO, then every pairing of them, ranked by what an
ideal planner (the best split of each phase, switches free) gets over the best static split.
Only pairings where every static split misses `--attainment` in some phase and the ideal
planner meets it in both are ranked first.

    python -m scripts.planning.two_phase_search --running 3 --pool-per-stream 1024 \\
        --slo 2000/100 --slo 2000/150 --slo 3000/150

The phases are simulated apart (each from an empty cluster, as `two_phase --predict` does), so
a pairing costs nothing more; the host is the calm 2-core one of `--predict`.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from scripts.planning.profile import NodeProfile
from scripts.planning.sweep import parse_splits
from scripts.planning.two_phase import PROFILE
from scripts.planning.two_phase_predict import CALM_HOST, predict
from scripts.planning.two_phase_score import Phase, Workload
from scripts.serving.metrics import SLO

Attainment = dict[str, float]  # split name -> predicted SLO attainment of one phase


@dataclass(frozen=True)
class Pairing:
    a: Phase
    b: Phase
    a_attainment: Attainment
    b_attainment: Attainment

    def goodput(self, split: str) -> float:
        """Requests meeting the SLO over both phases, per second."""
        met = self.a_attainment[split] * self.a.rate * self.a.duration_s
        met += self.b_attainment[split] * self.b.rate * self.b.duration_s
        return met / (self.a.duration_s + self.b.duration_s)

    @property
    def ideal(self) -> float:
        met = max(self.a_attainment.values()) * self.a.rate * self.a.duration_s
        met += max(self.b_attainment.values()) * self.b.rate * self.b.duration_s
        return met / (self.a.duration_s + self.b.duration_s)

    @property
    def ratio(self) -> float:
        """Ideal planner / best static split (whole run)."""
        best = max(self.goodput(s) for s in self.a_attainment)
        return self.ideal / best if best > 0 else 0.0

    def qualifies(self, attainment: float) -> bool:
        """Every static split misses `attainment` in a phase; the ideal planner meets it in both."""
        splits = self.a_attainment
        miss = all(min(self.a_attainment[s], self.b_attainment[s]) < attainment for s in splits)
        ideal = min(max(self.a_attainment.values()), max(self.b_attainment.values()))
        return miss and ideal >= attainment

    def line(self) -> str:
        cells = " ".join(
            f"{s}: {self.a_attainment[s]:.0%}/{self.b_attainment[s]:.0%}" for s in self.a_attainment
        )
        return (
            f"{self.ratio:.2f}x | A {self.a.input_len}/{self.a.output_len} @ {self.a.rate:g} "
            f"req/s x {self.a.duration_s:g} s | B {self.b.input_len}/{self.b.output_len} @ "
            f"{self.b.rate:g} req/s x {self.b.duration_s:g} s | {cells}"
        )


def rank(pairings: Sequence[Pairing], attainment: float) -> list[Pairing]:
    return sorted(pairings, key=lambda p: (p.qualifies(attainment), p.ratio), reverse=True)


def phase_attainment(profile: NodeProfile, phase: Phase, slo: SLO, seeds: int = 1) -> Attainment:
    """Each split's attainment of one phase, the mean over `seeds` draws of its arrivals and
    lengths: near a cliff one draw can move a split by tens of points."""
    total: Attainment = {}
    for seed in range(seeds):
        workload = Workload((phase,), slo, seed=seed)
        for row in predict(profile, workload, parse_splits("all", 3), CALM_HOST):
            total[row.split] = total.get(row.split, 0.0) + row.attainment[0] / seeds
    return total


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="two_phase_search", description=__doc__.splitlines()[0])
    p.add_argument("--profile", type=Path, default=PROFILE)
    p.add_argument("--running", type=int, nargs="+", default=[3, 4], help="streams per node")
    p.add_argument("--pool-per-stream", type=int, default=1024, help="KV tokens per stream")
    p.add_argument("--slo", action="append", default=None, help="TTFT_MS/TPOT_MS (repeat)")
    p.add_argument("--a-input", type=int, nargs="+", default=[512, 768])
    p.add_argument("--a-rate", type=float, nargs="+", default=[0.4, 0.6, 0.8])
    p.add_argument("--a-output", type=int, nargs="+", default=[4],
                   help="phase A output tokens: a few tokens, or enough that a colocated node's "
                        "prefills interrupt its decoding streams")  # fmt: skip
    p.add_argument("--b-shape", nargs="+", default=["128/256", "256/256", "128/384"],
                   help="IN/OUT tokens")  # fmt: skip
    p.add_argument("--b-rate", type=float, nargs="+", default=[0.15, 0.25, 0.35])
    p.add_argument("--seconds", nargs="+", default=["90/120", "60/120"], help="A_S/B_S")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--seeds", type=int, default=1, help="draws of each phase (mean attainment)")
    p.add_argument("--top", type=int, default=3, help="pairings shown per capacity and SLO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = NodeProfile.load(args.profile)
    for running, slo_text in itertools.product(args.running, args.slo or ["2000/150"]):
        ttft, tpot = (float(x) for x in slo_text.split("/"))
        slo = SLO(ttft_ms=ttft, tpot_ms=tpot)
        pool = running * args.pool_per_stream
        profile = replace(base, max_running_requests=running, max_total_tokens=pool)
        pairings = []
        for seconds in args.seconds:
            a_s, b_s = (float(x) for x in seconds.split("/"))
            a_phases = [Phase("A", a_s, r, n, o) for n, r, o in
                        itertools.product(args.a_input, args.a_rate, args.a_output)]  # fmt: skip
            b_phases = [Phase("B", b_s, r, int(shape.split("/")[0]), int(shape.split("/")[1]))
                        for shape, r in itertools.product(args.b_shape, args.b_rate)]  # fmt: skip
            a_att = [phase_attainment(profile, a, slo, args.seeds) for a in a_phases]
            b_att = [phase_attainment(profile, b, slo, args.seeds) for b in b_phases]
            a_rows = list(zip(a_phases, a_att, strict=True))
            b_rows = list(zip(b_phases, b_att, strict=True))
            pairings += [Pairing(a, b, x, y)
                         for (a, x), (b, y) in itertools.product(a_rows, b_rows)]  # fmt: skip
        print(f"{running} streams a node (pool {pool} tokens), SLO TTFT {ttft:g} ms / TPOT "
              f"{tpot:g} ms:")  # fmt: skip
        for p in rank(pairings, args.attainment)[: args.top]:
            mark = "" if p.qualifies(args.attainment) else " (does not qualify)"
            print(f"  {p.line()}{mark}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
