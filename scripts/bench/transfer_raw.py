"""Raw KV transfer throughput per backend: one large descriptor vs the same bytes as pages.

Two processes on loopback: a spawned target registers the destination buffer; this process
writes into it through `kvtransfer.create_engine` and polls to DONE. For each page layout
(PAGESxBYTES) the pages are scattered on both sides in runs of 1..--max-run pages, then written
once coalesced (`coalesce_pages`) and once one descriptor per page; each case is checked byte for
byte once (CRC of the destination pages) and timed best of --repeats.

    .venv/bin/python -m scripts.bench.transfer_raw
    .venv/bin/python -m scripts.bench.transfer_raw --backends nixl --layout 4096x65536

The default layouts are the default model's KV for a 2,000-token prompt: 30 layers x K,V x 16
tokens x 3 KV heads x 64 dims x 4 bytes = 737,280 bytes per 16-token page (125 pages), and the
same bytes with page size 1 (2,000 pages of 46,080 bytes).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from kvtransfer import (
    KVTransferEngine,
    MemoryRegion,
    PeerInfo,
    TransferConfig,
    TransferRange,
    TransferState,
    coalesce_pages,
    create_engine,
)


@dataclass(frozen=True)
class BenchConfig:
    backends: tuple[str, ...]
    big_bytes: int
    layouts: tuple[tuple[int, int], ...]  # (pages, page bytes)
    max_run: int
    repeats: int
    max_descriptors_per_batch: int

    @property
    def buffer_bytes(self) -> int:
        return max([self.big_bytes] + [2 * pages * size for pages, size in self.layouts])


@dataclass(frozen=True)
class TargetReady:
    endpoint: bytes
    region: MemoryRegion


@dataclass(frozen=True)
class ChecksumPages:
    pages: tuple[int, ...]
    page_bytes: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Case:
    label: str
    ranges: list[TransferRange]
    check: tuple[tuple[int, ...], tuple[int, ...], int] | None  # src pages, dst pages, bytes


@dataclass(frozen=True)
class Result:
    backend: str
    label: str
    descriptors: int
    nbytes: int
    seconds: float
    submit_seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def target_main(config: TransferConfig, buffer_bytes: int, conn: Connection) -> None:
    engine = create_engine(config)
    buffer = np.zeros(buffer_bytes, dtype=np.uint8)
    region = MemoryRegion("kv", buffer.ctypes.data, buffer.nbytes)
    engine.register([region])
    conn.send(TargetReady(engine.local_endpoint(), region))
    while not isinstance(command := conn.recv(), Stop):
        conn.send(pages_crc(buffer, command.pages, command.page_bytes))
    engine.close()


def pages_crc(buffer: np.ndarray, pages: tuple[int, ...], page_bytes: int) -> int:
    whole_pages = buffer[: len(buffer) // page_bytes * page_bytes].reshape(-1, page_bytes)
    return zlib.crc32(whole_pages[list(pages)].tobytes())


def scatter(num_pages: int, pool_pages: int, max_run: int, rng: np.random.Generator) -> list[int]:
    """Page ids in runs of 1..max_run pages, the runs at shuffled non-overlapping places."""
    runs: list[int] = []
    while (placed := sum(runs)) < num_pages:
        runs.append(min(int(rng.integers(1, max_run + 1)), num_pages - placed))
    slot = pool_pages // len(runs)
    if slot < max_run:
        raise SystemExit(f"buffer too small to scatter {num_pages} pages in runs of {max_run}")
    pages: list[int] = []
    for run, place in zip(runs, rng.permutation(len(runs)), strict=True):
        first = int(place) * slot + int(rng.integers(0, slot - run + 1))
        pages.extend(range(first, first + run))
    return pages


def build_cases(cfg: BenchConfig, src_base: int, dst_base: int) -> list[Case]:
    rng = np.random.default_rng(0)
    cases = [
        Case(
            f"1 x {cfg.big_bytes >> 20} MiB",
            [TransferRange(src_base, dst_base, cfg.big_bytes)],
            None,
        )
    ]
    for num_pages, page_bytes in cfg.layouts:
        nbytes = num_pages * page_bytes
        pool = cfg.buffer_bytes // page_bytes
        src = scatter(num_pages, pool, cfg.max_run, rng)
        dst = scatter(num_pages, pool, cfg.max_run, rng)
        check = (tuple(src), tuple(dst), page_bytes)
        one_per_page = [
            TransferRange(src_base + s * page_bytes, dst_base + d * page_bytes, page_bytes)
            for s, d in zip(src, dst, strict=True)
        ]
        layout = f"{num_pages} x {page_bytes:,} B"
        cases += [
            Case(
                f"1 x {nbytes / 1e6:.1f} MB (ref for {layout})",
                [TransferRange(src_base, dst_base, nbytes)],
                None,
            ),
            Case(
                f"{layout} scattered, coalesced",
                coalesce_pages(src, dst, page_bytes, src_base, dst_base),
                check,
            ),
            Case(f"{layout} scattered, one per page", one_per_page, check),
        ]
    return cases


def timed_write(
    engine: KVTransferEngine, peer_id: str, ranges: list[TransferRange]
) -> tuple[float, float]:
    started = time.perf_counter()
    handle = engine.write(peer_id, ranges)
    submitted = time.perf_counter()
    while (state := engine.poll(handle)) is TransferState.PENDING:
        time.sleep(0.0001)
    elapsed = time.perf_counter() - started
    engine.release(handle)
    if state is not TransferState.DONE:
        raise SystemExit(f"write of {len(ranges)} descriptors ended {state}")
    return elapsed, submitted - started


def run_backend(cfg: BenchConfig, backend: str) -> list[Result]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    transfer = TransferConfig(
        backend=backend,
        node_name=f"bench-target-{backend}",
        max_descriptors_per_batch=cfg.max_descriptors_per_batch,
    )
    process = ctx.Process(target=target_main, args=(transfer, cfg.buffer_bytes, child), daemon=True)
    process.start()
    ready: TargetReady = parent.recv()
    engine = create_engine(
        TransferConfig(
            backend=backend,
            node_name=f"bench-initiator-{backend}",
            max_descriptors_per_batch=cfg.max_descriptors_per_batch,
        )
    )
    src = np.random.default_rng(1).integers(0, 256, cfg.buffer_bytes, dtype=np.uint8)
    engine.register([MemoryRegion("kv", src.ctypes.data, src.nbytes)])
    peer = PeerInfo(f"bench-target-{backend}", ready.endpoint, {"kv": ready.region})
    engine.connect(peer)
    results = []
    try:
        for case in build_cases(cfg, src.ctypes.data, ready.region.addr):
            timed_write(engine, peer.node_id, case.ranges)  # warm up, then check the bytes
            if case.check is not None:
                verify(parent, src, *case.check)
            runs = [timed_write(engine, peer.node_id, case.ranges) for _ in range(cfg.repeats)]
            best = min(runs)
            nbytes = sum(r.length for r in case.ranges)
            results.append(Result(backend, case.label, len(case.ranges), nbytes, *best))
    finally:
        engine.close()
        parent.send(Stop())
        process.join(30)
    return results


def verify(
    conn: Connection,
    src: np.ndarray,
    src_pages: tuple[int, ...],
    dst_pages: tuple[int, ...],
    page_bytes: int,
) -> None:
    conn.send(ChecksumPages(dst_pages, page_bytes))
    if conn.recv() != pages_crc(src, src_pages, page_bytes):
        raise SystemExit(f"destination pages differ from the source ({len(src_pages)} pages)")


def markdown_table(results: list[Result]) -> str:
    lines = [
        "| backend | case | descriptors | MB | best ms | submit ms | GB/s | vs 1 descriptor |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    reference = 0.0
    for r in results:
        if r.descriptors == 1:
            reference = r.gbps
        lines.append(
            f"| {r.backend} | {r.label} | {r.descriptors} | {r.nbytes / 1e6:.1f} | "
            f"{r.seconds * 1e3:.1f} | {r.submit_seconds * 1e3:.2f} | {r.gbps:.2f} | "
            f"{r.gbps / reference:.2f} |"
        )
    return "\n".join(lines)


def parse_args() -> BenchConfig:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="mooncake,nixl")
    parser.add_argument(
        "--big-mib", type=int, default=256, help="size of the single-descriptor write"
    )
    parser.add_argument(
        "--layout",
        action="append",
        metavar="PAGESxBYTES",
        help="repeatable; default 125x737280 and 2000x46080",
    )
    parser.add_argument("--max-run", type=int, default=8, help="longest run of contiguous pages")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--max-descriptors-per-batch",
        type=int,
        default=TransferConfig("", "").max_descriptors_per_batch,
    )
    args = parser.parse_args()
    layouts = []
    for text in args.layout or ["125x737280", "2000x46080"]:
        pages, _, size = text.partition("x")
        layouts.append((int(pages), int(size)))
    return BenchConfig(
        tuple(args.backends.split(",")),
        args.big_mib << 20,
        tuple(layouts),
        args.max_run,
        args.repeats,
        args.max_descriptors_per_batch,
    )


def main() -> None:
    cfg = parse_args()
    results = [r for backend in cfg.backends for r in run_backend(cfg, backend)]
    print(markdown_table(results))


if __name__ == "__main__":
    main()
