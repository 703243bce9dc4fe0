"""Tune the `cuda_ipc` copy kernel and split a write's host time, on one GPU.

    python3 -m scripts.gpu.tune_ipc_copy --out "$OUT"                     # the knob sweep
    python3 -m scripts.gpu.tune_ipc_copy --out "$OUT" --profile-write 100  # a write's host time

The sweep: the engine's kernel (kvtransfer/cuda_ipc_kernel.py) copying 256 scattered 2 MiB
pages (a 4k-token prompt of the 8B shape) between two pools of this process, over its
compile-time knobs (chunk bytes a program, bytes a step, warps), each variant checked byte
for byte against torch indexing before it is timed (CUDA events around the kernel alone,
median of `--repeats`), beside torch's contiguous copy of the same bytes. `--profile-write`
times the engine's whole write (write -> DONE) in this process, profiles it, and splits its
host side step by step. Writes `tune_ipc_copy.md|json` or `profile_*.txt` to `--out`.
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

PAGE_BYTES = 2 << 20
POOL_PAGES = 1024
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


def profile_write(out: Path, writes: int) -> None:
    """Where the host time of one engine write goes: the cuda_ipc engine between two pools of
    this process (as bench_kv_staging's reference does), `writes` scattered writes under
    cProfile, then each write's wall time from `write` to DONE beside the kernel's."""
    import cProfile
    import pstats

    from kvtransfer.base import PeerInfo, TransferState, coalesce_pages
    from scripts.gpu import bench_kv_staging as bench

    setup = bench.Setup("cuda:0", bench.POOL_PAGES, 0, 4096)
    a, b = setup.cache("cuda:0"), setup.cache("cuda:0")
    sender, receiver = bench._engine(bench.CUDA_IPC, "p"), bench._engine(bench.CUDA_IPC, "d")
    local, remote = bench._region(b, "cuda:0"), bench._region(a, "cuda:0")
    sender.register([local])
    receiver.register([remote])
    sender.connect(PeerInfo("decode", receiver.local_endpoint(), {"kv": remote}))
    lines = []
    for layout, (src, dst) in setup.pages().items():
        ranges = coalesce_pages(src, dst, bench.LAYOUT.page_bytes, local.addr, remote.addr)

        def once(r: Any = ranges) -> None:
            handle = sender.write("decode", r)
            while sender.poll(handle) is TransferState.PENDING:
                pass
            sender.release(handle)

        for _ in range(5):
            once()
        walls = []
        for _ in range(writes):
            torch.cuda.synchronize()
            t = time.perf_counter()
            once()
            walls.append((time.perf_counter() - t) * 1e3)
        lines.append(f"{layout}: write -> DONE median {statistics.median(walls):.3f} ms")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(writes):
            once()
        prof.disable()
        path = out / f"profile-{layout}.txt"
        with path.open("w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
    lines += phase_split(sender, local, remote, setup.pages()["scattered"], writes)
    print("\n".join(lines))
    (out / "profile_write.txt").write_text("\n".join(lines) + "\n")


def phase_split(sender: Any, local: Any, remote: Any, pages: Any, writes: int) -> list[str]:
    """The engine's write path step by step (kvtransfer/cuda_ipc.py's `write` and `_launch`,
    inlined), each step's host time median over `writes`, without a profiler."""
    from kvtransfer.base import coalesce_pages
    from kvtransfer.cuda_ipc_kernel import WORD_DTYPES, DevicePointer
    from kvtransfer.cuda_ipc_plan import group_ranges
    from scripts.gpu import bench_kv_staging as bench

    src, dst = pages
    ranges = coalesce_pages(src, dst, bench.LAYOUT.page_bytes, local.addr, remote.addr)
    peer = sender._peers["decode"]
    steps: dict[str, list[float]] = {}
    for _ in range(writes + 5):
        torch.cuda.synchronize()
        marks = [("start", time.perf_counter())]
        groups = group_ranges(ranges, sender._regions, peer.endpoint, "p")
        marks.append(("group_ranges", time.perf_counter()))
        [((li, pi), rows)] = groups.items()
        loc, rem = sender._regions[li], peer.endpoint.regions[pi]
        base = peer.bases[pi]
        offsets = rows - np.array([loc.addr, rem.addr, 0], dtype=np.int64)
        plan = plan_copy(offsets, align=(loc.addr, base))
        marks.append(("plan_copy", time.perf_counter()))
        device = loc.device_index
        stream = sender._stream(device)
        word = WORD_DTYPES[plan.word_bytes]
        stream.wait_stream(torch.cuda.current_stream(device))
        marks.append(("wait_stream", time.perf_counter()))
        with torch.cuda.stream(stream):
            table, _ = sender._upload(device).send(plan.rows, stream)
            marks.append(("stream ctx + row upload", time.perf_counter()))
            copy_rows(DevicePointer(loc.addr, word), DevicePointer(base, word), table,
                      plan.chunk_words, plan.max_chunks)  # fmt: skip
            marks.append(("triton launch", time.perf_counter()))
            done = torch.cuda.Event()
            done.record(stream)
            marks.append(("event", time.perf_counter()))
        while not done.query():
            pass
        marks.append(("poll until done", time.perf_counter()))
        for (_, a), (name, b) in itertools.pairwise(marks):
            steps.setdefault(name, []).append((b - a) * 1e3)
        steps.setdefault("total", []).append((marks[-1][1] - marks[0][1]) * 1e3)
    return [f"  {name}: {statistics.median(v[5:]):.4f} ms" for name, v in steps.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile-write", type=int, default=0, help="writes to profile (0: sweep)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile_write:
        profile_write(args.out, args.profile_write)
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
