"""Prefill:decode ratio tuning: each split of a node budget, and colocated, at a sweep of rates.

For every split (`--splits 1:1,1:2,2:1,colocated`, or `all` for every P:D of `--budget` plus
colocated) this starts a cluster with `pd-cluster`'s launcher (bootstrap + P prefill + D decode
nodes + the gateway, on 127.0.0.1), sends a few warm-up requests, then runs the same workload
(bench_serving.py's dataset and SLO flags) at each rate of `--rates`, and stops the cluster.
Each rate gets fresh prompts (dataset seed `--seed` + 1000 * (rate index + 1), same lengths
distribution; recorded per point), so no rate is served from an earlier rate's prefix cache.
Disaggregated splits send every prompt through a prefill node (the gateway's
`--local-prefill-max-tokens 0`); colocated runs decode nodes that prefill themselves.

Reported per split: goodput and SLO attainment at each rate, and the highest rate at which at
least `--slo-attainment` of the requests met every SLO; the best split is the one with the
highest such rate. Writes `tune_ratio.json` (every summary) and `goodput_vs_rate.png` under
`--output-dir`. The same command works on a GPU host (pass `--node-args "--device cuda ..."`,
and `--devices cuda:0,cuda:1` to give each node a GPU of its own).

    .venv/bin/python -m scripts.planning.tune_ratio --budget 2 --splits 1:1,colocated \\
        --rates 0.2,0.4 \\
        --num-prompts 30 --random-input-len 256 --random-output-len 16 --ignore-eos \\
        --slo-ttft-ms 3000 --slo-tpot-ms 300 --output-dir benchmarks/serving-run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gateway.process.cluster import Cluster, ClusterConfig, ClusterError, parse_devices
from planner.datasets import build_sessions
from planner.metrics import RequestTrace
from planner.splits import Split, SplitError, parse_splits
from scripts.flags import add_cluster_args, cluster_config
from scripts.planning.sweep import (
    RatePoint,
    SplitResult,
    best_split,
    parse_rates,
    plot_goodput,
    sweep_table,
)
from scripts.serving.bench_serving import (
    add_workload_args,
    dataset_config,
    load_config,
    slo_config,
)
from scripts.serving.benchmark import BenchmarkConfig, run_benchmark, warm
from scripts.serving.client import ClientConfig, served_model
from scripts.serving.report import pyplot, timing_table


@dataclass(frozen=True)
class TuneConfig:
    splits: tuple[Split, ...]
    rates: tuple[float, ...]
    attainment: float  # fraction of requests that must meet the SLOs
    warmup: int  # requests sent before the sweep of each split (not measured)
    bench: BenchmarkConfig  # the workload; base_url and model are filled per cluster
    cluster: ClusterConfig  # prefill/decode are replaced per split
    pd_gateway_args: tuple[str, ...]  # extra gateway flags of disaggregated splits
    output_dir: Path
    progress: bool = True
    breakdown: bool = False  # print the gateway's per-segment breakdown after each rate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = parser.add_argument_group("sweep")
    g.add_argument("--budget", type=int, default=4, help="nodes per cluster")
    g.add_argument("--splits", default="all", help="P:D list and/or 'colocated', or 'all'")
    g.add_argument("--rates", default="0.25,0.5,1,2", help="request rates (req/s)")
    g.add_argument("--slo-attainment", type=float, default=0.9, help="fraction of requests")
    g.add_argument("--warmup", type=int, default=2, help="unmeasured requests per cluster")
    g.add_argument("--output-dir", type=Path, required=True)
    g.add_argument("--no-progress", action="store_true")
    g.add_argument(
        "--breakdown", action="store_true", help="print each rate's server-side time breakdown"
    )
    g = parser.add_argument_group("cluster (as pd-cluster)")
    add_cluster_args(g)
    g.add_argument(
        "--devices", default="", help="devices given to the nodes in turn (as pd-cluster)"
    )
    g.add_argument(
        "--pd-local-prefill-max-tokens",
        type=int,
        default=0,
        help="disaggregated splits: prompts up to this long are prefilled on D (default 0)",
    )
    g.add_argument(
        "--threads-per-node",
        type=int,
        default=0,
        help="OMP_NUM_THREADS of each node process (0: leave as is); CPU hosts only",
    )
    add_workload_args(parser)
    return parser


def build_config(args: argparse.Namespace) -> TuneConfig:
    splits = parse_splits(args.splits, args.budget)
    rates = parse_rates(args.rates)
    if not 0 < args.slo_attainment <= 1:
        raise SplitError(f"--slo-attainment must be in (0, 1], got {args.slo_attainment}")
    if args.warmup < 0:
        raise SplitError(f"--warmup must be >= 0, got {args.warmup}")
    slo = slo_config(args)
    if not slo.given:
        raise SplitError("give at least one of --slo-ttft-ms, --slo-tpot-ms, --slo-e2e-ms")
    load = load_config(args, request_rate=rates[0])
    dataset = dataset_config(args, load.num_sessions or 1000)
    client = ClientConfig("http://unset", "", args.ignore_eos, args.temperature)
    cluster = cluster_config(args, 0, 1, devices=parse_devices(args.devices))
    pd_args = ("--local-prefill-max-tokens", str(args.pd_local_prefill_max_tokens))
    return TuneConfig(
        splits=splits,
        rates=rates,
        attainment=args.slo_attainment,
        warmup=args.warmup,
        bench=BenchmarkConfig(dataset, load, client, slo),
        cluster=cluster,
        pd_gateway_args=pd_args,
        output_dir=args.output_dir,
        progress=not args.no_progress,
        breakdown=args.breakdown,
    )


def cluster_for(config: TuneConfig, split: Split) -> ClusterConfig:
    gateway_args = config.cluster.gateway_args
    if not split.colocated:
        gateway_args = (*config.pd_gateway_args, *gateway_args)
    log_dir = config.output_dir / "logs" / split.name.replace(" ", "_")
    return replace(
        config.cluster,
        prefill=split.prefill,
        decode=split.decode,
        gateway_args=gateway_args,
        log_dir=log_dir,
    )


def sweep_split(config: TuneConfig, split: Split) -> SplitResult:
    result = SplitResult(split)
    cluster_config = cluster_for(config, split)
    assert cluster_config.log_dir is not None
    cluster_config.log_dir.mkdir(parents=True, exist_ok=True)
    with (cluster_config.log_dir / "cluster.out").open("w") as out:
        cluster = Cluster(cluster_config, out=out)
        try:
            started = time.monotonic()
            url = cluster.start(threading.Event())
            print(f"[{split.name}] up at {url} in {time.monotonic() - started:.0f} s", flush=True)
            client = replace(config.bench.client, base_url=url, model=served_model(url))
            bench = replace(config.bench, client=client)
            warm(bench, config.warmup)
            for i, rate in enumerate(config.rates):
                seed = rate_seed(bench.dataset.seed, i)
                run = run_benchmark(
                    replace(
                        bench,
                        dataset=replace(bench.dataset, seed=seed),
                        load=replace(bench.load, request_rate=rate),
                    ),
                    progress=config.progress,
                )
                point = RatePoint(rate, run.summary, seed, per_request(run.load.traces))
                result.points.append(point)
                if config.breakdown:
                    print(timing_table(run.load.traces), flush=True)
                dead = cluster.dead_children()
                if dead:  # the other nodes served this rate: its figures are not the split's
                    names = ", ".join(c.name for c in dead)
                    result.error = (
                        f"{names} died at rate {rate:g} (logs in {cluster_config.log_dir})"
                    )
                    print(f"[{split.name}] {result.error}", flush=True)
                    break
                print(
                    f"[{split.name}] rate {rate:g}: goodput {point.goodput:.3f} req/s, "
                    f"SLO met {point.attainment:.0%}, failed {run.summary.failed}",
                    flush=True,
                )
        except ClusterError as exc:
            result.error = f"cluster did not start: {exc} (logs in {cluster_config.log_dir})"
        finally:
            cluster.stop()
    return result


def per_request(traces: list[RequestTrace]) -> list[tuple[float | None, float | None]]:
    """(TTFT ms, TPOT ms) of each completed request."""
    return [(_ms(t.ttft), _ms(t.tpot)) for t in traces if t.ok]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def rate_seed(seed: int, index: int) -> int:
    """Dataset seed of the index-th rate: fresh prompts per rate, or the prefix cache would
    serve every prompt of the second rate from the first one's KV."""
    return seed + 1000 * (index + 1)


def write_outputs(config: TuneConfig, results: list[SplitResult]) -> None:
    best = best_split(results, config.attainment)
    doc: dict[str, Any] = {
        "settings": {
            **config.bench.settings(),
            "request_rate": None,  # swept: see "rates"
            "rates": list(config.rates),
            "slo_attainment": config.attainment,
            "splits": [s.name for s in config.splits],
            "node_args": list(config.cluster.node_args),
            "threads_per_node": os.environ.get("OMP_NUM_THREADS", ""),
        },
        "best_split": best.split.name if best else None,
        "results": [r.to_json(config.attainment) for r in results],
    }
    path = config.output_dir / "tune_ratio.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    png = config.output_dir / "goodput_vs_rate.png"
    plot_goodput(results, png, f"goodput vs rate ({config.bench.dataset.name} workload)")
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = build_config(args)
        build_sessions(config.bench.dataset)  # bad data fails before any cluster starts
        pyplot()
    except (ValueError, ImportError) as exc:
        print(f"tune_ratio: error: {exc}", file=sys.stderr)
        return 2
    if args.threads_per_node > 0:  # inherited by every node process the launcher starts
        os.environ["OMP_NUM_THREADS"] = str(args.threads_per_node)
    config.output_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for split in config.splits:
        results.append(sweep_split(config, split))
    print(sweep_table(results, config.attainment))
    write_outputs(config, results)
    return 0 if all(not r.error for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
