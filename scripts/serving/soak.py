"""Soak test: a cluster under 70% of its measured capacity for a long time; fail if anything grows.

Starts a cluster with pd-cluster's launcher (bootstrap + `--prefill` P + `--decode` D nodes +
the gateway on 127.0.0.1, every prompt through a prefill node), sends a few warm-up requests,
measures capacity (a closed burst of `--capacity-requests` requests, `--capacity-concurrency`
at a time: completed requests / s) unless `--capacity` gives it, then drives Poisson load at
`--load-fraction` (0.7) of it with bench_serving's load generator for `--duration` seconds.
Every `--interval` seconds it samples each process (RSS, open files, threads, KV usage, queue
gauges, cumulative error counters: scripts/serving/probes.py), prints a progress line and
appends to `samples.csv`. After the load it waits for every node to go idle and runs their KV
integrity check (no page may stay in use). `summary.md` holds the settings, request figures,
errors per process, one growth verdict per (process, quantity) and the result.

Fails (exit 1) when a judged quantity grows (rule: scripts/serving/growth.py, tolerances:
scripts/serving/soak_report.py), when more than `--max-errors` errors occurred (client-side
failures plus every process's error counters), when a page is still in use after the drain,
or when a process exited. Exit 2: bad flags; 3: the cluster did not start.

    .venv/bin/python -m scripts.serving.soak --duration 1800 --output-dir /tmp/soak
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import grpc

from gateway.process.cluster import Cluster, ClusterConfig, ClusterError
from gateway.process.launcher import loopback_transports
from planner.arrivals import LoadConfig
from planner.datasets import DatasetConfig, build_sessions
from planner.metrics import SLO, summarize
from proto import node_pb2, node_pb2_grpc
from scripts.flags import add_cluster_args, cluster_config, config_from_args
from scripts.serving.benchmark import BenchmarkConfig, run_benchmark
from scripts.serving.client import ClientConfig, served_model
from scripts.serving.load import LoadResult, run_load
from scripts.serving.probes import Prober, Target
from scripts.serving.soak_report import (
    Findings,
    SampleLog,
    judge_samples,
    markdown,
    new_errors,
    write_markdown,
)


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float
    interval_s: float
    load_fraction: float
    capacity: float | None  # req/s; None: measure it
    capacity_requests: int
    capacity_concurrency: int
    max_concurrency: int
    max_errors: int
    drain_timeout_s: float
    workload: DatasetConfig  # num_sessions and seed are set per phase
    client: ClientConfig  # base_url and model are filled once the cluster is up
    cluster: ClusterConfig
    output_dir: Path

    def __post_init__(self) -> None:
        checks = [
            (self.duration_s > 0, f"--duration must be > 0 s, got {self.duration_s}"),
            (self.interval_s > 0, f"--interval must be > 0 s, got {self.interval_s}"),
            (0 < self.load_fraction <= 1, f"--load-fraction must be in (0, 1], got "
             f"{self.load_fraction}"),
            (self.capacity is None or self.capacity > 0, f"--capacity must be > 0 req/s, got "
             f"{self.capacity}"),
            (self.capacity_requests >= 1, "--capacity-requests must be >= 1"),
            (self.capacity_concurrency >= 1, "--capacity-concurrency must be >= 1"),
            (self.max_concurrency >= 1, "--max-concurrency must be >= 1"),
            (self.max_errors >= 0, "--max-errors must be >= 0"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = parser.add_argument_group("soak")
    g.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    g.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    g.add_argument("--load-fraction", type=float, default=0.7, help="of the capacity")
    g.add_argument("--capacity", type=float, default=None, help="req/s (default: measure)")
    g.add_argument("--capacity-requests", type=int, default=24)
    g.add_argument("--capacity-concurrency", type=int, default=8)
    g.add_argument("--max-concurrency", type=int, default=32, help="requests in flight, at most")
    g.add_argument("--max-errors", type=int, default=0, help="errors tolerated in the run")
    g.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to go idle")
    g.add_argument("--output-dir", type=Path, required=True)
    g = parser.add_argument_group("workload (random token ids, every request streamed)")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean)")
    g.add_argument("--output-len", type=int, default=32, help="generated tokens (mean)")
    g.add_argument("--range-ratio", type=float, default=0.5, help="lengths vary by +- this")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    g = parser.add_argument_group("cluster (as pd-cluster)")
    g.add_argument("--prefill", type=int, default=1)
    g.add_argument("--decode", type=int, default=1)
    add_cluster_args(
        g,
        "--local-prefill-max-tokens 0",
        "extra flags for the gateway (default: every prompt through a prefill node)",
    )
    return parser


def build_config(args: argparse.Namespace) -> SoakConfig:
    if args.prefill < 0 or args.decode < 1:
        raise ValueError("--prefill must be >= 0 and --decode >= 1")
    workload = config_from_args(
        DatasetConfig,
        args,
        name="random",
        num_sessions=1,
    )
    cluster = cluster_config(args, args.prefill, args.decode, log_dir=args.output_dir / "logs")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 s, got {args.timeout}")
    return config_from_args(
        SoakConfig,
        args,
        duration_s=args.duration,
        interval_s=args.interval,
        drain_timeout_s=args.drain_timeout,
        workload=workload,
        client=ClientConfig("http://unset", "", ignore_eos=True, timeout_s=args.timeout),
        cluster=cluster,
    )


def measure_capacity(config: SoakConfig) -> float:
    """Completed requests / s of a closed burst at the configured concurrency."""
    dataset = replace(
        config.workload, num_sessions=config.capacity_requests, seed=config.workload.seed + 1
    )
    load = LoadConfig(
        request_rate=math.inf,
        max_concurrency=config.capacity_concurrency,
        num_sessions=config.capacity_requests,
    )
    run = run_benchmark(BenchmarkConfig(dataset, load, config.client, SLO()), progress=False)
    if run.summary.completed == 0:
        raise RuntimeError(f"capacity probe: every request failed: {run.summary.errors}")
    return run.summary.request_throughput


def targets(cluster: Cluster) -> list[Target]:
    out = []
    for child in cluster.children:
        node = child.name.startswith(("prefill", "decode"))
        address = child.address if node else ""
        out.append(Target(child.name, child.process.pid, child.metrics_url, address))
    return out


class LoadThread(threading.Thread):
    """bench_serving's load generator on its own event loop; `result` once it has finished."""

    def __init__(self, config: SoakConfig, rate: float) -> None:
        super().__init__(name="soak-load", daemon=True)
        sessions = math.ceil(rate * config.duration_s * 1.2) + 8  # no prompt sent twice
        dataset = replace(config.workload, num_sessions=sessions, seed=config.workload.seed + 2)
        self.sessions = build_sessions(dataset)
        self.client = config.client
        self.load = LoadConfig(
            request_rate=rate,
            max_concurrency=config.max_concurrency,
            num_sessions=None,
            duration_s=config.duration_s,
            seed=config.workload.seed,
        )
        self.result: LoadResult | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = asyncio.run(run_load(self.sessions, self.client, self.load, False))
        except BaseException as exc:  # reported by the main thread
            self.error = exc


def progress_line(log: SampleLog, names: list[str], elapsed: float, total: float) -> str:
    parts = [f"[soak {elapsed:5.0f}/{total:.0f} s]"]
    for name in names:
        rss, fds = log.latest(name, "rss_mib"), log.latest(name, "open_fds")
        errors = log.latest(name, "errors")
        piece = f"{name} {rss or 0:.0f}MiB {fds or 0:.0f}fd err {errors or 0:.0f}"
        used, cached = log.latest(name, "kv_used"), log.latest(name, "kv_cached")
        if used is not None and cached is not None:
            queued = log.latest(name, "queued") or 0
            piece += f" kv {used:.2f}+{cached:.2f}c q {queued:.0f}"
        parts.append(piece)
    return " | ".join(parts)


def sample_until_done(
    config: SoakConfig, cluster: Cluster, prober: Prober, log: SampleLog, load: LoadThread
) -> None:
    names = [t.name for t in prober.targets]
    start = time.monotonic()
    next_at = start
    while True:
        elapsed = time.monotonic() - start
        log.add(prober.sample(elapsed))
        print(progress_line(log, names, elapsed, config.duration_s), flush=True)
        if not load.is_alive() or cluster.dead_children():
            return
        next_at += config.interval_s
        load.join(max(next_at - time.monotonic(), 0.0))


def drain_and_check(config: SoakConfig, prober: Prober) -> list[str]:
    """Wait until every node is idle with no page in use; the problems left, one line each."""
    problems = []
    deadline = time.monotonic() + config.drain_timeout_s
    for target in prober.targets:
        if not target.node_address:
            continue
        with grpc.insecure_channel(target.node_address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            problems += _wait_idle(target.name, stub, deadline)
    return problems


def _wait_idle(name: str, stub: node_pb2_grpc.NodeStub, deadline: float) -> list[str]:
    while True:
        try:
            load = stub.GetLoad(node_pb2.GetLoadRequest(), timeout=10)
            check = stub.CheckIntegrity(node_pb2.CheckIntegrityRequest(), timeout=30)
        except grpc.RpcError as exc:
            return [f"{name}: no answer after the load ({exc.code().name})"]
        idle = load.running_requests == 0 and load.queued_requests == 0
        if not check.ok:
            return [f"{name}: integrity check failed: {check.error}"]
        if idle and check.used_pages == 0:
            return []
        if time.monotonic() > deadline:
            return [
                f"{name}: {check.used_pages} pages in use, {load.running_requests} running, "
                f"{load.queued_requests} queued after the drain timeout"
            ]
        time.sleep(0.5)


def soak(config: SoakConfig) -> int:
    loopback_transports()  # as pd-cluster
    config.output_dir.mkdir(parents=True, exist_ok=True)
    with (config.output_dir / "cluster.out").open("w") as out:
        cluster = Cluster(config.cluster, out=out)
        try:
            url = cluster.start(threading.Event())
            client = replace(config.client, base_url=url, model=served_model(url))
            return _soak_running(replace(config, client=client), cluster)
        except ClusterError as exc:
            print(
                f"soak: cluster did not start: {exc} (logs: {config.output_dir})", file=sys.stderr
            )
            return 3
        finally:
            cluster.stop()


def _soak_running(config: SoakConfig, cluster: Cluster) -> int:
    print(f"[soak] cluster up at {config.client.base_url}", flush=True)
    warm = replace(config, capacity_requests=2, capacity_concurrency=2)
    measure_capacity(warm)  # first-request costs out of the measurement
    capacity = config.capacity or measure_capacity(config)
    rate = capacity * config.load_fraction
    print(f"[soak] capacity {capacity:.3f} req/s -> load {rate:.3f} req/s", flush=True)
    prober = Prober(targets(cluster))
    with (config.output_dir / "samples.csv").open("w", newline="") as stream:
        log = SampleLog(stream)
        load = LoadThread(config, rate)
        load.start()
        sample_until_done(config, cluster, prober, log, load)
        findings = Findings(max_errors=config.max_errors)
        findings.dead = [c.name for c in cluster.dead_children()]
        if not findings.dead:  # else stop now: the load thread dies with the process
            load.join()
            findings.leaks = drain_and_check(config, prober)
        log.add(prober.sample(log.samples[-1].t + config.interval_s))  # after the drain
    prober.close()
    if load.error is not None:
        raise load.error
    summary = None
    if load.result is not None:
        summary = summarize(load.result.traces, load.result.duration_s, SLO())
        findings.client_failed = summary.failed
    findings.verdicts = judge_samples(log)
    findings.errors = new_errors(log, [t.name for t in prober.targets])
    findings.probe_failures = int(
        sum(s.value for s in log.samples if s.quantity == "probe_failures")
    )
    settings = _settings(config, capacity, rate)
    text = markdown("Soak test", settings, summary, findings)
    write_markdown(config.output_dir / "summary.md", text)
    print(text, flush=True)
    print(f"[soak] wrote {config.output_dir / 'summary.md'} and samples.csv", flush=True)
    return 1 if findings.failed else 0


def _settings(config: SoakConfig, capacity: float, rate: float) -> dict[str, object]:
    c = config.cluster
    return {
        "cluster": f"{c.prefill}P{c.decode}D, {c.backend}, model {c.model or 'SmolLM2-135M'}, "
        f"{c.max_total_tokens} KV tokens per node, gateway {' '.join(c.gateway_args)}",
        "capacity (req/s)": f"{capacity:.3f} ({'given' if config.capacity else 'measured'})",
        "offered load (req/s)": f"{rate:.3f} ({config.load_fraction:.0%} of capacity)",
        "duration (s)": f"{config.duration_s:g}, sampled every {config.interval_s:g} s",
        "workload": {
            k: v
            for k, v in asdict(config.workload).items()
            if k in ("input_len", "output_len", "range_ratio", "seed")
        },
        "max concurrency": config.max_concurrency,
        "max errors": config.max_errors,
    }


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM like Ctrl-C: the cluster is stopped on the way out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        config = build_config(args)
    except ValueError as exc:
        print(f"soak: error: {exc}", file=sys.stderr)
        return 2
    return soak(config)


if __name__ == "__main__":
    sys.exit(main())
