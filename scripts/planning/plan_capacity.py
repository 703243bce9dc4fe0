"""Capacity planner: profile a node once, simulate clusters we cannot run, recommend P:D.

    profile    measure this machine's node (prefill time vs tokens for single prompts and
               batches of prompts, decode step time vs batch and context) in-process and save
               it as JSON; the KV transfer (bandwidth and
               rendezvous latency) and the gateway's latency are flags, stored with it
    simulate   one cluster shape under a workload (bench_serving.py's flags) and arrival rate:
               the summary table bench_serving would print
    recommend  for a node (GPU) budget and SLOs, the highest rate each split sustains with
               >= --slo-attainment of the requests meeting the SLOs, and the best split
    host       measure the host CPU a real cluster spends outside its engine steps per streamed
               token (gateway, client, gRPC and transfer threads), for --host-overhead-ms
               (colocated) or --host-overhead-pd-ms (with --prefill >= 1)
    calibrate  the step-time factor (--slowdown) that makes one measured bench_serving.py run's
               mean E2E come out of the simulator (the host as it was during the runs)
    steps      compare the step traces of a real run (nodes started with --step-trace-dir)
               with the profile: measured vs predicted step time per node and step kind
    validate   simulate what tune_ratio.py measured (its tune_ratio.json: same splits, rates
               and workload) and print predicted vs measured goodput, with the error; several
               repeats of one sweep are compared by their mean, with their spread (near
               saturation a short run does not repeat itself to 15%); --speed-band 0.05
               adds the prediction with every step 5% slower and faster (at overload a
               profile taken in another hour moves goodput by far more than 15%)

The simulator (planner/simulator.py) is a discrete-event model of the nodes' queues
and batching rules. On a CPU host where nodes share cores, pass --host-cores and
--threads-per-node so that steps running at once slow each other down.

    .venv/bin/python -m scripts.planning.plan_capacity profile --threads 1 --output profile.json
    .venv/bin/python -m scripts.planning.plan_capacity recommend --profile profile.json --gpus 8 \\
        --random-input-len 2048 --random-output-len 256 --slo-ttft-ms 1000 --slo-tpot-ms 50

On a shared CPU host the in-process profile is optimistic: a node's steps in a real cluster ran
1.13-1.16x the profile when alone and another ~10% slower per node stepping beside them (shared
memory bandwidth), beyond sharing the cores (benchmarks/serving-2026-11-24.md). Measure the host
work (`host`), then trace a low-rate run and a loaded one (nodes with --step-trace-dir) and read
`steps`: the low-rate ratio is --slowdown, the loaded run's ratio beside another node over its
ratio alone, less the cores' sharing, is --co-runner-slowdown:

    .venv/bin/python -m scripts.planning.plan_capacity validate --profile profile.json \\
        --measured run1/tune_ratio.json run2/tune_ratio.json --host-cores 2 \\
        --threads-per-node 1 --host-overhead-ms 1.60 --host-overhead-pd-ms 2.37 \\
        --slowdown 1.15 --co-runner-slowdown 0.10
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from planner.capacity import (
    Comparison,
    calibrate_slowdown,
    comparison_table,
    max_rate,
    simulate,
    workload_from_settings,
)
from planner.cli import add_host_args as add_simulated_host_args
from planner.cli import host_config
from planner.profile import NodeProfile, fit_prefill, this_host
from planner.splits import Split, SplitError, parse_splits
from scripts.flags import add_cluster_args, cluster_config
from scripts.planning import step_report
from scripts.serving.bench_serving import (
    add_workload_args,
    dataset_config,
    load_config,
    slo_config,
)
from scripts.serving.report import table

VALIDATION_TARGET = 0.15  # relative goodput error the issue asks for


def add_host_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", type=Path, required=True, help="JSON written by `profile`")
    add_simulated_host_args(parser)


def _ints(text: str) -> tuple[int, ...]:
    """A comma list of positive integers (argparse type)."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="measure this machine's node")
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=1, help="torch threads, as each node uses")
    p.add_argument("--device", default="cpu", help="cuda: the GPU points (profiler.GPU_POINTS)")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    p.add_argument("--attention-backend", default=None, help="default: triton on GPU")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per prefill point")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--transfer-gbps", type=float, default=0.9, help="KV transfer GB/s")
    p.add_argument("--handoff-ms", type=float, default=10.0, help="rendezvous latency")
    p.add_argument("--gateway-ms", type=float, default=5.0, help="gateway + HTTP latency")
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--decode-headroom", type=int, default=32)
    p.add_argument(
        "--decode-batches",
        type=_ints,
        default=None,
        help="decode points' batch sizes, e.g. 1,4,16,32 (default: 1,4,16 on CPU)",
    )
    p.add_argument(
        "--decode-contexts",
        type=_ints,
        default=None,
        help="decode points' prompt tokens, e.g. 64,320,480 (default: 64,320 on CPU)",
    )

    p = sub.add_parser("simulate", help="one cluster shape at one rate")
    p.add_argument("--prefill", type=int, default=1, help="prefill nodes (0: colocated)")
    p.add_argument("--decode", type=int, default=1)
    add_host_args(p)
    add_workload_args(p)

    p = sub.add_parser("recommend", help="best P:D for a node budget")
    p.add_argument("--gpus", type=int, required=True, help="nodes (one GPU each)")
    p.add_argument("--slo-attainment", type=float, default=0.9)
    p.add_argument("--max-rate", type=float, default=100.0, help="upper end of the search")
    add_host_args(p)
    add_workload_args(p)

    p = sub.add_parser("host", help="--host-overhead-ms of a real cluster on this host")
    p.add_argument("--prefill", type=int, default=0, help="prefill nodes (0: colocated)")
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--threads-per-node", type=int, default=1, help="OMP_NUM_THREADS per node")
    add_cluster_args(p, gateway_help="extra gateway flags (with --prefill: after every prompt "
                     "through a prefill node)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    add_workload_args(p)

    p = sub.add_parser("calibrate", help="--slowdown from one measured bench_serving run")
    p.add_argument("--measured", type=Path, required=True, help="bench_serving --output-file")
    p.add_argument("--prefill", type=int, required=True, help="the run's prefill nodes")
    p.add_argument("--decode", type=int, required=True)
    add_host_args(p)

    p = sub.add_parser("steps", help="a real run's step traces against the profile")
    p.add_argument("--profile", type=Path, required=True, help="JSON written by `profile`")
    p.add_argument("traces", type=Path, nargs="+", help="--step-trace-dir directories or files")

    p = sub.add_parser("validate", help="predicted vs tune_ratio.py's measured goodput")
    p.add_argument(
        "--measured",
        type=Path,
        nargs="+",
        required=True,
        help="tune_ratio.json; several: repeats of one sweep, compared by their mean",
    )
    p.add_argument("--output", type=Path, default=None, help="write the comparison as JSON")
    p.add_argument(
        "--speed-band",
        type=float,
        default=0.0,
        help="also simulate every step this fraction slower and faster (e.g. 0.05) and show "
        "the predicted goodput's range: how much a profile that far off changes the answer",
    )
    add_host_args(p)
    return parser


def cmd_profile(args: argparse.Namespace) -> int:
    from planner.profiler import ProfilePlan, fit_decode, measure

    gpu = args.device.startswith("cuda")
    plan = ProfilePlan(
        model=args.model,
        threads=args.threads,
        repeats=args.repeats,
        max_total_tokens=args.max_total_tokens,
        device=args.device,
        dtype=args.dtype or ("bfloat16" if gpu else "float32"),
        load_format=args.load_format,
        attention_backend=args.attention_backend or ("triton" if gpu else "torch_native"),
    )
    if gpu:
        plan = plan.for_gpu()
    if args.decode_batches:
        plan = replace(plan, decode_batches=args.decode_batches)
    if args.decode_contexts:
        plan = replace(plan, decode_contexts=args.decode_contexts)
    measured = measure(plan)
    profile = NodeProfile(
        prefill_coef=fit_prefill(measured.prefill),
        decode_coef=fit_decode(measured.decode),
        kv_bytes_per_token=measured.kv_bytes_per_token,
        transfer_bytes_per_s=args.transfer_gbps * 1e9,
        handoff_s=args.handoff_ms / 1000,
        gateway_s=args.gateway_ms / 1000,
        chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens,
        decode_headroom=args.decode_headroom,
        meta={
            "model": measured.model,
            "threads": args.threads,
            "device": plan.device,
            "dtype": plan.dtype,
            "attention_backend": plan.attention_backend,
            "host": this_host(),
            "prefill_points": measured.prefill,
            "decode_points": measured.decode,
        },
    )
    profile.save(args.output)
    p0, p1, p2 = profile.prefill_coef
    print(f"prefill step = {p0 * 1e3:.1f} ms + {p1 * 1e3:.3f} ms/token + {p2 * 1e9:.1f} ns/pair")
    for count, tokens, seconds in measured.prefill:
        error = profile.prefill_s([(tokens, 0)] * count) / seconds - 1
        print(f"  {count:2d} x {tokens:4d} tokens: {seconds * 1e3:7.1f} ms (fit {error:+.1%})")
    d0, d1, d2 = profile.decode_coef
    print(f"decode step = {d0 * 1e3:.2f} ms + {d1 * 1e3:.3f} ms/req + {d2 * 1e6:.3f} us/req-token")
    print(f"wrote {args.output}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    profile = NodeProfile.load(args.profile)
    load = load_config(args)
    if math.isinf(load.request_rate):
        raise ValueError("simulate needs a finite --request-rate")
    dataset = dataset_config(args, load.num_sessions or 1000)
    split = Split(args.prefill, args.decode)
    summary = simulate(profile, split, dataset, load, slo_config(args), host_config(args))
    print(table(summary, f"simulated {split.name} @ {load.request_rate:g} req/s"))
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    profile = NodeProfile.load(args.profile)
    slo = slo_config(args)
    if not slo.given:
        raise ValueError("give at least one of --slo-ttft-ms, --slo-tpot-ms, --slo-e2e-ms")
    if not 0 < args.slo_attainment <= 1:
        raise ValueError(f"--slo-attainment must be in (0, 1], got {args.slo_attainment}")
    load = load_config(args, request_rate=1.0)
    dataset = dataset_config(args, load.num_sessions or 1000)
    host = host_config(args)
    rows = []
    for split in parse_splits("all", args.gpus):
        rate = max_rate(
            profile, split, dataset, load, slo, host, args.slo_attainment, args.max_rate
        )
        rows.append((split, rate))
        print(f"{split.name:<14} max rate meeting the SLOs: {rate:8.3f} req/s", flush=True)
    best = max(rows, key=lambda r: r[1])
    if best[1] <= 0:
        print("no split meets the SLOs at any rate: relax them or add nodes")
        return 0
    print(f"recommended: {best[0].name} ({best[1]:.3f} req/s, {best[1] / args.gpus:.3f} per node)")
    return 0


def read_measured(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or "settings" not in doc:
            raise ValueError("no settings")
    except (OSError, ValueError) as exc:
        raise ValueError(f"--measured {path} is not a benchmark JSON: {exc}") from None
    return doc


def cmd_host(args: argparse.Namespace) -> int:
    from scripts.planning.host_cost import measure
    from scripts.serving.benchmark import BenchmarkConfig
    from scripts.serving.client import ClientConfig

    if args.prefill < 0 or args.decode < 1 or args.threads_per_node < 1:
        raise ValueError("need --prefill >= 0, --decode >= 1, --threads-per-node >= 1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads_per_node)  # inherited by every node
    load = load_config(args)
    bench = BenchmarkConfig(
        dataset_config(args, load.num_sessions or 1000),
        load,
        ClientConfig("http://unset", "", args.ignore_eos, args.temperature),
        slo_config(args),
    )
    pd_only = ("--local-prefill-max-tokens", "0") if args.prefill else ()
    gateway_args = pd_only + tuple(shlex.split(args.gateway_args))
    cluster = cluster_config(args, args.prefill, args.decode, gateway_args=gateway_args)
    cost = measure(cluster, bench, args.warmup)
    print(
        f"{cost.requests} requests, {cost.output_tokens} tokens streamed: host CPU "
        f"{cost.cpu_s:.2f} s, engine forward {cost.forward_s:.2f} s -> "
        f"{'--host-overhead-pd-ms' if args.prefill else '--host-overhead-ms'} "
        f"{cost.overhead_s_per_token * 1e3:.2f}"
    )
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    profile = NodeProfile.load(args.profile)
    doc = read_measured(args.measured)
    dataset, load, _ = workload_from_settings(doc["settings"])
    load = replace(load, request_rate=float(doc["settings"]["request_rate"]))
    measured = float(doc["summary"]["e2e_ms"]["mean"])
    split = Split(args.prefill, args.decode)
    factor = calibrate_slowdown(profile, split, dataset, load, host_config(args), measured)
    print(f"measured mean E2E {measured:.0f} ms on {split.name}: --slowdown {factor:.3f}")
    return 0


def cmd_steps(args: argparse.Namespace) -> int:
    profile = NodeProfile.load(args.profile)
    files = [f for t in args.traces for f in (sorted(t.glob("*.jsonl")) if t.is_dir() else [t])]
    if not files:
        raise ValueError(f"no *.jsonl step traces in {', '.join(map(str, args.traces))}")
    print(step_report.report({f.stem: step_report.read_trace(f) for f in files}, profile))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    if not 0 <= args.speed_band < 1:
        raise ValueError(f"--speed-band must be in [0, 1) (0.05: +-5%), got {args.speed_band}")
    profile = NodeProfile.load(args.profile)
    host = host_config(args)
    docs = [read_measured(path) for path in args.measured]
    for path, doc in zip(args.measured[1:], docs[1:], strict=True):
        if doc["settings"] != docs[0]["settings"]:
            raise ValueError(
                f"--measured {path} ran another workload or sweep than {args.measured[0]}: "
                "repeats must share every setting"
            )
    settings, results = docs[0]["settings"], docs[0].get("results")
    if not isinstance(results, list):
        raise ValueError(f"--measured {args.measured[0]} is not a tune_ratio.json: no results")
    dataset, load, slo = workload_from_settings(settings)
    rows = []
    for i, result in enumerate(results):
        split = Split(**result["split"])
        for j, point in enumerate(result["points"]):
            rate = float(point["rate"])
            seeded = replace(dataset, seed=int(point.get("seed", dataset.seed)))
            at_rate = replace(load, request_rate=rate)
            predicted = simulate(profile, split, seeded, at_rate, slo, host)
            band = None
            if args.speed_band > 0:
                slower, faster = (
                    replace(host, slowdown=host.slowdown * (1 + d))
                    for d in (args.speed_band, -args.speed_band)
                )
                band = (
                    simulate(profile, split, seeded, at_rate, slo, slower).goodput or 0.0,
                    simulate(profile, split, seeded, at_rate, slo, faster).goodput or 0.0,
                )
            runs = tuple(
                float(doc["results"][i]["points"][j]["summary"]["goodput"] or 0.0) for doc in docs
            )
            rows.append(Comparison(split, rate, runs, predicted.goodput or 0.0, band))
    print(comparison_table(rows, VALIDATION_TARGET))
    if args.output is not None:
        doc_out = {
            "profile": str(args.profile),
            "measured": [str(p) for p in args.measured],
            "host": asdict(host),
            "rows": [
                {**asdict(r), "split": r.split.name, "measured": r.measured, "error": r.error}
                for r in rows
            ],
        }
        args.output.write_text(json.dumps(doc_out, indent=1))
        print(f"wrote {args.output}")
    return 0


COMMANDS = {
    "profile": cmd_profile,
    "simulate": cmd_simulate,
    "recommend": cmd_recommend,
    "host": cmd_host,
    "calibrate": cmd_calibrate,
    "steps": cmd_steps,
    "validate": cmd_validate,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, SplitError) as exc:
        print(f"plan_capacity: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
