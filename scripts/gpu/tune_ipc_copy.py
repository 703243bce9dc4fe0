"""Tune the `cuda_ipc` copy kernel and split a write's host time, on one GPU.

    python3 -m scripts.gpu.tune_ipc_copy --out "$OUT"                     # the knob sweep
    python3 -m scripts.gpu.tune_ipc_copy --out "$OUT" --profile-write 100  # a write's host time
    python3 -m scripts.gpu.tune_ipc_copy --out "$OUT" --profile-write 100 --paths before pages
    python3 -m scripts.gpu.tune_ipc_copy --out /tmp/plan --cpu-plan 2000  # the numpy parts, CPU

The sweep: the engine's kernel (kvtransfer/cuda_ipc_kernel.py) copying 256 scattered 2 MiB
pages (a 4k-token prompt of the 8B shape) between two pools of this process, over its
compile-time knobs (chunk bytes a program, bytes a step, warps), each variant checked byte
for byte against torch indexing before it is timed (CUDA events around the kernel alone,
median of `--repeats`), beside torch's contiguous copy of the same bytes. `--profile-write`
runs the write's paths side by side in this process (`--paths`: `before`, the write of the
2026-11-26 report, frozen in scripts/gpu/ipc_write_paths.py; `ranges`, the engine's `write`;
`pages`, its `write_pages`; `batch` and `batch-overlap`, its `write_pages_batched`, one
`cuMemcpyBatchAsync` call): each checked byte for byte first (exit code 1 on a mismatch),
timed from `write` to DONE, its host time split step by step, and profiled; a driver
without the batched copy fails the run (exit code 1) after the other paths ran. Writes
`tune_ipc_copy.md|json` or `profile_write.txt` and `profile-<path>.txt` to `--out`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton  # type: ignore[import-untyped]

from kvtransfer.cuda_ipc_kernel import _copy_rows_kernel, copy_rows
from kvtransfer.cuda_ipc_plan import plan_copy
from scripts.gpu.ipc_write_paths import PATHS

PAGE_BYTES = 2 << 20
POOL_PAGES = 1024
POISON = 0xA5
PAGES = 256
WORD = 8


def pools(src_dev: str, dst_dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    words = POOL_PAGES * PAGE_BYTES // WORD
    src = torch.randint(-(2**62), 2**62, (words,), dtype=torch.int64, device=src_dev)
    dst = torch.zeros(words, dtype=torch.int64, device=dst_dev)
    return src, dst


def scattered(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.choice(POOL_PAGES, PAGES, replace=False),
        rng.choice(POOL_PAGES, PAGES, replace=False),
    )


def event_ms(fn: Any, device: str, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.synchronize(device)
    return statistics.median(times)


def host_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def correct(src: torch.Tensor, dst: torch.Tensor, sp: np.ndarray, dp: np.ndarray) -> bool:
    per_page = PAGE_BYTES // WORD
    s = src.view(POOL_PAGES, per_page)[torch.as_tensor(sp, device=src.device)]
    d = dst.view(POOL_PAGES, per_page)[torch.as_tensor(dp, device=dst.device)]
    return torch.equal(s.to(dst.device), d)


def run_case(name: str, src_dev: str, dst_dev: str, repeats: int) -> list[dict[str, Any]]:
    src, dst = pools(src_dev, dst_dev)
    sp, dp = scattered()
    nbytes = PAGES * PAGE_BYTES
    per_page = PAGE_BYTES // WORD
    contiguous_src, contiguous_dst = src[: PAGES * per_page], dst[: PAGES * per_page]
    base = event_ms(lambda: contiguous_dst.copy_(contiguous_src), src_dev, repeats)
    rows: list[dict[str, Any]] = [
        {"case": name, "form": "torch copy", "layout": "contiguous", "ms": base}
    ]
    page_ranges = np.stack([sp * PAGE_BYTES, dp * PAGE_BYTES, np.full(PAGES, PAGE_BYTES)], 1)
    for chunk_kib, block_kib, warps in itertools.product((16, 32, 64), (4, 8, 16), (4, 8, 16)):
        if block_kib > chunk_kib:
            continue
        plan = plan_copy(page_ranges, max_chunk=chunk_kib << 10)
        table = torch.as_tensor(plan.rows, device=src_dev)
        grid = (plan.max_chunks, plan.num_rows)

        def launch(t: torch.Tensor = table, g: tuple[int, int] = grid, c: int = plan.chunk_words,
                   b: int = (block_kib << 10) // WORD, w: int = warps) -> None:  # fmt: skip
            _copy_rows_kernel[g](src, dst, t, CHUNK=c, BLOCK=b, num_warps=w)

        dst.zero_()
        launch()
        torch.cuda.synchronize(src_dev)
        ok = correct(src, dst, sp, dp)
        ms = event_ms(launch, src_dev, repeats) if ok else float("nan")
        rows.append({"case": name, "form": "rows kernel", "chunk_kib": chunk_kib,
                     "block_kib": block_kib, "warps": warps, "ok": ok, "ms": ms})  # fmt: skip
    plan = plan_copy(page_ranges)
    table = torch.as_tensor(plan.rows, device=src_dev)
    ms = event_ms(
        lambda: copy_rows(src, dst, table, plan.chunk_words, plan.max_chunks), src_dev, repeats
    )
    rows.append({"case": name, "form": "engine defaults", "ms": ms})
    rows.append(
        {
            "case": name,
            "form": "host: plan_copy",
            "ms": host_ms(lambda: plan_copy(page_ranges), repeats),
        }
    )
    for row in rows:
        if row["ms"] == row["ms"] and not row["form"].startswith("host"):
            row["gbps"] = nbytes / row["ms"] / 1e6
            row["vs_torch"] = base / row["ms"]
    return rows


def profile_write(out: Path, writes: int, paths: list[str]) -> None:
    """The write's paths side by side (scripts/gpu/ipc_write_paths.py): the cuda_ipc engine
    between two pools of this process on cuda:0 (as bench_kv_staging's reference does), each
    path checked byte for byte on a poisoned receiver before and after the timed writes (a
    failure stops the run with exit code 1), timed from `write` to DONE for both layouts
    (median of `writes`), its host time split step by step (scattered), and profiled
    (`profile-<path>.txt`)."""
    from kvtransfer.base import PeerInfo
    from scripts.gpu import bench_kv_staging as bench
    from scripts.gpu import ipc_write_paths as ipc

    setup = bench.Setup("cuda:0", bench.POOL_PAGES, 0, 4096)
    receiver_cache, sender_cache = setup.cache("cuda:0"), setup.cache("cuda:0")
    bench._bytes(sender_cache).copy_(setup.source("cuda:0"))
    sender, receiver = bench._engine(bench.CUDA_IPC, "p"), bench._engine(bench.CUDA_IPC, "d")
    local, remote = bench._region(sender_cache, "cuda:0"), bench._region(receiver_cache, "cuda:0")
    sender.register([local])
    receiver.register([remote])
    sender.connect(PeerInfo("decode", receiver.local_endpoint(), {"kv": remote}))
    page_bytes = bench.LAYOUT.page_bytes
    jobs = {
        layout: ipc.PageJob("decode", src, dst, page_bytes, local.addr, remote.addr)
        for layout, (src, dst) in setup.pages().items()
    }
    pools = (bench._bytes(sender_cache), bench._bytes(receiver_cache))
    missing = sender._driver.batch_missing
    unrunnable = [p for p in paths if p in ipc.BATCH_PATHS and sender._driver.batch_copier is None]
    runnable = [p for p in paths if p not in unrunnable]
    lines = compare_paths(sender, pools, jobs, runnable, writes, out)
    lines += ["", host_facts(sender)]
    lines += [f"FAIL: path {p!r} not run: no cuMemcpyBatchAsync here ({missing})"
              for p in unrunnable]  # fmt: skip
    sender.close()
    receiver.close()
    print("\n".join(lines))
    (out / "profile_write.txt").write_text("\n".join(lines) + "\n")
    if unrunnable:
        raise SystemExit(f"FAIL: the driver has no batched copy ({missing})")


def host_facts(sender: Any) -> str:
    """This process's side of bench_kv_staging's "host facts" (scripts/gpu/host_probe.py),
    to hold the two-process figures against: where it runs, a numpy calibration, the
    driver and its batched copy."""
    from scripts.gpu import host_probe
    from scripts.gpu.bench_kv_staging import gpu_bus_id

    driver = sender._driver
    copier = driver.batch_copier
    batch = copier.symbol if copier else f"none ({driver.batch_missing})"
    version = f"{driver.version // 1000}.{driver.version % 1000 // 10}"
    here = host_probe.snapshot(gpu_bus_id("cuda:0")).line()
    numpy_ms = host_probe.calibration_ms()
    return (f"host facts (this one process): {here}; numpy calibration {numpy_ms:.4f} ms; "
            f"CUDA driver {version}, batched copy {batch}")  # fmt: skip


def compare_paths(
    sender: Any,
    pools: tuple[torch.Tensor, torch.Tensor],
    jobs: dict[str, Any],
    paths: list[str],
    writes: int,
    out: Path,
) -> list[str]:
    """`profile_write`'s body for any connected engine: `pools` are the sender's and the
    receiver's pages as uint8 [pages, page bytes]; `jobs` one write per layout."""
    import cProfile
    import pstats

    from scripts.gpu import ipc_write_paths as ipc

    def check(when: str) -> None:  # no figure from a path that moves wrong bytes
        for path in paths:
            for layout, job in jobs.items():
                pools[1].fill_(POISON)
                torch.cuda.synchronize()
                ipc.wait(sender, ipc.engine_call(sender, path, job, job.ranges()))
                if not landed(pools, job):
                    raise SystemExit(
                        f"FAIL: the {path!r} path moved wrong bytes ({layout}, {when})"
                    )

    check("before the timed writes")
    lines = [f"byte checks: PASS ({', '.join(paths)}; {', '.join(jobs)}; before and after the"
             " timed writes)", "",
             f"| path | {' | '.join(f'{k} write -> DONE ms' for k in jobs)} | "
             "scattered host ms (before the GPU runs alone) |",
             f"|---|{'---|' * len(jobs)}---|"]  # fmt: skip
    splits = {}
    for path in paths:
        walls = []
        for job in jobs.values():
            for _ in range(5):
                ipc.timed_write(sender, path, job)
            times = [ipc.timed_write(sender, path, job) for _ in range(writes)]
            walls.append(f"{statistics.median(times):.3f}")
        splits[path] = ipc.host_split(sender, path, jobs["scattered"], writes)
        lines.append(f"| {path} | {' | '.join(walls)} | {splits[path]['host total']:.4f} |")
        prof = cProfile.Profile()
        ranges = jobs["scattered"].ranges()
        prof.enable()
        for _ in range(writes):
            ipc.wait(sender, ipc.engine_call(sender, path, jobs["scattered"], ranges))
        prof.disable()
        with (out / f"profile-{path}.txt").open("w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)
    check("after the timed writes")
    for path, split in splits.items():
        lines += ["", f"{path}: the scattered write's host steps (median ms of {writes})"]
        lines += [f"  {step}: {ms:.4f}" for step, ms in split.items()]
    return lines


def landed(pools: tuple[torch.Tensor, torch.Tensor], job: Any) -> bool:
    """Every destination page equal to its source page, every other page still poisoned."""
    torch.cuda.synchronize()
    sent, got = pools
    dst = torch.tensor(job.dst_pages, device=got.device)
    untouched = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    untouched[dst] = False
    same = torch.equal(got[dst], sent[torch.tensor(job.src_pages, device=sent.device)])
    return same and bool((got[untouched] == POISON).all())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile-write", type=int, default=0, help="writes to profile (0: sweep)")
    parser.add_argument(
        "--cpu-plan", type=int, default=0, help="repeats: the write paths' CPU planning (no GPU)"
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        default=list(PATHS),
        choices=PATHS,
        help="--profile-write: the write paths to run side by side (gpu/ipc_write_paths.py)",
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cpu_plan:
        from scripts.gpu import bench_kv_staging as bench

        setup = bench.Setup("cpu", bench.POOL_PAGES, 0, 4096)
        lines = [f"{k}: {v}" for k, v in bench.plan_cost(setup, args.cpu_plan).items()]
        print("\n".join(lines))
        (args.out / "cpu_plan.txt").write_text("\n".join(lines) + "\n")
        return
    if args.profile_write:
        profile_write(args.out, args.profile_write, args.paths)
        return
    rows = run_case("one GPU", "cuda:0", "cuda:0", args.repeats)
    (args.out / "tune_ipc_copy.json").write_text(json.dumps(rows, indent=1))
    lines = [
        f"# cuda_ipc copy kernel sweep ({torch.cuda.get_device_name(0)}, torch {torch.__version__},"
        f" triton {triton.__version__})",
        "",
        "| case | form | chunk KiB | step KiB | warps | ok | ms | GB/s | vs torch copy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["ms"]):
        lines.append(
            f"| {r['case']} | {r['form']} | {r.get('chunk_kib', '')} | {r.get('block_kib', '')} |"
            f" {r.get('warps', '')} | {r.get('ok', '')} | {r['ms']:.3f} |"
            f" {r.get('gbps', float('nan')):.0f} | {r.get('vs_torch', float('nan')):.2f} |"
        )
    (args.out / "tune_ipc_copy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
