"""Measure the decode GEMM tiles of this GPU model and check them in the engine's step, in one call.

    python3 -m scripts.gpu.decode_tiles --out "$OUT/tiles" [--force] [--budget-s 190]

`linear_kernel="auto"` runs the decode GEMMs on Triton only on a GPU model listed in
`engine/models/gemm_tiles.py`'s MEASURED. For a GPU without an entry (or with `--force`):

1. `gemm_chain --rows 16,64 --table-out tiles.json`: each decode GEMM shape in a 32-layer chain,
   cuBLAS against a tile sweep of the Triton kernels, programmatic dependent launch on;
2. `decode_accounting --batches 16,64,256 --gemm-tiles tiles.json`: the engine's step with those
   tiles, gated on greedy tokens (eager == graphs), against the HBM roofline;
3. the same at B=64 with `--linear-kernel aten` (cuBLAS): the baseline of the same host.

A GPU already listed runs steps 2-3 with its entry. The end prints the entry to paste into
MEASURED (a `GpuTiles` literal) and the step times of both runs. Outputs in `--out`: chain.md,
tiles.json, acct-tiles.md, acct-aten.md and the logs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from engine.models.gemm_tiles import GemmTile, GpuTiles, measured_for


def run(args: list[str], log: Path, timeout: float) -> int:
    print(f"$ {' '.join(args)}", flush=True)
    with log.open("w") as out:
        try:
            return subprocess.run(
                [sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return 124


def literal(name: str, tiles: GpuTiles) -> str:
    def tile(t: GemmTile | None) -> str:
        if t is None:
            return "None"
        return (f"GemmTile({t.block_m}, {t.block_n}, {t.block_k}, {t.split_k}, {t.num_warps}, "
                f"{t.num_stages})")  # fmt: skip

    lines = [f'    "{name}": GpuTiles(', "        linear={"]
    for (n, k), by_rows in tiles.linear.items():
        cells = ", ".join(f"{m}: {tile(t)}" for m, t in sorted(by_rows.items()))
        lines.append(f"            ({n}, {k}): {{{cells}}},")
    fused = ", ".join(f"{m}: {tile(t)}" for m, t in sorted(tiles.gate_up_silu.items()))
    lines += ["        },", f"        gate_up_silu={{{fused}}},", "    ),"]
    return "\n".join(lines)


def step_rows(path: Path) -> list[str]:
    if not path.exists():
        return [f"({path.name} missing)"]
    text = path.read_text().splitlines()
    return [line for line in text if "overlapped" in line or "graph replay alone" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--force", action="store_true", help="measure even a listed GPU")
    parser.add_argument("--budget-s", type=float, default=190.0, help="gemm_chain's sweep budget")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_tiles needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name()
    table = args.out / "tiles.json"
    known = measured_for(name)
    if known is None or args.force:
        rc = run(["scripts.gpu.gemm_chain", "--rows", "16,64", "--budget-s", str(args.budget_s),
                  "--out", str(args.out / "chain.md"), "--table-out", str(table)],
                 args.out / "chain.log", args.budget_s + 60)  # fmt: skip
        if rc != 0 or not table.exists():
            raise SystemExit(f"gemm_chain failed (rc {rc}): see {args.out / 'chain.log'}")
        tiles = GpuTiles.from_json(json.loads(table.read_text()))
    else:
        print(f"{name} has measured tiles (gemm_tiles.MEASURED); --force measures again")
        tiles = known
        table.write_text(json.dumps({"gpu": name, **tiles.to_json()}, indent=1) + "\n")
    for label, batches, extra in (
        ("tiles", "16,64,256", ["--gemm-tiles", str(table)]),
        ("aten", "64", ["--linear-kernel", "aten"]),
    ):
        rc = run(["scripts.gpu.decode_accounting", "--backends", "triton", "--batches", batches,
                  "--out", str(args.out / f"acct-{label}.md"), *extra],
                 args.out / f"acct-{label}.log", 240)  # fmt: skip
        rows = step_rows(args.out / f"acct-{label}.md")
        print(f"== decode_accounting, {label} (rc {rc}):", *rows, sep="\n")
    print("\nThe entry for engine/models/gemm_tiles.py's MEASURED:\n")
    print(literal(name, tiles))


if __name__ == "__main__":
    main()
