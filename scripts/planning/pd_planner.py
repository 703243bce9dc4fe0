"""pd-planner: every `--interval` seconds, read the gateway's metrics, estimate the last window's
workload, ask the simulator which P:D split of the node budget best meets the SLO, correct the
simulator with what was measured, and act with hysteresis and a cool-down.

    python -m scripts.planning.pd_planner --gateway-metrics http://GW/metrics \\
        --profile profile.json --budget 3 --slo-ttft-ms 1000 --slo-tpot-ms 50 --dry-run
    pd-planner ... --actuator switch --bootstrap HOST:PORT      # the console script
    python -m scripts.planning.pd_planner ... --actuator kubernetes --namespace pdserve
    python -m scripts.planning.pd_planner ... --record scrapes.jsonl      # keep what it read
    python -m scripts.planning.pd_planner ... --replay scrapes.jsonl      # decide on a record

One window is the difference of two scrapes of the gateway's /metrics: the choices admitted
with their prompt tokens and token budgets (counted at admission), the requests answered (200s,
counted at the first token), the requests finished (the end-to-end histogram's count), the
requests in flight (a gauge), prompt, completion and prefix-cached tokens and the budgets of
finished choices (counted when a request finishes), the TTFT and inter-token latency
histograms' sums and counts, and the live prefill and decode nodes (the current split). From
it: the arrival rate (admissions per second: 200s are counted at the first token, so under a
prefill backlog they read the split's capacity, not the load), mean input and output lengths
of the admitted choices (outputs: their budgets times the share of its budget a finished
choice used; a record without the admission counters: per finished request), the cached
fraction of the prompts, and the measured mean TTFT and TPOT.

A decision: the simulator (scripts/planning/simulator.py, the node profile scaled by the online
correction, with the nodes' KV pool and running-request cap: `--node-max-total-tokens`,
`--node-max-running-requests`) runs every split of `--budget` (every P:D and colocated) at the
window's rate times `--headroom`, for `--sim-warmup` then `--sim-seconds` of arrivals of the
window's lengths (its cached fraction as a shared prefix), and scores the requests of the
`--sim-seconds` only: the steady state at that rate, queues and batches filled; the split with
the highest predicted SLO attainment is the target. Splits tied there are ranked by a longer
simulation (`--lasting-seconds` of arrivals, at the window's rate and one Poisson sigma either
side, on the profile as measured: `predicted_lasting`), then by how far their p90 latencies sit
inside the SLO (`predicted_slo_load`), then by fewer prefill nodes. The planner switches only
when the target beats the current split by at least `--hysteresis` (attainment, absolute), or,
tied with it, lasts `--lasting-hysteresis` better over the longer run; a move the short run
proposes must not last worse than the current split over the longer one (by more than
`--lasting-hysteresis` where the target meets the goal over the window, at all where it does
not); and the last action must be at least `--cooldown` seconds old. Otherwise it holds and
says why. The short run scores a few requests at low rates: it tied colocated x3 with 2P1D in a
prefill-heavy phase where colocated x3 met 29% (benchmarks/serving-2026-11-27-two-phase-9.md).
The corrections: after each window the ratio of the measured mean TPOT to
the one predicted for the current split at the measured rate moves the decode step's time
(`correction`), and the ratio of the measured mean TTFT to the predicted one moves the prefill
cost (`prefill_correction`, never below 1: see `_correct`); each is an exponential average
(`--correction-weight`), so a profile taken on other hardware or another day converges. Only
TTFT tells on a prefill-heavy window: its few output tokens leave TPOT near the profile's while
its prompts queue (2026-11-26: corrected by TPOT alone, the planner predicted 100% for 1P2D
where 68% met the TTFT SLO). The same few tokens make that window's TPOT a small and noisy
sample, most of its intervals beside a prefill chunk: a window moves the TPOT correction by
its full weight only when `--correction-full-samples` inter-token intervals back it, and by
their share below (one window of 27 intervals had moved it 1.00 -> 1.62, and every split's
prediction to 0).

Each decision is one JSON line on stdout: its inputs (the window), the predicted attainment of
every split, its p90 latencies as shares of the SLO (`predicted_slo_load`), and the retractions
its nodes would make (`predicted_retractions`: requests put back for want of KV pages over the
simulated run, warm-up included), the current and target
split, the action, the reason, the correction, and whether
it acted; and `predicted_goodput`, the window's own prediction: the requests *admitted* in the
window (`window.admitted`, at `window.rate`) that will meet the SLO, per second of the window =
the live split's steady-state attainment at the window's rate (headroom 1) x that rate. What
to compare it with is the same requests' outcome once they finish (two_phase_score.py's
`window_checks`), not the completions inside the window, which trail the admissions by a
request's life. Actuators: `--dry-run` (decide only); `switch` (`--bootstrap HOST:PORT`), which
switches the roles of the live nodes in place, one at a time, each registered in its new role
before the next (a node keeps its weights and KV pool: bootstrap/admin.py, what `pdserve-admin
switch-role` does); `kubernetes`, which sets the replica counts of the prefill and decode
Deployments (deploy/k8s) through the official client's scale subresource; `local`, which starts
the cluster itself (`--cluster-args`, pd-cluster's flags) and stops and starts its node
processes (a new process loads its weights again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

from bootstrap.admin import AdminError, NodeSummary, list_nodes, switch_role
from bootstrap.security import InternalAuth, add_internal_auth_args, internal_auth_from_args
from scripts.planning.plan_capacity import host_config
from scripts.planning.planner import SimOutcome, simulate_outcome
from scripts.planning.profile import NodeProfile
from scripts.planning.simulator import HostConfig
from scripts.planning.sweep import Split, parse_splits
from scripts.serving.datasets import DatasetConfig
from scripts.serving.load import LoadConfig
from scripts.serving.metrics import SLO


class PlannerError(ValueError):
    """Planner input that cannot be used; the message names the flag or the metric."""


# -- what the gateway's /metrics say ---------------------------------------------------------


@dataclass(frozen=True)
class Scrape:
    """The gateway's cumulative counters at one moment (seconds on the planner's clock)."""

    at: float
    requests: float = 0.0  # answered with 200 on the generation endpoints (a stream opened)
    finished: float = 0.0  # requests whose tokens were counted (the e2e histogram's count)
    inflight: float = 0.0  # admitted and not finished (a gauge): queued ones included
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    cached_tokens: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    # Counted at admission (0 in a record of a gateway without them): the offered lengths.
    admitted: float = 0.0  # choices
    admitted_prompt_tokens: float = 0.0
    admitted_max_tokens: float = 0.0
    finished_max_tokens: float = 0.0  # the budgets of finished choices
    prefill_nodes: int = 0
    decode_nodes: int = 0


GENERATION_ENDPOINTS = ("completions", "chat", "generate")  # the gateway's endpoint labels
COUNTERS = {  # the gateway's cumulative samples -> Scrape fields (summed over their labels)
    "pdserve_gateway_prompt_tokens_total": "prompt_tokens",
    "pdserve_gateway_completion_tokens_total": "completion_tokens",
    "pdserve_gateway_node_cached_tokens_total": "cached_tokens",
    "pdserve_gateway_time_to_first_token_seconds_sum": "ttft_sum",
    "pdserve_gateway_time_to_first_token_seconds_count": "ttft_count",
    "pdserve_gateway_inter_token_latency_seconds_sum": "itl_sum",
    "pdserve_gateway_inter_token_latency_seconds_count": "itl_count",
    "pdserve_gateway_e2e_seconds_count": "finished",
    "pdserve_gateway_inflight": "inflight",
    "pdserve_gateway_admitted_choices_total": "admitted",
    "pdserve_gateway_admitted_prompt_tokens_total": "admitted_prompt_tokens",
    "pdserve_gateway_admitted_max_tokens_total": "admitted_max_tokens",
    "pdserve_gateway_finished_max_tokens_total": "finished_max_tokens",
}


def parse_scrape(text: str, at: float) -> Scrape:
    """One /metrics text (Prometheus exposition format) as a `Scrape`."""
    values: dict[str, float] = {}
    nodes = {"prefill": 0, "decode": 0, "colocated": 0}

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            key = COUNTERS.get(name)
            if name == "pdserve_gateway_requests_total":
                ok = labels.get("status") == "200"
                key = "requests" if ok and labels.get("endpoint") in GENERATION_ENDPOINTS else None
            elif name == "pdserve_gateway_live_nodes" and labels.get("role") in nodes:
                nodes[labels["role"]] = int(sample.value)
            if key is not None:
                values[key] = values.get(key, 0.0) + sample.value
    decode = nodes["decode"] + nodes["colocated"]  # a colocated node decodes (and prefills)
    return Scrape(at, **values, prefill_nodes=nodes["prefill"], decode_nodes=decode)


@dataclass(frozen=True)
class Window:
    """The workload and latencies between two scrapes."""

    seconds: float
    admitted: float  # requests that reached the gateway in the window
    rate: float  # requests admitted per second (the offered load)
    input_len: float  # mean prompt tokens
    output_len: float  # mean completion tokens
    cached_fraction: float  # of the prompt tokens, served from a prefix cache
    ttft_s: float | None  # mean, measured
    tpot_s: float | None  # mean inter-token latency, measured
    split: Split  # live nodes at the window's end
    tpot_samples: float = 0.0  # inter-token intervals behind tpot_s

    @classmethod
    def between(cls, a: Scrape, b: Scrape) -> Window | None:
        """None when nothing was admitted in between (with a gateway that does not count
        admissions: nothing answered, or nothing finished), so nothing to plan for."""
        seconds, requests = b.at - a.at, b.requests - a.requests
        finished = b.finished - a.finished
        counted = b.admitted > 0  # the gateway counts admissions (a record may predate them)
        admissions = b.admitted - a.admitted
        if seconds <= 0 or (admissions <= 0 if counted else (requests <= 0 or finished <= 0)):
            return None
        prompt = b.prompt_tokens - a.prompt_tokens

        def mean(s: float, c: float) -> float | None:
            return s / c if c > 0 else None

        # The rate is of admissions: counted, or without the counter finished + in flight, or
        # the 200s where more. A 200 is counted at the first token, which a backlog delays into
        # a later window: beside the counter, the larger of the two read twice the rate in 9 of
        # two-phase-7's 24 windows.
        if counted:
            admitted = admissions
            # The lengths of what arrived: the tokens of finished requests trail their
            # admission by a request's life, which read a prompt-heavy phase for a minute into
            # a decode-heavy one, and nothing at all while no request finished for 330 s
            # (benchmarks/serving-2026-11-26-two-phase-6.md). Outputs are the budgets scaled
            # by the share of their budgets that finished requests used.
            used = b.completion_tokens / b.finished_max_tokens if b.finished_max_tokens else 1.0
            input_len = (b.admitted_prompt_tokens - a.admitted_prompt_tokens) / admissions
            output_len = (b.admitted_max_tokens - a.admitted_max_tokens) / admissions * used
        else:  # a 200 is counted at the first token, the tokens at the end: per finished one
            admitted = max((b.finished + b.inflight) - (a.finished + a.inflight), requests)
            input_len = prompt / finished
            output_len = (b.completion_tokens - a.completion_tokens) / finished
        cached = (b.cached_tokens - a.cached_tokens) / prompt if prompt > 0 else None
        if cached is None:  # nothing finished in the window: the gateway's running share
            cached = b.cached_tokens / b.prompt_tokens if b.prompt_tokens > 0 else 0.0
        return cls(
            seconds=seconds,
            admitted=admitted,
            rate=admitted / seconds,
            input_len=input_len,
            output_len=output_len,
            cached_fraction=cached,
            ttft_s=mean(b.ttft_sum - a.ttft_sum, b.ttft_count - a.ttft_count),
            tpot_s=mean(b.itl_sum - a.itl_sum, b.itl_count - a.itl_count),
            split=Split(b.prefill_nodes, b.decode_nodes),
            tpot_samples=b.itl_count - a.itl_count,
        )


# -- deciding --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannerConfig:
    budget: int  # nodes (GPUs) to split
    slo: SLO
    attainment: float = 0.9  # below this for the best split, the reason says to add nodes
    hysteresis: float = 0.05  # the target must beat the current split by this much attainment
    cooldown_s: float = 120.0  # no action sooner than this after the last one
    headroom: float = 1.1  # plan for this much more traffic than the window saw
    sim_seconds: float = 60.0  # arrivals simulated and scored per split
    # Splits the window's simulation ranks equal are told apart by a longer one: this many
    # seconds of arrivals scored (0: by their distance from the SLO alone). At 0.25 req/s,
    # 20 s score a few requests: 2P1D and colocated x3 both read 100% in a prefill-heavy phase
    # where colocated x3 met 29% live; over 300 s its streams stall behind its prefills
    # (benchmarks/serving-2026-11-27-two-phase-8.md).
    lasting_seconds: float = 300.0
    # A split tied with the live one replaces it only when it lasts this much better there
    # (attainment). Replayed on two-phase-8 and -9's five planner runs, every tie with 2P1D
    # live in the prefill-heavy phase kept it, and the moves to the split that did better
    # live gained 0.11-0.37.
    lasting_hysteresis: float = 0.1
    # arrivals simulated before those, not scored: the steady state at the window's rate
    sim_warmup_s: float = 30.0
    correction_weight: float = 0.5  # of each new measured/predicted ratio in the correction
    # The correction stays within [1 / limit, limit]: a host shared with other work measured
    # steps 10-40x its profile (benchmarks/serving-2026-11-26-two-phase.md); at the old limit
    # of 4 every prediction stayed optimistic and the planner never acted.
    correction_limit: float = 64.0
    # A window's TPOT moves the correction by its full weight only when this many inter-token
    # intervals back it, proportionally less below: the 4-token outputs of a prefill-heavy
    # window give a few dozen intervals, most of them beside a prefill chunk
    # (benchmarks/serving-2026-11-26-two-phase-5.md).
    correction_full_samples: float = 50.0
    host: HostConfig = field(default_factory=HostConfig)

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise PlannerError(f"--budget must be >= 1 node, got {self.budget}")
        if not self.slo.given:
            raise PlannerError("give at least one of --slo-ttft-ms, --slo-tpot-ms, --slo-e2e-ms")
        if not 0 <= self.hysteresis < 1:
            raise PlannerError(f"--hysteresis must be in [0, 1), got {self.hysteresis}")
        if self.sim_seconds <= 0 or self.sim_warmup_s < 0:
            raise PlannerError(
                f"--sim-seconds must be > 0 and --sim-warmup >= 0, got {self.sim_seconds} and "
                f"{self.sim_warmup_s}"
            )
        if self.lasting_seconds < 0:
            raise PlannerError(f"--lasting-seconds must be >= 0, got {self.lasting_seconds}")
        if not 0 <= self.lasting_hysteresis <= 1:  # 1: a tie never moves the live split
            raise PlannerError(
                f"--lasting-hysteresis must be in [0, 1], got {self.lasting_hysteresis}"
            )
        if not 0 < self.correction_weight <= 1:
            raise PlannerError(
                f"--correction-weight must be in (0, 1], got {self.correction_weight}"
            )
        if self.correction_full_samples < 0:
            raise PlannerError(
                f"--correction-full-samples must be >= 0, got {self.correction_full_samples}"
            )


@dataclass
class Decision:
    at: float
    window: dict[str, Any]
    current: str
    target: str
    action: str  # "hold" | "switch"
    reason: str
    predicted: dict[str, float]  # split name -> predicted SLO attainment
    correction: float  # the decode-step-time factor the predictions used
    # The requests admitted in the window (window.admitted) meeting the SLO per second: the live
    # split's predicted attainment at window.rate (headroom 1) x window.rate; None when the live
    # split is none of the budget's (a switch under way).
    predicted_goodput: float | None = None
    acted: bool = False
    actuator: str = ""  # what the actuator did
    prefill_correction: float = 1.0  # the prefill-cost factor
    # split name -> requests its nodes would retract (KV short) over the simulated run
    predicted_retractions: dict[str, int] = field(default_factory=dict)
    # split name -> its simulated p90 TTFT, TPOT and E2E as shares of their SLOs, the largest
    predicted_slo_load: dict[str, float] = field(default_factory=dict)
    # split name -> its attainment over the longer simulation: the splits tied at the top, or
    # the target and the live split of a move the window's simulation proposes
    predicted_lasting: dict[str, float] = field(default_factory=dict)

    def json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


class Planner:
    def __init__(self, profile: NodeProfile, config: PlannerConfig) -> None:
        self.profile = profile
        self.config = config
        self.splits = {s.name: s for s in parse_splits("all", config.budget)}
        # Decode steps from measured / predicted TPOT, prefill from TTFT. The TPOT factor once
        # scaled prefill too: a decode node slowed by its co-running prefill nodes (2P1D on two
        # cores) then made every split's prefill look slow and every prediction 0 while 2P1D
        # met its SLO (benchmarks/serving-2026-11-26-two-phase-6.md).
        self.correction = 1.0
        self.prefill_correction = 1.0
        self.last_action_at = -math.inf

    def decide(self, window: Window, now: float) -> Decision:
        c = self.config
        self._correct(window)
        rate = window.rate * c.headroom
        outcomes = {name: self._run(s, window, rate) for name, s in self.splits.items()}
        predicted = {name: _attainment(outcome) for name, outcome in outcomes.items()}
        load = {name: round(_slo_load(outcome, c.slo), 3) for name, outcome in outcomes.items()}
        current = window.split.name
        # Highest attainment; among equals the one that lasts best over the longer simulation
        # (`lasting_seconds`), then the one furthest inside the SLO, then the one with the
        # fewest prefill nodes (stable).
        top = max(round(a, 6) for a in predicted.values())
        tied = [name for name, a in predicted.items() if round(a, 6) == top]
        lasting = self._lasting(tied, window, rate) if len(tied) > 1 else {}
        target = max(tied, key=lambda n: (lasting.get(n, 0.0), -load[n],
                                           -self.splits[n].prefill))  # fmt: skip
        if target != current and current in predicted and current not in lasting:
            # a move the window's simulation proposes: the longer one is asked too
            missing = [name for name in (target, current) if name not in lasting]
            lasting = {**lasting, **self._lasting(missing, window, rate)}
        action, reason = self._action(current, target, current in tied, predicted, lasting, now)
        if predicted[target] < c.attainment:  # the budget is too small for this traffic
            reason += f"; no split of {c.budget} nodes meets the SLO for {c.attainment:.0%}: "
            reason += "add nodes (--budget)"
        window_doc = {**asdict(window), "split": current}
        goodput = self._window_goodput(window, predicted)
        retractions = {name: outcome.retractions for name, outcome in outcomes.items()}
        return Decision(now, window_doc, current, target, action, reason, predicted,
                        round(self.correction, 4), goodput,
                        prefill_correction=round(self.prefill_correction, 4),
                        predicted_retractions=retractions,
                        predicted_slo_load=load, predicted_lasting=lasting)  # fmt: skip

    def _action(self, current: str, target: str, tie: bool, predicted: dict[str, float],
                lasting: dict[str, float], now: float) -> tuple[str, str]:  # fmt: skip
        """Hold or switch to `target` (`tie`: the live split is tied with it at the top), and
        why."""
        c = self.config
        then = f" over {c.lasting_seconds:.0f} s"
        if target == current:
            return "hold", f"{current} is the best split ({predicted[current]:.0%})"
        if tie and current in lasting:  # the longer simulation's gain decides
            gain = lasting[target] - lasting[current]
            if gain < c.lasting_hysteresis:
                return "hold", (f"{target} ties {current} and would gain {gain:.1%}{then}, "
                                "under the lasting hysteresis")  # fmt: skip
            why = (f"{target} ties {current} at {predicted[target]:.0%} and meets the SLO for "
                   f"{lasting[target]:.0%} of requests{then} against "
                   f"{lasting[current]:.0%}")  # fmt: skip
        else:
            gain = predicted[target] - predicted.get(current, 0.0)
            if current in predicted and gain < c.hysteresis:
                return "hold", f"{target} would gain {gain:.1%}, under the hysteresis"
            why = (f"{target} meets the SLO for {predicted[target]:.0%} of requests against "
                   f"{predicted.get(current, 0.0):.0%} for {current}")  # fmt: skip
            # The longer simulation may read the target up to the lasting hysteresis below
            # the live split where the target meets the goal over the window, and not below
            # it where it misses the goal too. Over 20 s, 2P1D's window at the phase change
            # read 50% against 100% for 1P2D, and 66% against 60% over 300 s: the move met
            # the decode-heavy phase (two-phase-8). False alarms in the prefill-heavy phase
            # (two-phase-9) read colocated x3 100% against 0% for the live 2P1D (49% against
            # 65% over 300 s), and in a burst of 12 arrivals 80% against 60% (18% and 22%).
            slack = c.lasting_hysteresis if predicted[target] >= c.attainment else 0.0
            if current in lasting and lasting[target] < lasting[current] - slack:
                return "hold", (f"{why}, but {lasting[target]:.0%} against "
                                f"{lasting[current]:.0%}{then}")  # fmt: skip
        if now - self.last_action_at < c.cooldown_s:
            wait = c.cooldown_s - (now - self.last_action_at)
            return "hold", f"{target} is better by {gain:.1%}; cooling down {wait:.0f} s"
        return "switch", why

    def _lasting(self, names: list[str], window: Window, rate: float) -> dict[str, float]:
        """The splits' attainment over `lasting_seconds` of arrivals, averaged over the
        window's rate and one Poisson sigma either side of it (the window saw `admitted`
        arrivals): a split that holds at the rate but falls over above it ranks below one
        that degrades gently. Empty without a longer simulation (lasting_seconds 0).

        On the profile as measured: the corrections fit the live split to its window. With
        2P1D live in a prefill-heavy phase the TPOT one read 1.2-1.5 (its decode node beside
        two prefill nodes on two cores); over 300 s it put 1P2D 11 points above 2P1D, and a
        run moved there (two-phase-9). Live, 2P1D met 81% of that phase and 1P2D 48%."""
        seconds = self.config.lasting_seconds
        if seconds <= 0:
            return {}
        sigma = 1 / math.sqrt(max(1.0, window.admitted))
        rates = (rate * max(0.25, 1 - sigma), rate, rate * (1 + sigma))
        runs = {name: [self._run(self.splits[name], window, r, seconds, as_profiled=True)
                       for r in rates] for name in names}  # fmt: skip
        return {name: round(sum(map(_attainment, outcomes)) / len(rates), 4)
                for name, outcomes in runs.items()}  # fmt: skip

    def _window_goodput(self, window: Window, predicted: dict[str, float]) -> float | None:
        """The predicted goodput of the window's own requests: see `Decision`."""
        live = window.split.name
        if live not in self.splits:
            return None
        if self.config.headroom == 1.0:
            attainment = predicted[live]  # simulated at window.rate already
        else:
            attainment = _attainment(self._run(self.splits[live], window, window.rate))
        return round(attainment * window.rate, 6)

    def acted(self, now: float) -> None:
        self.last_action_at = now

    def _workload(self, window: Window) -> DatasetConfig:
        prompt, out = max(1, round(window.input_len)), max(1, round(window.output_len))
        cached = min(prompt - 1, round(prompt * window.cached_fraction))
        if cached > 0:  # the cached part as a prefix shared by groups of requests
            return DatasetConfig("prefix", 1000, input_len=prompt - cached, output_len=out,
                                 prefix_len=cached, prefix_group_size=16)  # fmt: skip
        return DatasetConfig("random", 1000, input_len=prompt, output_len=out)

    def _run(self, split: Split, window: Window, rate: float, seconds: float | None = None,
             as_profiled: bool = False) -> SimOutcome:  # fmt: skip
        """`split` simulated at `rate`: the warm-up, then `seconds` (default: sim_seconds)
        of scored arrivals; with the corrections unless `as_profiled`."""
        c = self.config
        load = LoadConfig(request_rate=rate, num_sessions=None,
                          duration_s=c.sim_warmup_s + (seconds or c.sim_seconds))  # fmt: skip
        decode, prefill = (1.0, 1.0) if as_profiled else (self.correction,
                                                          self.prefill_correction)  # fmt: skip
        d0, d1, d2 = (x * decode for x in self.profile.decode_coef)
        p0, p1, p2 = (x * prefill for x in self.profile.prefill_coef)
        profile = replace(self.profile, prefill_coef=(p0, p1, p2), decode_coef=(d0, d1, d2))
        return simulate_outcome(profile, split, self._workload(window), load, c.slo, c.host,
                                score_after_s=c.sim_warmup_s)  # fmt: skip

    def _correct(self, window: Window) -> None:
        """Move the corrections by the current split's measured / predicted TPOT and TTFT,
        both predicted by one run with the corrections as they were."""
        tpot = window.tpot_s if window.split.decode >= 1 else None
        if tpot is None and window.ttft_s is None:
            return
        run = self._run(window.split, window, window.rate).summary
        predicted_tpot, predicted_ttft = run.tpot_ms.mean / 1000, run.ttft_ms.mean / 1000
        if tpot is not None and predicted_tpot > 0:
            full = self.config.correction_full_samples
            evidence = 1.0 if full <= 0 else min(1.0, window.tpot_samples / full)
            self.correction = self._moved(self.correction, tpot / predicted_tpot, evidence)
        if window.ttft_s is not None and predicted_ttft > 0:
            # Never below 1: a split the model sees overloaded has no steady state, and its
            # measured TTFT (a queue as old as the window) reads below the prediction; taken
            # as a faster prefill, it would make that split look good.
            ratio = window.ttft_s / predicted_ttft
            self.prefill_correction = max(1.0, self._moved(self.prefill_correction, ratio))

    def _moved(self, factor: float, ratio: float, evidence: float = 1.0) -> float:
        """`factor` moved towards `ratio` by the correction weight times `evidence` (0-1)."""
        w, limit = self.config.correction_weight * evidence, self.config.correction_limit
        return min(limit, max(1 / limit, factor * ratio**w))


def _attainment(outcome: SimOutcome) -> float:
    """A simulated run's SLO attainment (0 when nothing was scored)."""
    return float(outcome.summary.slo_attainment or 0.0)


def _slo_load(outcome: SimOutcome, slo: SLO) -> float:
    """How close a simulated run came to its SLO: the largest of its p90 TTFT, TPOT and E2E
    over their SLOs (1 at the edge; 0 with nothing scored)."""
    summary = outcome.summary
    shares = [dist.p90 / limit for dist, limit in ((summary.ttft_ms, slo.ttft_ms),
                                                   (summary.tpot_ms, slo.tpot_ms),
                                                   (summary.e2e_ms, slo.e2e_ms))
              if limit is not None]  # fmt: skip
    return max(shares, default=0.0)


# -- acting ----------------------------------------------------------------------------------


class Actuator(Protocol):
    def apply(self, target: Split) -> str: ...


@dataclass
class KubernetesActuator:
    """Sets the replicas of the prefill and decode Deployments (colocated: no prefill pods, the
    decode pods prefill themselves). `api` is the official client's AppsV1Api."""

    api: Any
    namespace: str
    prefill_deployment: str = "pdserve-prefill"
    decode_deployment: str = "pdserve-decode"

    def apply(self, target: Split) -> str:
        done = []
        for name, replicas in ((self.prefill_deployment, target.prefill),
                               (self.decode_deployment, target.decode)):  # fmt: skip
            body = {"spec": {"replicas": replicas}}
            self.api.patch_namespaced_deployment_scale(name, self.namespace, body)
            done.append(f"{self.namespace}/{name} replicas={replicas}")
        return "; ".join(done)


@dataclass
class LocalActuator:
    """The nodes of a local cluster (gateway/process/cluster.py's `Cluster`, which this process
    started): first stops the nodes of a role the target has too many of (each gets SIGTERM and
    finishes its in-flight work), then starts the missing ones with their peers' flags. Stopping
    first keeps the node count within the budget (a GPU freed before it is taken again)."""

    cluster: Any  # gateway.process.cluster.Cluster

    def apply(self, target: Split) -> str:
        want = {"prefill": target.prefill, "decode": target.decode}
        done = []
        for role, count in want.items():
            while len(self.cluster.live_nodes(role)) > count:
                done.append(f"stopped {self.cluster.remove_node(role).name}")
        for role, count in want.items():
            while len(self.cluster.live_nodes(role)) < count:
                done.append(f"started {self.cluster.add_node(role).name}")
        return "; ".join(done) or "nothing to change"


@dataclass(frozen=True)
class RoleChange:
    node_id: str
    role: str  # "prefill" | "decode"


def plan_role_changes(nodes: list[NodeSummary], target: Split) -> list[RoleChange]:
    """The fewest switches that give the live nodes `target`'s number of prefill nodes; the
    others decode (colocated x N: N decode nodes, which prefill their requests themselves when
    no prefill node is left, as colocated ones do). At least one node keeps decoding. The least
    busy nodes of the role in surplus switch first (the least to drain)."""
    live = [n for n in nodes if not n.draining and n.role in ("prefill", "decode", "colocated")]
    prefill = [n for n in live if n.role == "prefill"]
    decoding = [n for n in live if n.role != "prefill"]
    want = min(target.prefill, len(live) - 1)
    order = lambda n: (n.busy, n.node_id)  # noqa: E731
    if len(prefill) > want:
        return [RoleChange(n.node_id, "decode")
                for n in sorted(prefill, key=order)[: len(prefill) - want]]  # fmt: skip
    return [RoleChange(n.node_id, "prefill")
            for n in sorted(decoding, key=order)[: want - len(prefill)]]  # fmt: skip


@dataclass
class SwitchActuator:
    """Within a fixed budget of running nodes: switches their roles in place through the
    bootstrap (`plan_role_changes`), one node at a time, waiting until each is registered in
    its new role before the next, so at most one node is out of service at once. A switch
    that fails stops the rest; the next decision sees the split that resulted."""

    bootstrap: str
    budget: int
    auth: InternalAuth = field(default_factory=InternalAuth)
    drain_timeout_s: float | None = None  # None: each node's own --drain-timeout
    timeout_s: float = 120.0  # per node: the switch and its registration

    def apply(self, target: Split) -> str:
        return asyncio.run(self._apply(target))

    async def _apply(self, target: Split) -> str:
        try:
            nodes = await list_nodes(self.bootstrap, self.auth)
        except AdminError as exc:
            return f"failed: {exc}"
        done = []
        if len(nodes) != self.budget:
            done.append(f"{len(nodes)} live nodes for a budget of {self.budget}")
        for change in plan_role_changes(nodes, target):
            try:
                outcome = await switch_role(
                    self.bootstrap, change.node_id, change.role, self.auth,
                    self.drain_timeout_s, self.timeout_s,
                )  # fmt: skip
            except AdminError as exc:
                done.append(f"failed: {exc}")
                break
            done.append(
                f"switched {outcome.node_id} {outcome.from_role}->{outcome.role} in "
                f"{outcome.seconds:.2f} s ({outcome.aborted} aborted)"
            )
        return "; ".join(done) or "nothing to change"


def kubernetes_actuator(args: argparse.Namespace) -> KubernetesActuator:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return KubernetesActuator(client.AppsV1Api(), args.namespace, args.prefill_deployment,
                              args.decode_deployment)  # fmt: skip


# -- the loop --------------------------------------------------------------------------------


def scrapes_live(url: str, interval_s: float, record: Path | None) -> Iterator[Scrape]:
    while True:
        at = time.monotonic()
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        if record is not None:
            with record.open("a") as f:
                f.write(json.dumps({"at": at, "metrics": text}) + "\n")
        yield parse_scrape(text, at)
        time.sleep(max(0.0, interval_s - (time.monotonic() - at)))


def scrapes_recorded(path: Path) -> Iterator[Scrape]:
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            doc = json.loads(line)
            yield parse_scrape(doc["metrics"], float(doc["at"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise PlannerError(
                f"--replay {path}: line {n} is not a recorded scrape ({exc})"
            ) from None


def run(planner: Planner, scrapes: Iterator[Scrape], actuator: Actuator | None,
        out: Any = None) -> list[Decision]:  # fmt: skip
    """Decide on every window (consecutive scrapes); act where a decision says switch. Without
    an actuator (a dry run) a switch still starts the cool-down, so the decisions printed are
    the ones a planner that acts would make."""
    out = out or sys.stdout
    decisions: list[Decision] = []
    previous = None
    for scrape in scrapes:
        window = Window.between(previous, scrape) if previous is not None else None
        previous = scrape
        if window is None:
            continue
        started = time.perf_counter()
        decision = planner.decide(window, scrape.at)
        print(f"[pd-planner] {decision.action} {decision.target}: decided in "
              f"{time.perf_counter() - started:.2f} s", file=sys.stderr, flush=True)  # fmt: skip
        if decision.action == "switch":
            if actuator is not None:
                decision.actuator = actuator.apply(planner.splits[decision.target])
                decision.acted = True
            planner.acted(scrape.at)
        out.write(decision.json() + "\n")
        out.flush()
        decisions.append(decision)
    return decisions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-planner", description=__doc__.splitlines()[0])
    parser.add_argument("--gateway-metrics", default=None, help="the gateway's /metrics URL")
    parser.add_argument("--replay", type=Path, default=None, help="decide on --record's file")
    parser.add_argument("--record", type=Path, default=None, help="append each scrape here")
    parser.add_argument("--profile", type=Path, required=True, help="plan_capacity profile")
    parser.add_argument("--budget", type=int, default=None, help="nodes (GPUs) to split")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds per window")
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--slo-attainment", type=float, default=0.9)
    parser.add_argument("--hysteresis", type=float, default=0.05)
    parser.add_argument("--cooldown", type=float, default=120.0, help="seconds between actions")
    parser.add_argument("--headroom", type=float, default=1.1, help="plan for rate x this")
    parser.add_argument("--sim-seconds", type=float, default=60.0, help="arrivals scored")
    parser.add_argument(
        "--lasting-seconds",
        type=float,
        default=300.0,
        help="arrivals scored by the longer simulation that ranks the splits tied at the top "
        "(0: by their distance from the SLO alone)",
    )
    parser.add_argument(
        "--lasting-hysteresis",
        type=float,
        default=0.1,
        help="attainment over the longer simulation a split tied with the live one must gain "
        "to replace it, and how far below the live split there a move may read where its "
        "target meets the SLO goal over the window",
    )
    parser.add_argument(
        "--sim-warmup",
        type=float,
        default=30.0,
        help="seconds of arrivals simulated before the scored ones (the steady state)",
    )
    parser.add_argument(
        "--node-max-total-tokens",
        type=int,
        default=None,
        help="the nodes' KV pool in tokens (their --max-total-tokens; default: the profile's)",
    )
    parser.add_argument(
        "--node-max-running-requests",
        type=int,
        default=None,
        help="the nodes' --max-running-requests (default: the profile's)",
    )
    parser.add_argument("--correction-weight", type=float, default=0.5)
    parser.add_argument(
        "--correction-full-samples",
        type=float,
        default=50.0,
        help="inter-token intervals a window needs to move the TPOT correction by its full "
        "weight (fewer: proportionally less; 0: always the full weight)",
    )
    parser.add_argument("--host-cores", type=int, default=0, help="0: a device per node (GPU)")
    parser.add_argument("--threads-per-node", type=int, default=1)
    parser.add_argument("--slowdown", type=float, default=1.0, help="scales every step time")
    parser.add_argument(
        "--co-runner-slowdown",
        type=float,
        default=0.0,
        help="fraction each other step in flight slows a step by (plan_capacity.py's flag)",
    )
    parser.add_argument(
        "--host-overhead-ms",
        type=float,
        default=0.0,
        help="host CPU ms per streamed token outside steps, colocated (plan_capacity.py host)",
    )
    parser.add_argument(
        "--host-overhead-pd-ms",
        type=float,
        default=None,
        help="the same with prefill nodes (default: --host-overhead-ms)",
    )
    parser.add_argument("--dry-run", action="store_true", help="decide, never act")
    parser.add_argument("--actuator", choices=["switch", "kubernetes", "local"], default=None)
    parser.add_argument(
        "--bootstrap",
        default=None,
        help="switch: the cluster's bootstrap-server host:port (its live nodes are the budget)",
    )
    parser.add_argument(
        "--switch-drain-timeout",
        type=float,
        default=None,
        help="switch: seconds a node's in-flight requests get before they are moved (default: "
        "the node's --drain-timeout)",
    )
    parser.add_argument(
        "--switch-timeout", type=float, default=120.0, help="switch: seconds per node"
    )
    parser.add_argument(
        "--cluster-args",
        default="",
        help="local: start this pd-cluster (its flags, quoted) and plan for it; the budget "
        "defaults to its --prefill + --decode",
    )
    add_internal_auth_args(parser)  # switch: the token the node and bootstrap calls carry
    parser.add_argument("--namespace", default="pdserve")
    parser.add_argument("--prefill-deployment", default="pdserve-prefill")
    parser.add_argument("--decode-deployment", default="pdserve-decode")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cluster = None
    try:
        if args.actuator == "local":
            cluster = start_local_cluster(args)
            args.gateway_metrics = f"{cluster.url}/metrics"
        if (args.gateway_metrics is None) == (args.replay is None):
            raise PlannerError("give one of --gateway-metrics URL and --replay FILE")
        if not args.dry_run and args.actuator is None and args.replay is None:
            raise PlannerError(
                "give --actuator switch|kubernetes|local, or --dry-run to decide only"
            )
        if args.actuator == "switch" and not args.bootstrap:
            raise PlannerError("--actuator switch needs --bootstrap HOST:PORT")
        if args.budget is None:
            raise PlannerError("give --budget N (nodes to split)")
        planner = Planner(node_profile(args), planner_config(args))
        actuator: Actuator | None = None
        if not args.dry_run and args.actuator == "switch":
            actuator = SwitchActuator(args.bootstrap, args.budget, internal_auth_from_args(args),
                                      args.switch_drain_timeout, args.switch_timeout)  # fmt: skip
        elif not args.dry_run and args.actuator == "kubernetes":
            actuator = kubernetes_actuator(args)
        elif not args.dry_run and cluster is not None:
            actuator = LocalActuator(cluster.cluster)
        if args.replay is not None:
            run(planner, scrapes_recorded(args.replay), actuator)
        else:
            run(planner, scrapes_live(args.gateway_metrics, args.interval, args.record), actuator)
    except (PlannerError, ValueError) as exc:
        print(f"pd-planner: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        if cluster is not None:
            cluster.cluster.stop()
    return 0


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    return PlannerConfig(
        budget=args.budget,
        slo=SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
        attainment=args.slo_attainment,
        hysteresis=args.hysteresis,
        cooldown_s=args.cooldown,
        headroom=args.headroom,
        sim_seconds=args.sim_seconds,
        lasting_seconds=args.lasting_seconds,
        lasting_hysteresis=args.lasting_hysteresis,
        sim_warmup_s=args.sim_warmup,
        correction_weight=args.correction_weight,
        correction_full_samples=args.correction_full_samples,
        host=host_config(args),  # plan_capacity.py's host model, validated on 11-24
    )


def node_profile(args: argparse.Namespace) -> NodeProfile:
    """`--profile` with the nodes' KV pool and running cap where given: a node's capacity in
    streams (a decode node holds about pool / (prompt + output) long requests at full length,
    more with retractions) is the node's flag, not the profiled host's."""
    profile = NodeProfile.load(args.profile)
    if args.node_max_total_tokens is not None:
        profile = replace(profile, max_total_tokens=args.node_max_total_tokens)
    if args.node_max_running_requests is not None:
        profile = replace(profile, max_running_requests=args.node_max_running_requests)
    return profile


@dataclass
class LocalCluster:
    cluster: Any  # gateway.process.cluster.Cluster
    url: str


def start_local_cluster(args: argparse.Namespace) -> LocalCluster:
    """`--cluster-args` as pd-cluster would run them; the budget defaults to its node count."""
    import shlex
    import threading

    from gateway.process.cluster import Cluster, ClusterError, build_config
    from gateway.process.cluster import build_parser as cluster_parser

    config = build_config(cluster_parser().parse_args(shlex.split(args.cluster_args)))
    if args.budget is None:
        args.budget = config.prefill + config.decode
    cluster = Cluster(config, out=sys.stderr)
    try:
        url = cluster.start(threading.Event())
    except ClusterError as exc:
        cluster.stop()
        raise PlannerError(f"--cluster-args: the cluster did not start: {exc}") from None
    print(f"[pd-planner] cluster ready: {url}", file=sys.stderr, flush=True)
    return LocalCluster(cluster, url)


if __name__ == "__main__":
    sys.exit(main())
