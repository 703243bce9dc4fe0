"""Two GPUs of one host: TP over NCCL, KV GPU0 -> GPU1 on both engines, and the goodput of one
prefill + one decode node against two colocated nodes, beside the planner's prediction.

    # here, once: the engines' wheels, and grpcio at the stubs' version (+ the gateway's wheels)
    python -m scripts.gpu.mooncake_wheels pack out/pdcarry
    python -m scripts.gpu.serve_vs_engine pack out/svecarry      # its wheels/ folder is used
    # on the two-GPU host, two calls (each carries out/pdcarry and out/svecarry/wheels):
    PYTHONUNBUFFERED=1 python3 -m scripts.gpu.two_gpu correctness --carry out/pdcarry \\
        --wheels out/svecarry/wheels --out "$OUT"
    PYTHONUNBUFFERED=1 python3 -m scripts.gpu.two_gpu goodput --carry out/pdcarry \\
        --wheels out/svecarry/wheels --out "$OUT" --transfer-gbps <NIXL GB/s from the first>
    # here: the planner's prediction for the measured sweep (profile from the first call)
    python -m scripts.planning.plan_capacity validate --profile profile-8b.json \\
        --measured tune_ratio.json --host-cores 0
    python -m scripts.gpu.two_gpu rescore tune_ratio.json     # goodput under other SLOs

`correctness` runs, each step a process of its own with a time limit:
1. scripts/gpu/check_tp.py: TP=2 == TP=1 == HF (NCCL), and prefill TP=2 -> decode TP=1 and
   TP=1 -> TP=2 through NIXL and Mooncake servers, no page left;
2. scripts/gpu/bench_mooncake_gpu.py with the receiver on GPU 1: a 4k-token prompt of a
   Llama-3-8B shape (256 pages of 2 MiB) contiguous, in runs and as 256 scattered pages, through
   NIXL, Mooncake nvlink_intra and Mooncake TCP, every write checked byte for byte, against
   torch's peer copy GPU0 -> GPU1 measured in the same run;
3. `plan_capacity profile --device cuda --load-format dummy` of the same 8B shape (GPU 0): the
   planner's GPU-calibrated profile.

`goodput` runs scripts/planning/tune_ratio.py (each split a `pd-cluster` on 127.0.0.1, the
nodes one GPU each through `--devices cuda:0,cuda:1`, 8B-shaped dummy bf16 weights, Triton
attention, CUDA graphs) for `1:1` and `colocated` at a sweep of rates, prompts of 2-4k random
tokens, 256 output tokens, TTFT and TPOT SLOs; then the planner's prediction for the same sweep
from the profile (when `--profile` is given, i.e. the first call's file was carried back in).

Each call writes `two_gpu-<part>.md` (versions, the command, every step's table or error) and the
steps' own files to `--out`; the nodes' logs go into one `logs.tar.gz`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from scripts.gpu.environment import REPO_ROOT, gpu_defaults, site_dir, use_site
from scripts.tiny_models import LLAMA3_8B, write_llama_config

PY = sys.executable
# The served workload (issue 27): prompts of 2-4k tokens, 256 out, SLOs on TTFT and TPOT.
INPUT_LEN, RANGE_RATIO, OUTPUT_LEN = 3072, 0.33, 256
SLO_TTFT_MS, SLO_TPOT_MS = 1000.0, 20.0  # TPOT 20 ms: 50 tokens/s to each user
NODE_KV_TOKENS = 300_000  # 37.5 GiB of bf16 KV of the 8B shape beside 15 GiB of weights


def log(msg: str) -> None:
    print(f"[two_gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def step(name: str, command: list[str], timeout_s: float, sections: list[str],
         tail_lines: int = 0) -> bool:  # fmt: skip
    """Run one step as a process of its own; its exit and time go into the report, with the
    output's last `tail_lines` lines (its last 3000 characters if it failed)."""
    log(f"{name}: {shlex.join(command)}")
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, timeout=timeout_s, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        output, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
        code = None
    took = time.monotonic() - started
    print(output[-6000:], flush=True)
    status = "timed out" if code is None else f"exit {code}"
    sections.append(f"## {name}: {status} in {took:.0f} s\n\n`{shlex.join(command)}`\n")
    if code != 0:
        sections.append("```\n" + output[-3000:] + "\n```\n")
    elif tail_lines:
        sections.append("```\n" + "\n".join(output.splitlines()[-tail_lines:]) + "\n```\n")
    return code == 0


def model_dir(work: Path) -> Path:
    from scripts.gpu.serve_vs_engine import word_tokenizer

    path = work / "llama-8b"
    write_llama_config(path, LLAMA3_8B)
    word_tokenizer(path, int(LLAMA3_8B["vocab_size"]))  # type: ignore[call-overload]
    return path


def correctness(args: argparse.Namespace, work: Path, sections: list[str]) -> None:
    # The steps inherit the installed wheels and the engines' site (install()).
    step("check_tp: TP=2 over NCCL, PD across TP sizes",
         [PY, "-m", "scripts.gpu.check_tp", "--out", str(work / "tp")],
         args.tp_timeout, sections)  # fmt: skip
    _append(sections, work / "tp" / "check_tp.md")
    if args.skip_kv:
        sections.append("KV transfer: skipped (--skip-kv)\n")
    else:
        kv_step(args, work, sections)
    profile_step(args, work, sections)


def kv_step(args: argparse.Namespace, work: Path, sections: list[str]) -> None:
    step("KV transfer GPU0 -> GPU1, 4k tokens of an 8B shape",
         [PY, "-m", "scripts.gpu.bench_mooncake_gpu", "--receiver-device", "cuda:1",
          "--tokens", "4096", "--repeats", "5", "--out", str(work / "kv")],
         args.kv_timeout, sections)  # fmt: skip
    _append(sections, work / "kv" / "mooncake_gpu.md")
    if (work / "kv" / "mooncake_gpu.json").exists():
        (args.out / "mooncake_gpu.json").write_bytes(
            (work / "kv" / "mooncake_gpu.json").read_bytes()
        )


def profile_step(args: argparse.Namespace, work: Path, sections: list[str]) -> None:
    profile = args.out / "profile-8b.json"
    step("planner profile of the 8B shape on GPU 0",
         [PY, "-m", "scripts.planning.plan_capacity", "profile", "--device", "cuda",
          "--load-format", "dummy", "--model", str(model_dir(work)), "--output", str(profile),
          "--max-total-tokens", str(NODE_KV_TOKENS), "--transfer-gbps", str(args.transfer_gbps),
          "--handoff-ms", "5", "--gateway-ms", "2"],
         args.profile_timeout, sections, tail_lines=40)  # fmt: skip


def goodput(args: argparse.Namespace, work: Path, sections: list[str]) -> None:
    node_args = ["--device", "cuda", "--dtype", "bfloat16", "--load-format", "dummy",
                 "--attention-backend", "triton", "--disable-prefix-cache",
                 "--max-running-requests", "128"]  # fmt: skip
    sweep = work / "sweep"
    command = [PY, "-m", "scripts.planning.tune_ratio", "--budget", "2",
               "--splits", args.splits, "--rates", args.rates, "--devices", "cuda:0,cuda:1",
               "--model", str(model_dir(work)), "--transfer-backend", args.backend,
               "--max-total-tokens", str(NODE_KV_TOKENS), "--node-args", shlex.join(node_args),
               "--duration", str(args.duration), "--random-input-len", str(INPUT_LEN),
               "--random-range-ratio", str(RANGE_RATIO), "--random-output-len", str(OUTPUT_LEN),
               "--ignore-eos", "--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-tpot-ms",
               str(SLO_TPOT_MS), "--warmup", "4", "--no-progress",
               "--output-dir", str(sweep)]  # fmt: skip
    command += ["--breakdown"] if args.breakdown else []
    name = "goodput: 1 prefill + 1 decode against 2 colocated"
    step(name, command, args.sweep_timeout, sections, tail_lines=60)
    if (sweep / "tune_ratio.json").exists():
        (args.out / "tune_ratio.json").write_bytes((sweep / "tune_ratio.json").read_bytes())


def rescore(measured: Path, slos: str) -> str:
    """The sweep's goodput under other (TTFT ms, TPOT ms) SLOs, from each request's own TTFT
    and TPOT (tune_ratio.json keeps them): attainment and goodput (req/s) per split and rate."""
    doc = json.loads(measured.read_text())
    lines = ["| SLO (TTFT, TPOT ms) | split | " + " | ".join(
        f"rate {p['rate']:g}" for p in doc["results"][0]["points"]) + " |"]  # fmt: skip
    lines.append("|---|---|" + "---|" * len(doc["results"][0]["points"]))
    for pair in slos.split(","):
        ttft, tpot = (float(x) for x in pair.split(":"))
        for result in doc["results"]:
            cells = []
            for point in result["points"]:
                total = point["summary"]["completed"] + point["summary"]["failed"]
                good = sum(1 for a, b in point["requests_ttft_tpot_ms"]
                           if a is not None and a <= ttft and (b is None or b <= tpot))  # fmt: skip
                cells.append(
                    f"{good / max(total, 1):.0%}, {good / point['summary']['duration_s']:.2f}"
                )
            lines.append(f"| {ttft:g}, {tpot:g} | {result['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _append(sections: list[str], table: Path) -> None:
    if table.exists():
        sections.append(table.read_text() + "\n")


def install(args: argparse.Namespace) -> None:
    """The carried wheels and the project into this interpreter (console scripts for
    pd-cluster), the engines into a site folder first on every import path."""
    from scripts.gpu import mooncake_wheels

    pip = [PY, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    if args.wheels:
        subprocess.run([*pip, *sorted(str(p) for p in args.wheels.glob("*.whl"))], check=True)
    subprocess.run([*pip, "--no-build-isolation", str(REPO_ROOT)], check=True)
    if args.carry:
        site = site_dir(None)
        use_site(site, mooncake_wheels.install(args.carry, site))


def versions() -> dict[str, str]:
    import importlib.metadata as md

    import torch

    found = {
        "date (UTC)": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "GPUs": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())),
        "torch": torch.__version__,
        "CUDA (torch)": str(torch.version.cuda),
        "NCCL": ".".join(map(str, torch.cuda.nccl.version())),
    }
    for name in ("triton", "grpcio", "nixl-cu13", "mooncake-transfer-engine-cuda13"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = "not installed"
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True)
    found["GPU0-GPU1 link"] = next(
        (ln.split()[2] for ln in topo.stdout.splitlines() if ln.startswith("GPU0")), "?"
    )
    return found


def main() -> int:
    if sys.argv[1:2] == ["rescore"]:  # here, on a goodput call's tune_ratio.json
        rescore_parser = argparse.ArgumentParser(description=rescore.__doc__)
        rescore_parser.add_argument("rescore")
        rescore_parser.add_argument("measured", type=Path)
        rescore_parser.add_argument("--slos", default="1000:20,1000:15,500:15,1000:25,2000:50")
        found = rescore_parser.parse_args()
        print(rescore(found.measured, found.slos))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["correctness", "goodput"])
    parser.add_argument("--carry", type=Path, help="scripts.gpu.mooncake_wheels pack folder")
    parser.add_argument("--wheels", type=Path, help="grpcio (and the gateway's) wheels")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--transfer-gbps", type=float, default=300.0, help="for the profile")
    parser.add_argument("--tp-timeout", type=float, default=300.0)
    parser.add_argument("--kv-timeout", type=float, default=150.0)
    parser.add_argument("--skip-kv", action="store_true", help="correctness: no KV benchmark")
    parser.add_argument("--profile-timeout", type=float, default=150.0)
    parser.add_argument("--backend", default="nixl", choices=["nixl", "mooncake"])
    parser.add_argument("--rates", default="4,8,12,16", help="requests/s of the sweep")
    parser.add_argument("--splits", default="1:1,colocated", help="as tune_ratio.py's")
    parser.add_argument("--breakdown", action="store_true", help="each rate's TTFT breakdown")
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals a rate")
    parser.add_argument("--sweep-timeout", type=float, default=480.0)
    args = parser.parse_args()
    gpu_defaults()
    started = time.monotonic()
    install(args)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"two_gpu-{args.part}-"))
    info = versions()
    log(json.dumps(info))
    sections = [f"# Two GPUs: {args.part}\n", *(f"- {k}: {v}" for k, v in info.items()),
                f"- command: `{shlex.join(sys.argv)}`\n"]  # fmt: skip
    try:
        (correctness if args.part == "correctness" else goodput)(args, work, sections)
    finally:
        sections.append(f"Whole call: {time.monotonic() - started:.0f} s\n")
        (args.out / f"two_gpu-{args.part}.md").write_text("\n".join(sections))
        with tarfile.open(args.out / "logs.tar.gz", "w:gz") as tar:
            for path in sorted(work.rglob("*.log")) + sorted(work.rglob("cluster.out")):
                tar.add(path, arcname=str(path.relative_to(work)))
    print("\n".join(sections), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
