"""The planner's goal on this CPU: a node budget, a two-phase workload (prefill-heavy, then
decode-heavy), every static split of the budget against `pd-planner` moving the split while it
serves.

    python -m scripts.planning.two_phase --out benchmarks/serving-RUN      # ~23 min
    python -m scripts.planning.two_phase --quick --out /tmp/two-phase       # ~15 min

For each configuration (`--splits`, default every P:D of `--budget` and colocated; then the
planner unless `--no-planner`) it starts a cluster (gateway/process/cluster.py's launcher; every
node `--threads-per-node` OMP threads, as the profile was measured; disaggregated splits send every
prompt through a prefill node: the gateway's `--local-prefill-max-tokens 0`), sends a few
warm-up requests, then the same schedule of requests (scripts/planning/two_phase_score.py):
phase A `--a-seconds` of Poisson arrivals at `--a-rate` of `--a-input`-token prompts with
`--a-output` output tokens, then phase B likewise, and stops the cluster. The planner run:
`--actuator local` runs `pd-planner --actuator local --cluster-args ...` (it starts the cluster
from `--planner-start` and stops and starts node processes within the budget); `--actuator
switch` starts the cluster here and runs `pd-planner --actuator switch --bootstrap HOST:PORT`
(role switches inside the nodes). The planner gets `--interval`, `--cooldown`, the SLOs,
`--headroom 1`, `--sim-warmup` (its steady state) and this CPU's host model (`CALM_HOST`), so that
what it predicts for a window is the goodput of the window's own requests at its rate.
`--max-total-tokens` and `--max-running-requests` set every node's KV pool and running cap (a
node holds about pool / (prompt + output) long streams at full length, more while it retracts
and prefills them again: the memory a decode-heavy phase needs), and the same values go to the
planner's simulator.
A run ends `--grace` seconds after the last phase: requests unfinished then are cancelled and
count as lost (an overloaded split's backlog would otherwise drain for many minutes).

Prints, and writes under `--out` (`two_phase.json`, with each request's phase, TTFT and
TPOT under `requests` to score a run again under another SLO; `two_phase.md`; the planner's
decisions as `planner_decisions.jsonl`, the metrics it read as `planner_scrapes.jsonl` for
`pd-planner --replay`, and its log): per run and phase the requests scheduled, those meeting
both SLOs (TTFT and TPOT, per request), attainment, goodput, requests lost; for the planner its
actions and per window the predicted vs measured goodput of the requests admitted in the
window (two_phase_score.py: windows within `--settle` s of a switch or a phase change are
transient and left out of the mean absolute error, and counted); then the issue's goals, met
or not.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from gateway.process.cluster import Cluster, ClusterError, build_config
from gateway.process.cluster import build_parser as cluster_parser
from planner.arrivals import LoadConfig
from planner.datasets import DatasetConfig, Session
from planner.metrics import SLO, RequestTrace
from planner.simulator import HostConfig
from planner.splits import Split, parse_splits
from scripts.flags import config_from_args
from scripts.planning.two_phase_score import (
    GOAL_ATTAINMENT,
    Phase,
    RunResult,
    Schedule,
    TwoPhaseError,
    Workload,
    actions,
    build_schedule,
    check_goals,
    planner_tables,
    read_decisions,
    score_table,
    window_checks,
)
from scripts.serving.benchmark import BenchmarkConfig, warm
from scripts.serving.client import ClientConfig, served_model
from scripts.serving.client import send as send_one

PROFILE = Path("benchmarks/serving-2026-11-24/node_profile.json")  # one thread a node, this CPU
READY_MARK = "[pd-planner] cluster ready: "
# The host model validated against five sweeps on this 2-core CPU (benchmarks/serving-2026-11-24.md:
# 8.0% mean goodput error): processor sharing of 2 cores, host work of 1.60 ms (colocated) /
# 2.37 ms (with prefill nodes) per streamed token, every step 1.15x the in-process profile and
# 10% slower per other step in flight.
CALM_HOST = HostConfig(host_cores=2, threads_per_node=1, slowdown=1.15,
                       overhead_s_per_token=1.60e-3, pd_overhead_s_per_token=2.37e-3,
                       co_runner=0.10)  # fmt: skip


@dataclass(frozen=True)
class PlannerRun:
    actuator: str  # local | switch
    start: Split
    profile: Path
    interval_s: float
    cooldown_s: float
    hysteresis: float
    sim_seconds: float
    sim_warmup_s: float
    host_cores: int
    threads_per_node: int
    lasting_seconds: float = 300.0  # pd-planner's --lasting-seconds
    lasting_hysteresis: float = 0.1  # pd-planner's --lasting-hysteresis
    # The planner's niceness. It shares the nodes' two cores here, and a decision's
    # simulations (~1.4 s of a core every 30 s) slowed the decode steps beside it at the TPOT
    # SLO's edge; deployed, it runs on a host of its own.
    nice: int = 10


@dataclass(frozen=True)
class NodeCapacity:
    """Every node's KV pool and running cap (pd-cluster's --max-total-tokens, the nodes'
    --max-running-requests), given to the cluster and to the planner alike."""

    max_total_tokens: int = 16384  # pd-cluster's default
    max_running_requests: int | None = None  # None: the node's default (256)

    def cluster_args(self) -> list[str]:
        args = ["--max-total-tokens", str(self.max_total_tokens)]
        if self.max_running_requests is not None:
            args += ["--node-args", f"--max-running-requests {self.max_running_requests}"]
        return args

    def planner_args(self) -> list[str]:
        args = ["--node-max-total-tokens", str(self.max_total_tokens)]
        if self.max_running_requests is not None:
            args += ["--node-max-running-requests", str(self.max_running_requests)]
        return args


@dataclass(frozen=True)
class BenchConfig:
    workload: Workload
    budget: int
    splits: tuple[Split, ...]
    planner: PlannerRun | None
    cluster_args: tuple[str, ...]  # extra pd-cluster flags for every run
    warmup: int
    out: Path
    request_timeout_s: float = 300.0
    grace_s: float = 60.0  # after the last phase: then unfinished requests count as failed
    settle_s: float = 15.0  # a planner window this soon after a switch or phase is transient
    nodes: NodeCapacity = field(default_factory=NodeCapacity)


def cluster_argv(config: BenchConfig, split: Split, log_dir: Path) -> list[str]:
    """pd-cluster's flags for a split: every prompt through a prefill node when there is one."""
    return ["--prefill", str(split.prefill), "--decode", str(split.decode),
            "--gateway-args", "--local-prefill-max-tokens 0", "--log-dir", str(log_dir),
            "--log-level", "warning", *config.nodes.cluster_args(),
            *config.cluster_args]  # fmt: skip


def warm_and_send(
    url: str, config: BenchConfig, schedule: Schedule
) -> tuple[list[RequestTrace], float]:
    """Warm up, then send the schedule; returns the traces and the load's zero (monotonic)."""
    client = ClientConfig(url, served_model(url), ignore_eos=True,
                          timeout_s=config.request_timeout_s)  # fmt: skip
    warm_up = DatasetConfig("random", max(1, config.warmup), seed=config.workload.seed + 99)
    warm(BenchmarkConfig(warm_up, LoadConfig(num_sessions=1), client, config.workload.slo),
         config.warmup)  # fmt: skip
    zero = time.perf_counter()  # CLOCK_MONOTONIC: the planner's time.monotonic() too
    deadline = config.workload.total_s + config.grace_s
    return asyncio.run(send_until(schedule, client, zero, deadline)), zero


async def send_until(schedule: Schedule, client: ClientConfig, zero: float,
                     deadline_s: float) -> list[RequestTrace]:  # fmt: skip
    """Each session at its arrival time (scripts/serving/client.py's `send`); what has not
    finished `deadline_s` after `zero` is cancelled and recorded as failed ("unfinished"), so
    an overloaded split's backlog ends the run on time instead of draining for many minutes."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=client.base_url, timeout=client.timeout_s,
                                 limits=limits) as http:  # fmt: skip

        async def one(index: int, session: Session) -> RequestTrace:
            trace, _ = await send_one(http, client, session.turns[0], [], zero)
            trace.session = index
            return trace

        tasks = []
        for index, (at, session) in enumerate(zip(schedule.times, schedule.sessions,
                                                  strict=True)):  # fmt: skip
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - zero)))
            tasks.append(asyncio.create_task(one(index, session)))
        left = deadline_s - (time.perf_counter() - zero)
        await asyncio.wait(tasks, timeout=max(0.0, left))
        traces = []
        for index, task in enumerate(tasks):
            if task.done():
                traces.append(task.result())
                continue
            task.cancel()
            at = schedule.times[index]
            traces.append(RequestTrace(sent=at, done=deadline_s, error="unfinished",
                                       session=index))  # fmt: skip
        await asyncio.gather(*tasks, return_exceptions=True)
    return traces


def quiet_cluster(argv: list[str]) -> Cluster:
    """A launcher whose children log to their files only (`--log-dir`), not to this console."""
    return Cluster(build_config(cluster_parser().parse_args(argv)), out=io.StringIO())


def run_static(config: BenchConfig, split: Split, schedule: Schedule) -> RunResult:
    result = RunResult(split.name, planner=False)
    log_dir = config.out / "logs" / split.name.replace(" ", "_")
    cluster = quiet_cluster(cluster_argv(config, split, log_dir))
    try:
        url = cluster.start(threading.Event())
        traces, _ = warm_and_send(url, config, schedule)
        result.record(config.workload, schedule, traces)
    except ClusterError as exc:
        result.error = f"cluster: {exc} (logs in {log_dir})"
    finally:
        cluster.stop()
    return result


def planner_argv(config: BenchConfig, run: PlannerRun, slo: SLO) -> list[str]:
    return [sys.executable, "-m", "planner", "--actuator", run.actuator,
            *planner_flags(config.budget, run, slo, config.nodes)]  # fmt: skip


def planner_flags(budget: int, run: PlannerRun, slo: SLO, nodes: NodeCapacity) -> list[str]:
    """Every `pd-planner` flag of a planner run but the actuator's."""
    return ["--budget", str(budget), "--profile", str(run.profile),
            "--interval", str(run.interval_s), "--cooldown", str(run.cooldown_s),
            "--hysteresis", str(run.hysteresis), "--headroom", "1",
            "--sim-seconds", str(run.sim_seconds), "--lasting-seconds", str(run.lasting_seconds),
            "--lasting-hysteresis", str(run.lasting_hysteresis),
            "--slo-ttft-ms", str(slo.ttft_ms),
            "--slo-tpot-ms", str(slo.tpot_ms), "--host-cores", str(run.host_cores),
            "--threads-per-node", str(run.threads_per_node), "--sim-warmup",
            str(run.sim_warmup_s), *nodes.planner_args(), *host_args(CALM_HOST)]  # fmt: skip


def host_args(host: HostConfig) -> list[str]:
    """pd-planner's host model flags (`CALM_HOST`: validated on 11-24)."""
    pd = host.overhead(disaggregated=True)
    return ["--slowdown", str(host.slowdown), "--co-runner-slowdown", str(host.co_runner),
            "--host-overhead-ms", f"{host.overhead_s_per_token * 1000:g}",
            "--host-overhead-pd-ms", f"{pd * 1000:g}"]  # fmt: skip


def wait_ready(log: Path, process: subprocess.Popen[bytes], timeout_s: float = 600.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise TwoPhaseError(f"pd-planner exited with {process.returncode}: see {log}")
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(READY_MARK):
                return line[len(READY_MARK) :].strip()
        time.sleep(0.5)
    raise TwoPhaseError(f"pd-planner's cluster not ready after {timeout_s:.0f} s: see {log}")


def run_planner(config: BenchConfig, run: PlannerRun, schedule: Schedule) -> RunResult:
    name = f"planner ({run.actuator}, from {run.start.name})"
    result = RunResult(name, planner=True)
    log, decisions_path = config.out / "planner.log", config.out / "planner_decisions.jsonl"
    argv = planner_argv(config, run, config.workload.slo)
    argv += ["--record", str(config.out / "planner_scrapes.jsonl")]  # for --replay
    if run.nice:
        argv = ["nice", "-n", str(run.nice), *argv]
    cluster: Cluster | None = None
    cluster_args = cluster_argv(config, run.start, config.out / "logs" / "planner")
    if run.actuator == "local":
        argv += ["--cluster-args", shlex.join(cluster_args)]
    else:  # switch: this process starts the cluster, the planner switches its nodes' roles
        cluster = quiet_cluster(cluster_args)
    process = None
    try:
        if cluster is not None:
            url = cluster.start(threading.Event())
            bootstrap = next(c for c in cluster.children if c.name == "bootstrap")
            argv += ["--bootstrap", bootstrap.address, "--gateway-metrics", f"{url}/metrics"]
        with decisions_path.open("wb") as out, log.open("wb") as err:
            process = subprocess.Popen(argv, stdout=out, stderr=err)
        if cluster is None:
            url = wait_ready(log, process)
        traces, zero = warm_and_send(url, config, schedule)
        result.record(config.workload, schedule, traces)
        time.sleep(1.0)  # the decision of the window the load ended in
        decisions = read_decisions(decisions_path.read_text())
        w = config.workload
        boundaries = [w.start_of(i) for i in range(1, len(w.phases))]
        result.checks = window_checks(decisions, traces, zero, w.total_s, w.slo, boundaries,
                                      config.settle_s)  # fmt: skip
        result.actions = actions(decisions, zero)
    except (ClusterError, TwoPhaseError) as exc:
        result.error = str(exc)
    finally:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)  # it stops the cluster it started
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()
        if cluster is not None:
            cluster.stop()
    result.name = name
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="two_phase", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON and the table")
    p.add_argument("--quick", action="store_true", help="phases of 60 s, a faster planner")
    p.add_argument("--budget", type=int, default=3, help="nodes to split")
    p.add_argument("--splits", default="all", help="static splits: 'all' or e.g. 1:2,2:1")
    p.add_argument("--no-planner", action="store_true", help="static splits only")
    p.add_argument("--no-static", action="store_true", help="the planner run only")
    g = p.add_argument_group("workload (phase A prefill-heavy, phase B decode-heavy)")
    g.add_argument("--a-seconds", type=float, default=120.0)
    g.add_argument("--a-rate", type=float, default=2.0, help="requests/s, Poisson")
    g.add_argument("--a-input", type=int, default=384, help="prompt tokens (mean, +-25%%)")
    g.add_argument("--a-output", type=int, default=4, help="output tokens (mean, +-25%%)")
    g.add_argument("--b-seconds", type=float, default=120.0)
    g.add_argument("--b-rate", type=float, default=1.1)
    g.add_argument("--b-input", type=int, default=16)
    g.add_argument("--b-output", type=int, default=256)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--slo-ttft-ms", type=float, default=2500.0)
    g.add_argument("--slo-tpot-ms", type=float, default=80.0)
    g.add_argument("--warmup", type=int, default=3, help="requests before each run")
    g.add_argument("--request-timeout", type=float, default=300.0, help="s without a byte")
    g.add_argument("--grace", type=float, default=60.0,
                   help="s after the last phase; then unfinished requests are lost")  # fmt: skip
    g = p.add_argument_group("cluster and planner")
    g.add_argument("--threads-per-node", type=int, default=1, help="OMP_NUM_THREADS per node")
    g.add_argument("--cluster-args", default="", help="extra pd-cluster flags (quoted)")
    g.add_argument("--actuator", choices=["local", "switch"], default="local")
    g.add_argument("--planner-start", default="1:2", help="the planner run's first split P:D")
    g.add_argument("--profile", type=Path, default=PROFILE)
    g.add_argument("--interval", type=float, default=None, help="s (default 15, --quick 10)")
    g.add_argument("--cooldown", type=float, default=None, help="s (default 45, --quick 25)")
    g.add_argument("--hysteresis", type=float, default=0.05)
    g.add_argument("--sim-seconds", type=float, default=20.0)
    g.add_argument("--sim-warmup", type=float, default=30.0,
                   help="pd-planner's --sim-warmup (its steady state)")  # fmt: skip
    g.add_argument("--lasting-seconds", type=float, default=300.0,
                   help="pd-planner's --lasting-seconds (its tie-break)")  # fmt: skip
    g.add_argument("--lasting-hysteresis", type=float, default=0.1,
                   help="pd-planner's --lasting-hysteresis")  # fmt: skip
    g.add_argument("--planner-nice", type=int, default=10,
                   help="run pd-planner at this niceness (it shares the nodes' cores)")  # fmt: skip
    g.add_argument("--max-total-tokens", type=int, default=16384,
                   help="every node's KV pool in tokens (pd-cluster's flag; the planner "
                   "gets it too)")  # fmt: skip
    g.add_argument("--max-running-requests", type=int, default=None,
                   help="every node's running-request cap (default: the node's, 256)")  # fmt: skip
    g.add_argument("--settle", type=float, default=15.0,
                   help="s after a switch or a phase change in which a planner window is "
                   "transient (left out of the mean prediction error)")  # fmt: skip
    g.add_argument("--host-cores", type=int, default=os.cpu_count() or 1)
    return p


def build_bench(args: argparse.Namespace) -> BenchConfig:
    if args.quick:
        args.a_seconds = args.b_seconds = 60.0
    a = Phase("A prefill-heavy", args.a_seconds, args.a_rate, args.a_input, args.a_output)
    b = Phase("B decode-heavy", args.b_seconds, args.b_rate, args.b_input, args.b_output)
    workload = Workload((a, b), SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
                        args.seed)  # fmt: skip
    start = parse_splits(args.planner_start, args.budget)[0]
    planner = None
    if not args.no_planner:
        planner = config_from_args(
            PlannerRun,
            args,
            start=start,
            interval_s=args.interval or (10.0 if args.quick else 15.0),
            cooldown_s=args.cooldown or (25.0 if args.quick else 45.0),
            sim_warmup_s=args.sim_warmup,
            nice=args.planner_nice,
        )
    if start.nodes != args.budget:
        raise TwoPhaseError(f"--planner-start {start.name} is not {args.budget} nodes (--budget)")
    splits = () if args.no_static else parse_splits(args.splits, args.budget)
    return BenchConfig(workload, args.budget, tuple(splits), planner,
                       tuple(shlex.split(args.cluster_args)), args.warmup, args.out,
                       args.request_timeout, args.grace, args.settle,
                       NodeCapacity(args.max_total_tokens, args.max_running_requests))  # fmt: skip


def write_outputs(config: BenchConfig, runs: list[RunResult], uptime: list[str]) -> str:
    w = config.workload
    goals = check_goals(runs, GOAL_ATTAINMENT)
    lines = [
        f"SLO: TTFT <= {w.slo.ttft_ms:g} ms and TPOT <= {w.slo.tpot_ms:g} ms per request; "
        f"goodput = requests meeting both / phase seconds; budget {config.budget} nodes",
        *(
            f"phase {p.name}: {p.duration_s:g} s at {p.rate:g} req/s, {p.input_len} in / "
            f"{p.output_len} out (+-{p.range_ratio:.0%})"
            for p in w.phases
        ),
        *(f"load: {u}" for u in uptime),
        "",
        score_table(runs),
        "",
    ]
    for run in runs:
        if run.planner and not run.error:
            lines += [planner_tables(run), ""]
    lines += ["Goals:", *goals.lines()]
    text = "\n".join(lines)
    doc = {
        "workload": {
            "phases": [asdict(p) for p in w.phases],
            "slo": asdict(w.slo),
            "seed": w.seed,
        },
        "budget": config.budget,
        "planner": None
        if config.planner is None
        else {
            **asdict(config.planner),
            "start": config.planner.start.name,
            "profile": str(config.planner.profile),
        },
        "cluster_args": list(config.cluster_args),
        "nodes": asdict(config.nodes),
        "settle_s": config.settle_s,
        "load": uptime,
        "runs": [r.to_json() for r in runs],
        "goals": asdict(goals),
    }
    (config.out / "two_phase.json").write_text(json.dumps(doc, indent=1))
    (config.out / "two_phase.md").write_text(text + "\n")
    return text


def uptime_line() -> str:
    return f"{time.strftime('%H:%M:%S', time.gmtime())} UTC, load average " + " ".join(
        f"{x:.2f}" for x in os.getloadavg()
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = build_bench(args)
        schedule = build_schedule(config.workload)
    except ValueError as exc:
        print(f"two_phase: error: {exc}", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = str(args.threads_per_node)  # inherited by every node
    config.out.mkdir(parents=True, exist_ok=True)
    runs, uptime = [], [uptime_line()]
    for split in config.splits:
        print(f"[two_phase] {split.name} ...", flush=True)
        runs.append(run_static(config, split, schedule))
        uptime.append(uptime_line())
        write_outputs(config, runs, uptime)  # a run stopped later keeps the runs done
        print(score_table(runs[-1:]), flush=True)
    if config.planner is not None:
        print(f"[two_phase] planner ({config.planner.actuator}) ...", flush=True)
        runs.append(run_planner(config, config.planner, schedule))
        uptime.append(uptime_line())
    print(write_outputs(config, runs, uptime))
    print(f"wrote {config.out / 'two_phase.json'} and {config.out / 'two_phase.md'}")
    return 0 if all(not r.error for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
