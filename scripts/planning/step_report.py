"""A node's step trace (`--step-trace-dir`, engine/step_trace.py) against its profile.

Per node and step kind (prefill only, decode only, mixed), the measured mean step time next to
what the profile predicts for the same composition (prefill tokens, decode batch and mean
context): a ratio above 1 is time the simulator does not see (cores shared with other nodes,
host threads), one near 1 says the steps are right and any error is in the queues.

With several nodes' traces of one run (one host, one wall clock), a second table splits each
node's steps by how many other nodes were stepping beside them: fair sharing of c cores among
k + 1 stepping single-threaded nodes predicts a ratio of max(1, (k + 1) / c); a wide p90 there
is the tail a fair-share model does not have.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from planner.profile import NodeProfile

KINDS = ("prefill", "decode", "mixed")


class TraceError(ValueError):
    """A step trace that is missing or not one JSON object per line."""


@dataclass(frozen=True)
class Step:
    start: float
    prefill_chunks: tuple[tuple[int, int], ...]
    decode_reqs: int
    decode_context: int
    forward_s: float
    step_s: float

    @property
    def prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefill_chunks)

    @property
    def kind(self) -> str:
        if self.prefill_tokens and self.decode_reqs:
            return "mixed"
        return "prefill" if self.prefill_tokens else "decode"

    def predicted_s(self, profile: NodeProfile) -> float:
        context = self.decode_context / self.decode_reqs if self.decode_reqs else 0.0
        return profile.mixed_s(self.prefill_chunks, self.decode_reqs, context)


@dataclass
class KindSummary:
    kind: str
    steps: int = 0
    prefill_tokens: int = 0
    decode_reqs: int = 0
    step_s: float = 0.0
    forward_s: float = 0.0
    predicted_s: float = 0.0

    def add(self, step: Step, profile: NodeProfile) -> None:
        self.steps += 1
        self.prefill_tokens += step.prefill_tokens
        self.decode_reqs += step.decode_reqs
        self.step_s += step.step_s
        self.forward_s += step.forward_s
        self.predicted_s += step.predicted_s(profile)

    @property
    def ratio(self) -> float:
        """Measured / predicted step time."""
        return self.step_s / self.predicted_s if self.predicted_s > 0 else float("nan")


def read_trace(path: Path) -> list[Step]:
    steps = []
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"step trace {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        try:
            raw = json.loads(line)
            steps.append(
                Step(
                    start=float(raw["start"]),
                    prefill_chunks=tuple((int(n), int(p)) for n, p in raw["prefill_chunks"]),
                    decode_reqs=int(raw["num_decode_reqs"]),
                    decode_context=int(raw["decode_context"]),
                    forward_s=float(raw["forward_s"]),
                    step_s=float(raw["step_s"]),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            msg = f"step trace {path} line {number}: not a step record ({exc})"
            raise TraceError(msg) from None
    return steps


def summarize_steps(steps: Iterable[Step], profile: NodeProfile) -> list[KindSummary]:
    by_kind = {kind: KindSummary(kind) for kind in KINDS}
    for step in steps:
        by_kind[step.kind].add(step, profile)
    return [s for s in by_kind.values() if s.steps]


def busy_fraction(steps: list[Step]) -> float:
    """Share of the trace's span (first step start to last step end) spent inside steps."""
    if not steps:
        return 0.0
    span = steps[-1].start + steps[-1].step_s - steps[0].start
    return sum(s.step_s for s in steps) / span if span > 0 else 1.0


def others_stepping(step: Step, others: Iterable[list[Step]]) -> float:
    """How many of the other nodes were inside a step while `step` ran (mean over it)."""
    start, end = step.start, step.start + step.step_s
    if end <= start:
        return 0.0
    overlap = sum(
        max(0.0, min(end, o.start + o.step_s) - max(start, o.start)) for t in others for o in t
    )
    return overlap / (end - start)


def company_report(traces: dict[str, list[Step]], profile: NodeProfile) -> str:
    """Measured / profiled step time per node, kind and number of other nodes stepping."""
    lines = [
        f"{'node':<22}{'kind':<9}{'others':>7}{'steps':>6}{'ratio':>7}{'p90':>7}",
        "-" * 58,
    ]
    for name, steps in sorted(traces.items()):
        others = [t for other, t in traces.items() if other != name]
        groups: dict[tuple[str, int], list[float]] = defaultdict(list)
        for step in steps:
            predicted = step.predicted_s(profile)
            if predicted > 0:
                company = round(others_stepping(step, others))
                groups[(step.kind, company)].append(step.step_s / predicted)
        for (kind, company), ratios in sorted(groups.items()):
            ratios.sort()
            mean = sum(ratios) / len(ratios)
            p90 = ratios[int(0.9 * (len(ratios) - 1))]
            lines.append(f"{name:<22}{kind:<9}{company:>7}{len(ratios):>6}{mean:>7.2f}{p90:>7.2f}")
    return "\n".join(lines)


def report(traces: dict[str, list[Step]], profile: NodeProfile) -> str:
    lines = [
        f"{'node':<22}{'kind':<9}{'steps':>6}{'tok/step':>9}{'batch':>7}"
        f"{'step ms':>9}{'fwd ms':>8}{'profile ms':>11}{'ratio':>7}",
        "-" * 88,
    ]
    for name, steps in sorted(traces.items()):
        for s in summarize_steps(steps, profile):
            n = s.steps
            lines.append(
                f"{name:<22}{s.kind:<9}{n:>6}{s.prefill_tokens / n:>9.0f}{s.decode_reqs / n:>7.1f}"
                f"{s.step_s / n * 1e3:>9.1f}{s.forward_s / n * 1e3:>8.1f}"
                f"{s.predicted_s / n * 1e3:>11.1f}{s.ratio:>7.2f}"
            )
        lines.append(f"{name:<22}busy {busy_fraction(steps):.0%} of its span")
    if len(traces) > 1:
        lines += ["", "by the number of other nodes stepping beside the step:"]
        lines.append(company_report(traces, profile))
    return "\n".join(lines)
