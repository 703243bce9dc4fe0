"""The pure parts of the two-phase benchmark (scripts/planning/two_phase.py): the workload's
schedule, each run's score per phase, and the planner's predicted vs measured goodput per window.

- Schedule: each phase is `duration_s` of Poisson arrivals at `rate` (planner/arrivals.py's
  `arrival_times`, seed + phase index) of random-token prompts (planner/datasets.py,
  its own seed per phase, so no phase is served from another's prefix cache); the sessions carry
  their arrival times, so the load tool sends them as a trace.
- Score: a request belongs to the phase it was scheduled in; it meets the SLO when it completed
  and its TTFT and its TPOT both met theirs (`RequestTrace.meets`). Attainment = met / scheduled;
  goodput = met / the phase's seconds (the same denominator for every run, so runs compare);
  lost = scheduled requests that did not complete (an error, or no trace at all).
- Prediction error: one window per planner decision (its JSON line: the window's end `at` on the
  monotonic clock, its `window.seconds`, `window.rate`, the live split and `predicted_goodput`).
  Both sides count the requests *admitted* in the window: predicted goodput = the live split's
  steady-state SLO attainment at the window's measured rate and lengths x that rate (the
  planner's `predicted_goodput`; from lines without it, the live split's `predicted`
  attainment x the rate, equal when the planner runs with headroom 1, as the benchmark does);
  measured goodput = the client's requests sent in the window that met the SLO once they
  finished (or never did: lost), per second of the window. So a window is scored after its
  requests complete, not by the completions inside it (which trail the admissions by a
  request's life: up to several windows).
  Not every window is a steady state. A window is *transient* when it overlaps the first
  `settle_s` seconds after a switch the planner acted on (at its decision's `at`) or after a
  phase boundary: its requests met a split or a backlog that the window's rate did not make.
  It is *empty* when the client sent nothing in it. The mean |error| is over the other
  windows, and says how many it left out and why; a window in which nothing met the SLO is
  exact when 0 was predicted too, and unbounded (counted apart) otherwise.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from planner.arrivals import LoadConfig, arrival_times
from planner.datasets import DatasetConfig, Session, build_sessions
from planner.metrics import SLO, RequestTrace, percentile

GOAL_ATTAINMENT = 0.9  # issue 20: the planner keeps >= 90% of requests within the SLO


class TwoPhaseError(ValueError):
    """Options or records the benchmark cannot use; the message names the flag or the line."""


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    rate: float  # requests per second, Poisson
    input_len: int  # mean prompt tokens
    output_len: int  # mean output tokens (sent with ignore_eos: exact)
    range_ratio: float = 0.25  # lengths uniform in mean x (1 +- ratio)

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and self.rate > 0):
            raise TwoPhaseError(f"phase {self.name}: duration and rate must be > 0")


@dataclass(frozen=True)
class Workload:
    phases: tuple[Phase, ...]
    slo: SLO
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.phases:
            raise TwoPhaseError("a workload needs at least one phase")
        if self.slo.ttft_ms is None or self.slo.tpot_ms is None:
            raise TwoPhaseError("give both --slo-ttft-ms and --slo-tpot-ms")

    @property
    def total_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def start_of(self, index: int) -> float:
        return sum(p.duration_s for p in self.phases[:index])


@dataclass(frozen=True)
class Schedule:
    """Every request of the run, sorted by arrival: its session (with `arrival_s`) and phase."""

    sessions: tuple[Session, ...]
    phase_of: tuple[int, ...]  # index into Workload.phases, per session

    @property
    def times(self) -> list[float]:
        return [float(s.arrival_s or 0.0) for s in self.sessions]


def build_schedule(workload: Workload) -> Schedule:
    pairs: list[tuple[Session, int]] = []
    for index, phase in enumerate(workload.phases):
        load = LoadConfig(phase.rate, num_sessions=None, duration_s=phase.duration_s,
                          seed=workload.seed + index)  # fmt: skip
        times = arrival_times(load)
        if not times:
            continue
        dataset = DatasetConfig("random", len(times), seed=workload.seed + 1000 * (index + 1),
                                input_len=phase.input_len, output_len=phase.output_len,
                                range_ratio=phase.range_ratio)  # fmt: skip
        start = workload.start_of(index)
        for at, session in zip(times, build_sessions(dataset), strict=True):
            pairs.append((replace(session, arrival_s=start + at), index))
    pairs.sort(key=lambda p: float(p[0].arrival_s or 0.0))
    return Schedule(tuple(s for s, _ in pairs), tuple(i for _, i in pairs))


# -- scores ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Score:
    """One phase of one run (or the whole run: phase "all")."""

    phase: str
    seconds: float
    scheduled: int
    completed: int
    met: int
    lost: int  # scheduled and not completed
    errors: dict[str, int] = field(default_factory=dict)
    ttft_p90_ms: float | None = None
    tpot_p90_ms: float | None = None

    @property
    def attainment(self) -> float:
        return self.met / self.scheduled if self.scheduled else 0.0

    @property
    def goodput(self) -> float:
        return self.met / self.seconds

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "attainment": self.attainment, "goodput": self.goodput}


def _p90_ms(values: Sequence[float | None]) -> float | None:
    present = [v * 1000 for v in values if v is not None]
    return round(percentile(present, 90), 1) if present else None


def score_phase(name: str, seconds: float, scheduled: int, traces: Sequence[RequestTrace],
                slo: SLO) -> Score:  # fmt: skip
    ok = [t for t in traces if t.ok]
    return Score(
        phase=name,
        seconds=seconds,
        scheduled=scheduled,
        completed=len(ok),
        met=sum(1 for t in traces if t.meets(slo)),
        lost=scheduled - len(ok),
        errors=dict(Counter(t.error for t in traces if not t.ok)),
        ttft_p90_ms=_p90_ms([t.ttft for t in ok]),
        tpot_p90_ms=_p90_ms([t.tpot for t in ok]),
    )


def score_run(workload: Workload, schedule: Schedule,
              traces: Sequence[RequestTrace]) -> list[Score]:  # fmt: skip
    """One score per phase, then the whole run's ("all"); a trace's `session` is its index in
    the schedule."""
    by_phase: list[list[RequestTrace]] = [[] for _ in workload.phases]
    for trace in traces:
        by_phase[schedule.phase_of[trace.session]].append(trace)
    counts = Counter(schedule.phase_of)
    scores = [
        score_phase(p.name, p.duration_s, counts[i], by_phase[i], workload.slo)
        for i, p in enumerate(workload.phases)
    ]
    scores.append(score_phase("all", workload.total_s, len(schedule.sessions), traces,
                              workload.slo))  # fmt: skip
    return scores


# -- the planner's windows -------------------------------------------------------------------


@dataclass(frozen=True)
class WindowCheck:
    """One planner window, scored by the requests admitted in it."""

    start_s: float  # seconds since the load began
    end_s: float
    split: str  # live at the window's end
    rate: float  # requests admitted per second (the planner's, from the gateway's metrics)
    predicted_goodput: float | None  # the planner's, for the requests admitted in the window
    sent: int  # requests the client sent in the window
    met: int  # of those, the ones that met the SLO (scored once they finished)
    transient: str = ""  # why the window is no steady state ("" if it is)

    @property
    def measured_goodput(self) -> float:
        return self.met / (self.end_s - self.start_s)

    @property
    def empty(self) -> bool:
        return self.sent == 0

    @property
    def scored(self) -> bool:
        """In the mean error: a steady-state window with requests and a prediction."""
        return not self.transient and not self.empty and self.predicted_goodput is not None

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured; 0 when both are 0; None when it is unbounded
        (nothing met the SLO, some was predicted to) or there is no prediction."""
        if self.predicted_goodput is None:
            return None
        if self.measured_goodput <= 0:
            return 0.0 if self.predicted_goodput <= 1e-9 else None
        return (self.predicted_goodput - self.measured_goodput) / self.measured_goodput

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "measured_goodput": self.measured_goodput, "error": self.error,
                "scored": self.scored}  # fmt: skip


def read_decisions(text: str) -> list[dict[str, Any]]:
    """The planner's stdout: one JSON object a line (blank lines skipped)."""
    decisions = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            for value in (doc["at"], doc["window"]["seconds"], doc["window"]["rate"]):
                float(value)  # a number, or ValueError / TypeError
            if not isinstance(doc["predicted"], dict) or not isinstance(doc["current"], str):
                raise TypeError("'predicted' must be an object and 'current' a split name")
        except (ValueError, KeyError, TypeError) as exc:
            raise TwoPhaseError(f"planner output line {n} is not a decision ({exc})") from None
        decisions.append(doc)
    return decisions


def predicted_goodput(decision: dict[str, Any]) -> float | None:
    """The planner's prediction for its window's own requests (see the module's docstring)."""
    if "predicted_goodput" in decision:
        value = decision["predicted_goodput"]
        return None if value is None else float(value)
    attainment = decision["predicted"].get(str(decision["current"]))
    return None if attainment is None else float(attainment) * float(decision["window"]["rate"])


def window_checks(decisions: Sequence[dict[str, Any]], traces: Sequence[RequestTrace],
                  zero: float, end_s: float, slo: SLO, boundaries: Sequence[float] = (),
                  settle_s: float = 15.0) -> list[WindowCheck]:  # fmt: skip
    """A check per decision whose window lies inside [0, end_s] of the load (`zero`: the load's
    start on the planner's clock; a trace's `sent` is on the load's clock). `boundaries`: when
    a phase began (s since the load began); a window overlapping the `settle_s` after one, or
    after a switch the planner acted on, is transient."""
    switches = [float(d["at"]) - zero for d in decisions if d.get("acted")]
    checks = []
    for d in decisions:
        end = float(d["at"]) - zero
        start = end - float(d["window"]["seconds"])
        if start < 0 or end > end_s:
            continue
        sent = [t for t in traces if start < t.sent <= end]
        why = [f"switch at {at:.0f} s" for at in switches if start < at + settle_s and at < end]
        why += [f"phase at {at:.0f} s" for at in boundaries if start < at + settle_s and at < end]
        checks.append(WindowCheck(start, end, str(d["current"]), float(d["window"]["rate"]),
                                  predicted_goodput(d), len(sent),
                                  sum(1 for t in sent if t.meets(slo)),
                                  "; ".join(why)))  # fmt: skip
    return checks


def mean_abs_error(checks: Sequence[WindowCheck]) -> float | None:
    """Over the scored windows (steady state, not empty) whose error is bounded."""
    errors = [abs(e) for c in checks if c.scored and (e := c.error) is not None]
    return sum(errors) / len(errors) if errors else None


def error_summary(checks: Sequence[WindowCheck]) -> str:
    """The mean |error| and what it leaves out."""
    mae = mean_abs_error(checks)
    scored = [c for c in checks if c.scored]
    unbounded = [c for c in scored if c.error is None]
    transient = [c for c in checks if c.transient and not c.empty]
    empty = [c for c in checks if c.empty]
    predicted = sum(c.predicted_goodput or 0.0 for c in scored)
    measured = sum(c.measured_goodput for c in scored)
    total = "n/a" if measured <= 0 else f"{predicted / measured - 1:+.1%}"
    shown = "n/a" if mae is None else f"{mae:.1%}"
    return (
        f"mean |error| over {len(scored) - len(unbounded)} steady-state windows: {shown} "
        f"(summed over them, predicted / measured goodput {total}); left out: "
        f"{len(transient)} transient (a switch or a phase change in the window or the "
        f"settling time before it), {len(empty)} empty, {len(unbounded)} in which nothing met "
        "the SLO where some was predicted (error unbounded)"
    )


@dataclass(frozen=True)
class Action:
    at_s: float  # seconds since the load began
    current: str
    target: str
    reason: str
    actuator: str


def actions(decisions: Sequence[dict[str, Any]], zero: float) -> list[Action]:
    """The decisions that acted (a switch the actuator carried out)."""
    return [Action(round(float(d["at"]) - zero, 1), d["current"], d["target"], d["reason"],
                   d.get("actuator", "")) for d in decisions if d.get("acted")]  # fmt: skip


# -- the report ------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One configuration's run: a static split, or the planner starting from one."""

    name: str  # "1P2D", "colocated x3", "planner (local, from 1P2D)"
    planner: bool
    scores: list[Score] = field(default_factory=list)
    checks: list[WindowCheck] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    error: str = ""  # the run did not finish: why
    requests: list[dict[str, Any]] = field(default_factory=list)  # `request_rows`

    def record(self, workload: Workload, schedule: Schedule,
               traces: Sequence[RequestTrace]) -> None:  # fmt: skip
        """The run's scores, and each request as the client saw it."""
        self.scores = score_run(workload, schedule, traces)
        self.requests = request_rows(schedule, traces)

    @property
    def whole(self) -> Score | None:
        return next((s for s in self.scores if s.phase == "all"), None)

    def phases(self) -> list[Score]:
        return [s for s in self.scores if s.phase != "all"]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "planner": self.planner,
            "error": self.error,
            "scores": [s.to_json() for s in self.scores],
            "windows": [c.to_json() for c in self.checks],
            "mean_abs_error": mean_abs_error(self.checks),
            "actions": [asdict(a) for a in self.actions],
            "requests": self.requests,
        }


def request_rows(schedule: Schedule, traces: Sequence[RequestTrace]) -> list[dict[str, Any]]:
    """One row per request, in schedule order: its phase and what the client measured, enough
    to score the run again under another SLO (seconds since the load began)."""
    return [{"index": t.session, "phase": schedule.phase_of[t.session], "sent": t.sent,
             "ttft": t.ttft, "tpot": t.tpot, "e2e": t.e2e, "prompt_tokens": t.prompt_tokens,
             "output_tokens": t.output_tokens, "error": t.error}
            for t in sorted(traces, key=lambda t: t.session)]  # fmt: skip


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def score_table(runs: Sequence[RunResult]) -> str:
    lines = [
        "| run | phase | scheduled | met SLO | attainment | goodput req/s | lost | "
        "TTFT p90 ms | TPOT p90 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        if run.error:
            lines.append(f"| {run.name} | (failed: {run.error}) | | | | | | | |")
        for s in run.scores:
            phase = "**whole run**" if s.phase == "all" else s.phase
            lines.append(
                f"| {run.name} | {phase} | {s.scheduled} | {s.met} | {s.attainment:.0%} | "
                f"{s.goodput:.3f} | {s.lost} | {_ms(s.ttft_p90_ms)} | {_ms(s.tpot_p90_ms)} |"
            )
    return "\n".join(lines)


def planner_tables(run: RunResult) -> str:
    lines = [f"Decisions that acted ({run.name}):", "",
             "| at s | from | to | reason | actuator |", "|---:|---|---|---|---|"]  # fmt: skip
    lines += [f"| {a.at_s:.1f} | {a.current} | {a.target} | {a.reason} | {a.actuator} |"
              for a in run.actions] or ["| - | | | no action | |"]  # fmt: skip
    lines += ["", "Windows, predicted vs measured goodput of the requests admitted in each:", "",
              "| window s | live split | rate req/s | sent | met SLO | predicted goodput | "
              "measured goodput | error | left out |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for c in run.checks:
        error = "unbounded" if c.error is None else f"{c.error:+.0%}"
        predicted = "-" if c.predicted_goodput is None else f"{c.predicted_goodput:.3f}"
        out = c.transient or ("empty" if c.empty else "")
        lines.append(
            f"| {c.start_s:.0f}-{c.end_s:.0f} | {c.split} | {c.rate:.2f} | {c.sent} | {c.met} | "
            f"{predicted} | {c.measured_goodput:.3f} | {error} | {out} |"
        )
    lines += ["", error_summary(run.checks)]
    return "\n".join(lines)


@dataclass(frozen=True)
class Goals:
    """The issue's goals, checked on the runs (None: no run to check it on)."""

    statics_each_miss_a_phase: bool | None
    planner_meets_every_phase: bool | None
    goodput_ratio: float | None  # planner's whole-run goodput / the best static split's
    planner_lost: int | None
    mean_abs_error: float | None
    error_windows: int = 0  # the steady-state windows the mean error is over
    informative_windows: int = 0  # of those, the ones where either side is above 0
    attainment: float = GOAL_ATTAINMENT  # the per-phase goal the first two were checked against

    def lines(self) -> list[str]:
        def yes(v: bool | None) -> str:
            return "n/a" if v is None else ("yes" if v else "NO")

        ratio = "n/a" if self.goodput_ratio is None else f"{self.goodput_ratio:.2f}x"
        mae = "n/a" if self.mean_abs_error is None else f"{self.mean_abs_error:.1%}"
        return [
            f"- every static split misses {self.attainment:.0%} in some phase: "
            f"{yes(self.statics_each_miss_a_phase)}",
            f"- planner >= {self.attainment:.0%} in every phase: "
            f"{yes(self.planner_meets_every_phase)}",
            f"- planner goodput / best static (whole run): {ratio} (goal >= 1.30x: "
            f"{yes(None if self.goodput_ratio is None else self.goodput_ratio >= 1.3)})",
            f"- planner requests lost: {'n/a' if self.planner_lost is None else self.planner_lost}"
            " (goal 0)",
            f"- predicted vs measured goodput per window, mean |error|: {mae} over "
            f"{self.error_windows} steady-state windows, {self.informative_windows} of them "
            "with some goodput predicted or measured (goal <= 10%: "
            f"{yes(None if self.mean_abs_error is None else self.mean_abs_error <= 0.10)}"
            f"{'' if self.informative_windows else ', but on no window with any goodput'})",
        ]


def check_goals(runs: Sequence[RunResult], attainment: float) -> Goals:
    statics = [r for r in runs if not r.planner and not r.error]
    planner = next((r for r in runs if r.planner and not r.error), None)
    miss = all(any(s.attainment < attainment for s in r.phases()) for r in statics)
    best = max((w.goodput for r in statics if (w := r.whole) is not None), default=None)
    whole = planner.whole if planner is not None else None
    counted = [c for c in (planner.checks if planner else []) if c.scored and c.error is not None]
    return Goals(
        statics_each_miss_a_phase=miss if statics else None,
        planner_meets_every_phase=(
            all(s.attainment >= attainment for s in planner.phases())
            if planner is not None
            else None
        ),
        goodput_ratio=(whole.goodput / best if whole is not None and best else None),
        planner_lost=whole.lost if whole is not None else None,
        mean_abs_error=mean_abs_error(planner.checks) if planner is not None else None,
        error_windows=len(counted),
        informative_windows=sum(
            1 for c in counted if c.measured_goodput > 0 or (c.predicted_goodput or 0.0) > 0
        ),
        attainment=attainment,
    )
