"""The GPU suite's one entry point: `python -m scripts.gpu <sub-command>` (`--help` on each).

    python -m scripts.gpu pack out/gpucarry [--nixl]          # here, once: the wheels a host lacks
    python3 -m scripts.gpu all --carry out/gpucarry --out "$OUT"   # there: every check and table

Sub-commands (each writes its markdown table into `--out`):
  engine      backends against torch-native, then decode / prefill against the measured ceilings
              (FlashInfer's rows too when it imports; PD rows with --pd-carry)    [run_all.py]
  flashinfer  the FlashInfer backend alone: checks, then its figures beside Triton's
  pd          PD on one GPU: greedy P->D equals a colocated node, no page leaked  [check_pd.py]
  tp          TP=1 / TP=2 over NCCL equal HF; PD across TP sizes (two GPUs)       [check_tp.py]
  serve       engine vs decode node vs the served path, one 8B shape (required after changes
              to the served path: gateway, node streaming)                    [serve_vs_engine.py]
  step        the engine's decode step with and without overlap                [engine_step.py]
  pack        download what a GPU host lacks (grpc, the gateway's wheels, Mooncake, NIXL)
  wheels      pack / install one of mooncake, flashinfer
  all         engine (with PD), tp where two GPUs are visible, serve; one summary table

Every sub-command imports on a CPU; `pd`, `tp` and `serve` have a `--device cpu` dry run.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from scripts.gpu import environment

PROG = "python -m scripts.gpu"
# sub-command -> (module, what it does); each module has main(argv, prog) -> exit status
COMMANDS = {
    "engine": ("run_all", "backends vs torch-native, decode/prefill vs the ceilings"),
    "flashinfer": ("check_flashinfer", "the FlashInfer backend: checks and figures"),
    "pd": ("check_pd", "PD on one GPU: P->D greedy equals colocated, no page leaked"),
    "tp": ("check_tp", "TP over NCCL equals HF; PD across TP sizes (two GPUs)"),
    "serve": ("serve_vs_engine", "engine vs decode node vs served path, tok/s and CPU"),
    "step": ("engine_step", "the engine's decode step with and without overlap"),
}


def run_module(name: str, argv: list[str]) -> int:
    module_name, _ = COMMANDS[name]
    module = importlib.import_module(f"scripts.gpu.{module_name}")
    main: Callable[[list[str], str], int] = module.main
    return main(argv, f"{PROG} {name}")


def pack_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"{PROG} pack", description=COMMANDS_HELP["pack"])
    parser.add_argument("dir", type=Path, help="folder to fill: wheels/ and mooncake/")
    parser.add_argument("--nixl", action="store_true", help="NIXL too (+29 MiB): PD on both")
    args = parser.parse_args(argv)
    from scripts.gpu import serve_vs_engine

    serve_vs_engine.pack(args.dir, nixl=args.nixl)
    return 0


def wheels_main(argv: list[str]) -> int:
    from scripts.gpu import flashinfer_wheels, mooncake_wheels

    parser = argparse.ArgumentParser(prog=f"{PROG} wheels", description=COMMANDS_HELP["wheels"])
    parser.add_argument("package", choices=["mooncake", "flashinfer"])
    parser.add_argument("action", choices=["pack", "install"])
    parser.add_argument("dir", type=Path)
    environment.add_site_arg(parser)
    args = parser.parse_args(argv)
    module = mooncake_wheels if args.package == "mooncake" else flashinfer_wheels
    if args.action == "pack":
        module.pack(args.dir)
    else:
        install = mooncake_wheels.install_and_print if module is mooncake_wheels else module.install
        install(args.dir, environment.site_dir(args.site))
    return 0


def all_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"{PROG} all", description=COMMANDS_HELP["all"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--carry", type=Path, help="the folder `pack` filled (PD, TP, serve)")
    parser.add_argument("--skip", default="", help="sub-commands to leave out, e.g. serve,tp")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    carry: Path | None = args.carry
    engines = [] if carry is None else [str(carry / "mooncake"), str(carry / "wheels")]
    runs = {
        "engine": ["--pd-carry", engines[0], "--pd-wheels", engines[1]] if carry else [],
        "tp": ["--carry", engines[0], "--wheels", engines[1]] if carry else [],
        "serve": ["--carry", str(carry)] if carry else [],
    }
    two_gpus = gpu_count() >= 2
    rows, failed = [], False
    for name, extra in runs.items():
        if name in skip or (name == "tp" and not two_gpus):
            why = "skipped" if name in skip else "not run: fewer than two GPUs visible"
            rows.append(f"| {name} | {why} | - | - |")
            continue
        out = args.out / name
        t0 = time.monotonic()
        # a process per sub-command: GPU memory and the carried site start clean each time
        command = [sys.executable, "-m", "scripts.gpu", name, "--out", str(out), *extra]
        code = subprocess.run(command, cwd=environment.REPO_ROOT).returncode
        failed |= code != 0
        status = "PASS" if code == 0 else f"FAIL (exit {code})"
        rows.append(f"| {name} | {status} | {time.monotonic() - t0:.0f} | `{out.name}/` |")
    table = ["# GPU suite", "", "| sub-command | result | seconds | tables |", "|---|---|---|---|"]
    text = "\n".join([*table, *rows]) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text(text)
    print(text, flush=True)
    return 1 if failed else 0


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


COMMANDS_HELP = {
    **{name: what for name, (_, what) in COMMANDS.items()},
    "pack": "download what a GPU host lacks into DIR (here, once)",
    "wheels": "pack or install Mooncake's CUDA build + NIXL, or flashinfer",
    "all": "engine (with PD), tp on two GPUs, serve: every check and table in one call",
}
OWN = {"pack": pack_main, "wheels": wheels_main, "all": all_main}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(f"  {name:<11} {what}" for name, what in COMMANDS_HELP.items()),
    )
    parser.add_argument("command", choices=list(COMMANDS_HELP), metavar="sub-command")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its flags (`<sub-command> -h`)")
    args = parser.parse_args(argv)
    if args.command in OWN:
        return OWN[args.command](args.args)
    return run_module(args.command, args.args)


if __name__ == "__main__":
    sys.exit(main())
