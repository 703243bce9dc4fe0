"""Ratio sweeps: one cluster shape (P:D split or colocated) x a list of request rates.

`SplitResult.max_rate` is the highest swept rate at which at least `attainment` of the requests
met every SLO (the usual "max goodput rate" of disaggregation papers); `best_split` ranks the
splits by it, then by the goodput measured at that rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from planner.metrics import Summary
from planner.splits import Split, SplitError


def parse_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(sorted(float(x) for x in text.split(",")))
    except ValueError:
        raise SplitError(f"--rates must be numbers separated by commas, got {text!r}") from None
    if not rates or rates[0] <= 0:
        raise SplitError(f"--rates must be positive request rates, got {text!r}")
    return rates


@dataclass
class RatePoint:
    rate: float
    summary: Summary
    seed: int = 0  # the dataset seed of this rate's prompts
    # (TTFT ms, TPOT ms) of each completed request, to score the run under other SLOs later
    requests: list[tuple[float | None, float | None]] = field(default_factory=list)

    @property
    def attainment(self) -> float:
        return self.summary.slo_attainment or 0.0

    @property
    def goodput(self) -> float:
        return self.summary.goodput or 0.0


@dataclass
class SplitResult:
    split: Split
    points: list[RatePoint] = field(default_factory=list)
    error: str = ""  # the cluster did not start, or the sweep broke

    def max_rate(self, attainment: float) -> float:
        """Highest swept rate meeting the SLO attainment (0 when none does)."""
        rates = [p.rate for p in self.points if p.attainment >= attainment]
        return max(rates, default=0.0)

    def goodput_at(self, rate: float) -> float:
        return next((p.goodput for p in self.points if p.rate == rate), 0.0)

    def to_json(self, attainment: float) -> dict[str, Any]:
        return {
            "split": asdict(self.split),
            "name": self.split.name,
            "error": self.error,
            "max_rate": self.max_rate(attainment),
            "points": [
                {
                    "rate": p.rate,
                    "seed": p.seed,
                    "summary": asdict(p.summary),
                    "requests_ttft_tpot_ms": p.requests,
                }
                for p in self.points
            ],
        }


def best_split(results: Sequence[SplitResult], attainment: float) -> SplitResult | None:
    ok = [r for r in results if r.points and r.max_rate(attainment) > 0]
    if not ok:
        return None
    return max(ok, key=lambda r: (r.max_rate(attainment), r.goodput_at(r.max_rate(attainment))))


def sweep_table(results: Sequence[SplitResult], attainment: float) -> str:
    head = (
        f"{'split':<14}{'rate':>7}{'req/s':>8}{'goodput':>9}{'SLO met':>9}"
        f"{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'errors':>8}"
    )
    lines = [head, "-" * len(head)]
    for result in results:
        if result.error:
            lines.append(f"{result.split.name:<14}  error: {result.error}")
        for p in result.points:
            s = p.summary
            lines.append(
                f"{result.split.name:<14}{p.rate:>7.2f}{s.request_throughput:>8.2f}"
                f"{p.goodput:>9.2f}{p.attainment:>9.0%}{s.ttft_ms.median:>10.0f}"
                f"{s.ttft_ms.p99:>10.0f}{s.tpot_ms.median:>10.0f}{s.tpot_ms.p99:>10.0f}"
                f"{s.failed:>8}"
            )
    lines.append("")
    for result in results:
        rate = result.max_rate(attainment)
        lines.append(
            f"{result.split.name:<14} max rate with >= {attainment:.0%} meeting the SLOs: "
            + (f"{rate:g} req/s (goodput {result.goodput_at(rate):.2f})" if rate else "none")
        )
    best = best_split(results, attainment)
    lines.append(f"best split: {best.split.name if best else 'none meets the SLOs'}")
    return "\n".join(lines)


def plot_goodput(results: Sequence[SplitResult], path: Any, title: str) -> None:
    from scripts.serving.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for result in results:
        if result.points:
            rates = [p.rate for p in result.points]
            ax.plot(rates, [p.goodput for p in result.points], marker="o", label=result.split.name)
    top = max((p.rate for r in results for p in r.points), default=1.0)
    ax.plot([0, top], [0, top], color="grey", linestyle=":", label="offered rate")
    ax.set(title=title, xlabel="request rate (req/s)", ylabel="goodput (req/s)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
