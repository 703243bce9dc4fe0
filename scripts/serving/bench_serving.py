"""Load test of any OpenAI-compatible server: TTFT / ITL / TPOT / E2E, throughput, goodput.

`pdserve-bench` (the console script; `python -m scripts.serving.bench_serving` alike) sends a
workload (datasets: random, prefix, sharegpt, multiturn, conversation, and mooncake: a trace
replayed at its own timestamps, `--dataset mooncake --dataset-path trace.jsonl`; see
planner/datasets.py) with Poisson arrivals (`--request-rate`, `--burstiness`), at most
`--max-concurrency` sessions in flight, for `--num-prompts` sessions or `--duration` seconds;
every request streams. Prints a summary table; `--output-file` writes every setting, figure and
per-request trace as JSON; `--plot DIR` writes PNGs (latency CDFs, TTFT/TPOT over time,
throughput over time). Metric definitions: planner/metrics.py.

`--workers N` sends the load from N client processes sharing one schedule
(scripts/serving/workers.py); every client's CPU is reported, with a warning when one used more
than 85% of a core (the client, not the server, may then set the figures). `--watch-port
NAME=PORT` / `--watch-pid NAME=PID` add server processes (gateway, nodes) to that CPU table
(scripts/serving/procstat.py), and `--watch-metrics NAME=URL` a node's step split from its
/metrics (scripts/serving/node_metrics.py).

    .venv/bin/python -m scripts.serving.bench_serving --base-url http://127.0.0.1:8000 \\
        --dataset random --random-input-len 256 --random-output-len 32 --num-prompts 50 \\
        --request-rate 1 --ignore-eos --slo-ttft-ms 2000 --slo-tpot-ms 200 \\
        --output-file out.json --plot plots/
    # a served run at tens of thousands of tokens/s, with the server's CPU:
    .venv/bin/python -m scripts.serving.bench_serving --base-url http://127.0.0.1:8000 \
        --random-input-len 16 --random-output-len 512 --ignore-eos --num-prompts 768 \
        --max-concurrency 256 --workers 4 --watch-port gateway=8000 \
        --watch-port decode-0=30001 --watch-metrics decode-0=http://127.0.0.1:30002/metrics

Multi-turn workloads (and any run whose server reports `cached_tokens`) also print TTFT per
turn index and the measured prefix-cache hit rate beside the best the workload allows:

    .venv/bin/python -m scripts.serving.bench_serving --base-url http://127.0.0.1:8000 \
        --dataset conversation --num-prompts 16 --multiturn-turns 6 \
        --conversation-system-len 1024 --random-input-len 64 --random-output-len 32 \
        --think-time 1 --ignore-eos

Exit codes: 0 done (even with failed requests: see the error counts), 2 bad options or data,
3 the server does not answer.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from planner.arrivals import LoadConfig
from planner.datasets import GENERATORS, DatasetConfig, build_sessions
from planner.metrics import SLO
from scripts.flags import config_from_args
from scripts.serving.benchmark import BenchmarkConfig, run_benchmark
from scripts.serving.client import (
    ClientConfig,
    ServerUnreachable,
    normalize_base_url,
    served_model,
)
from scripts.serving.node_metrics import MetricsError, MetricsWatch, StepSplit, parse_target
from scripts.serving.procstat import CpuWatch, ProcessCpu, WatchSpec, saturation_warnings
from scripts.serving.report import (
    cache_summary,
    cpu_table,
    document,
    plot,
    pyplot,
    step_table,
    table,
    timing_table,
    turn_table,
    write_json,
)
from scripts.serving.workers import WorkerError, deal


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Dataset, arrival and SLO flags (shared with tune_ratio.py)."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", default="random", choices=sorted(GENERATORS))
    g.add_argument(
        "--dataset-path", type=Path, default=None, help="ShareGPT JSON or Mooncake JSONL file"
    )
    g.add_argument("--random-input-len", type=int, default=128, help="tokens (mean)")
    g.add_argument("--random-output-len", type=int, default=32, help="tokens (mean)")
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths +- ratio")
    g.add_argument("--token-id-range", default="1000:10000", help="random prompt ids LOW:HIGH")
    g.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens")
    g.add_argument("--prefix-group-size", type=int, default=8, help="requests per prefix")
    g.add_argument("--multiturn-turns", type=int, default=3, help="user turns per conversation")
    g.add_argument(
        "--conversation-system-len",
        type=int,
        default=1024,
        help="conversation: tokens of the system prompt every session shares",
    )
    g.add_argument(
        "--think-time", type=float, default=0.0, help="conversation: seconds between turns"
    )
    g.add_argument(
        "--mooncake-block-size", type=int, default=512, help="mooncake: tokens per hash id"
    )
    g.add_argument(
        "--cache-block-size",
        type=int,
        default=16,
        help="the server's cache block (page) size: the best hit rate counts whole blocks",
    )
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="default: reply's")
    g.add_argument("--sharegpt-max-output-len", type=int, default=256)
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=None, help="sessions (default 100)")
    g.add_argument("--duration", type=float, default=None, help="seconds of arrivals instead")
    g.add_argument("--request-rate", type=float, default=math.inf, help="sessions/s, or inf")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="exact output lengths")
    g.add_argument("--temperature", type=float, default=0.0)
    g = parser.add_argument_group("SLOs (goodput counts requests meeting all given)")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--slo-e2e-ms", type=float, default=None)


def dataset_config(args: argparse.Namespace, num_sessions: int) -> DatasetConfig:
    try:
        low, high = (int(x) for x in args.token_id_range.split(":"))
    except ValueError:
        raise ValueError(
            f"--token-id-range must be LOW:HIGH, got {args.token_id_range!r}"
        ) from None
    return config_from_args(
        DatasetConfig,
        args,
        name=args.dataset,
        num_sessions=num_sessions,
        input_len=args.random_input_len,
        output_len=args.random_output_len,
        range_ratio=args.random_range_ratio,
        token_id_low=low,
        token_id_high=high,
        turns=args.multiturn_turns,
        path=args.dataset_path,
        system_len=args.conversation_system_len,
        think_s=args.think_time,
    )


def load_config(args: argparse.Namespace, request_rate: float | None = None) -> LoadConfig:
    num = args.num_prompts
    if num is None and args.duration is None:
        num = 100
    return config_from_args(
        LoadConfig,
        args,
        request_rate=args.request_rate if request_rate is None else request_rate,
        num_sessions=num,
        duration_s=args.duration,
    )


def slo_config(args: argparse.Namespace) -> SLO:
    return SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms, e2e_ms=args.slo_e2e_ms)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve-bench",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    add_workload_args(parser)
    g = parser.add_argument_group("output")
    g.add_argument("--output-file", type=Path, default=None, help="JSON with every field")
    g.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write PNGs here")
    g.add_argument("--label", default="", help="title of the table and prefix of the PNGs")
    g.add_argument("--no-progress", action="store_true")
    g = parser.add_argument_group("client processes and server CPU")
    g.add_argument("--workers", type=int, default=1, help="client processes sharing the load")
    g.add_argument(
        "--watch-pid",
        action="append",
        default=[],
        metavar="NAME=PID",
        help="report this process's CPU (and its children's); repeatable",
    )
    g.add_argument(
        "--watch-port",
        action="append",
        default=[],
        metavar="NAME=PORT",
        help="report the CPU of the processes listening on this TCP port",
    )
    g.add_argument("--watch-metrics", action="append", default=[], metavar="NAME=URL",
                   help="a node's /metrics: its step split over the run")  # fmt: skip
    return parser


@dataclass(frozen=True)
class Watches:
    """What the run observes besides its own requests (flags checked before any load)."""

    cpu: CpuWatch
    metrics: MetricsWatch

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Watches:
        specs = [WatchSpec.parse(t, "pid") for t in args.watch_pid]
        specs += [WatchSpec.parse(t, "port") for t in args.watch_port]
        return cls(CpuWatch(specs), MetricsWatch([parse_target(t) for t in args.watch_metrics]))

    def start(self) -> None:
        now = time.perf_counter()
        self.cpu.start(now)
        self.metrics.start(now)

    def stop(self) -> tuple[list[ProcessCpu], list[StepSplit]]:
        now = time.perf_counter()
        return self.cpu.stop(now), self.metrics.stop(now)


def build_config(args: argparse.Namespace) -> BenchmarkConfig:
    """Everything the run needs, checked; ValueError names the flag that is wrong."""
    load = load_config(args)
    # With --duration the workload is cycled: 1,000 sessions are plenty of variety.
    dataset = dataset_config(args, load.num_sessions or 1000)
    slo = slo_config(args)
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    deal([], args.workers, load.max_concurrency)  # --workers against --max-concurrency
    base_url = normalize_base_url(args.base_url)
    client = ClientConfig(
        base_url, args.model or "", args.ignore_eos, args.temperature, args.timeout, args.api_key
    )
    return BenchmarkConfig(dataset, load, client, slo)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = build_config(args)
        sessions = build_sessions(config.dataset)  # bad data fails before any request
        if args.plot is not None:
            pyplot()  # fail now, not after the run
        if not config.client.model:
            model = served_model(config.client.base_url)
            config = BenchmarkConfig(
                config.dataset, config.load, _with_model(config.client, model), config.slo
            )
        else:
            served_model(config.client.base_url)  # fail fast if nothing answers
        watches = Watches.from_args(args)
        watches.start()
        run = run_benchmark(config, sessions, not args.no_progress, args.workers)
        servers, steps = watches.stop()
    except (ServerUnreachable, MetricsError) as exc:
        print(f"bench_serving: error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("bench_serving: interrupted", file=sys.stderr)
        return 130
    except (ValueError, ImportError) as exc:
        print(f"bench_serving: error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"bench_serving: error: {exc}", file=sys.stderr)
        return 1
    print(table(run.summary, args.label or f"{config.dataset.name} @ {args.request_rate} req/s"))
    usages = [*run.clients, *servers]
    print(cpu_table(usages, run.summary.output_tokens))
    if steps:
        print(step_table(steps))
    breakdown = timing_table(run.load.traces)
    if breakdown:
        print(breakdown)
    block = args.cache_block_size
    if any(t.turn or t.cached_tokens or t.reusable_tokens for t in run.load.traces):
        print(turn_table(run.load.traces, block))
    for line in saturation_warnings(run.clients):
        print(line, file=sys.stderr)
    if args.output_file is not None:
        doc = document(run.summary, run.load.traces, {**config.settings(), "workers": args.workers})
        doc["cpu"] = [{**asdict(u), "core_fraction": u.core_fraction} for u in usages]
        doc["node_steps"] = [asdict(s) for s in steps]
        cache = cache_summary(run.load.traces, block)
        doc["cache"] = {**asdict(cache), "hit_rate": cache.hit_rate, "best_rate": cache.best_rate}
        write_json(args.output_file, doc)
        print(f"wrote {args.output_file}")
    if args.plot is not None:
        prefix = f"{args.label}_" if args.label else ""
        for path in plot(run.load.traces, args.plot, prefix):
            print(f"wrote {path}")
    return 0


def _with_model(client: ClientConfig, model: str) -> ClientConfig:
    from dataclasses import replace

    return replace(client, model=model)


if __name__ == "__main__":
    sys.exit(main())
