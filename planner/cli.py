"""pd-planner: every `--interval` seconds, read the gateway's metrics, estimate the last window's
workload, ask the simulator which P:D split of the node budget best meets the SLO, correct the
simulator with what was measured, and act with hysteresis and a cool-down.

    python -m planner --gateway-metrics http://GW/metrics \\
        --profile profile.json --budget 3 --slo-ttft-ms 1000 --slo-tpot-ms 50 --dry-run
    pd-planner ... --actuator switch --bootstrap HOST:PORT      # the console script
    python -m planner ... --actuator kubernetes --namespace pdserve
    python -m planner ... --record scrapes.jsonl      # keep what it read
    python -m planner ... --replay scrapes.jsonl      # decide on a record

The loop: planner/window.py (what the gateway says), planner/policy.py (the decision),
planner/actuators.py (the move).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from bootstrap.security import add_internal_auth_args, internal_auth_from_args

from .actuators import LocalActuator, SwitchActuator, kubernetes_actuator, start_local_cluster
from .metrics import SLO
from .policy import Actuator, Planner, PlannerConfig, run
from .profile import NodeProfile
from .simulator import HostConfig
from .window import PlannerError, scrapes_live, scrapes_recorded


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-planner", description=__doc__.splitlines()[0])
    parser.add_argument("--gateway-metrics", default=None, help="the gateway's /metrics URL")
    parser.add_argument("--replay", type=Path, default=None, help="decide on --record's file")
    parser.add_argument("--record", type=Path, default=None, help="append each scrape here")
    parser.add_argument(
        "--profile", type=Path, required=True, help="a node profile (plan_capacity profile)"
    )
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
    add_host_args(parser)
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
            cluster = start_local_cluster(args.cluster_args)
            args.gateway_metrics = f"{cluster.url}/metrics"
            args.budget = cluster.nodes if args.budget is None else args.budget
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
            actuator = kubernetes_actuator(
                args.namespace, args.prefill_deployment, args.decode_deployment
            )
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
        host=host_config(args),  # the host model, validated on 2026-11-24
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


def add_host_args(parser: argparse.ArgumentParser) -> None:
    """The simulator's host model (`HostConfig`): pd-planner's and plan_capacity's flags."""
    g = parser.add_argument_group("host model")
    g.add_argument("--host-cores", type=int, default=0, help="0: a device per node (GPU)")
    g.add_argument("--threads-per-node", type=int, default=1)
    g.add_argument("--slowdown", type=float, default=1.0, help="scales every step time")
    g.add_argument(
        "--co-runner-slowdown",
        type=float,
        default=0.0,
        help="fraction each other step in flight slows a step by, beyond sharing --host-cores "
        "(memory bandwidth; `plan_capacity steps` shows a step's ratio by the company it kept)",
    )
    g.add_argument(
        "--host-overhead-ms",
        type=float,
        default=0.0,
        help="host CPU ms outside engine steps per streamed token, charged to --host-cores "
        "(measure it with `plan_capacity host`)",
    )
    g.add_argument(
        "--host-overhead-pd-ms",
        type=float,
        default=None,
        help="the same for clusters with prefill nodes (`plan_capacity host --prefill 1`; "
        "default: --host-overhead-ms)",
    )


def host_config(args: argparse.Namespace) -> HostConfig:
    if args.host_cores < 0 or args.threads_per_node < 1 or not args.slowdown > 0:
        raise ValueError("--host-cores must be >= 0, --threads-per-node >= 1, --slowdown > 0")
    if args.co_runner_slowdown < 0:
        raise ValueError(f"--co-runner-slowdown must be >= 0, got {args.co_runner_slowdown}")
    pd_ms = args.host_overhead_pd_ms
    for flag, value in (
        ("--host-overhead-ms", args.host_overhead_ms),
        ("--host-overhead-pd-ms", pd_ms),
    ):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    return HostConfig(
        args.host_cores,
        args.threads_per_node,
        args.slowdown,
        args.host_overhead_ms / 1000,
        None if pd_ms is None else pd_ms / 1000,
        args.co_runner_slowdown,
    )


if __name__ == "__main__":
    sys.exit(main())
