"""KV transfer throughput between prefill and decode nodes of equal and different TP sizes.

Every rank is a process with its own transfer engine and its own KV shard, as in a real TP node.
The prefill ranks write one prompt's KV along the real KV-head routes (kvtransfer/head_routes.py),
all ranks at once; the time is from the first rank's start to the last rank's DONE, best of
--repeats. Each case is checked once: the CRC of every destination head slice equals the CRC of
its source slice.

Layouts (`--layouts`): `page-major` is the engine's (engine/memory/kv_cache.py: pages outermost,
then KV heads, then layers): whole pages coalesced into runs when the TP sizes are equal, one
descriptor per page and run of heads otherwise. `head-major` (KV heads outermost) is the
alternative measured for comparison: one descriptor per (KV head, page run) for any TP pair.
`--strided` adds the token-major cost of the smallest head slice (tokens outside heads, as the
engine's layout was before: one KV head of a page is 30 x 2 x 16 pieces of 256 bytes).

    .venv/bin/python -m scripts.bench.transfer_tp
    .venv/bin/python -m scripts.bench.transfer_tp --backends nixl --pairs 1:1,2:1 --tokens 4000

Defaults: the default model's KV (30 layers, 3 KV heads of 64 dims, fp32), a 2,000-token prompt
in 16-token pages (125 pages, 92 MB), pages scattered in runs of 1..8 on both sides.
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
    create_engine,
)
from kvtransfer.base import coalesce_pages
from kvtransfer.head_routes import RankKV, WritePlan, plan_routes, route_pages

LAYERS, KV_HEADS, HEAD_DIM, ELEM = 30, 3, 64, 4


@dataclass(frozen=True)
class Case:
    backend: str
    p_tp: int
    d_tp: int
    page_size: int
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    pool_pages: int
    repeats: int
    layout: str = "page-major"

    @property
    def head_page_bytes(self) -> int:
        return LAYERS * 2 * self.page_size * HEAD_DIM * ELEM


@dataclass(frozen=True)
class RankReady:
    rank: RankKV
    endpoint: bytes
    region: MemoryRegion


def heads_of(tp: int) -> list[range]:
    """The KV heads of each rank (engine/tp/partition.py's rule for TP <= KV heads; not
    imported from there so that each rank process stays free of the engine's imports)."""
    base, extra = divmod(KV_HEADS, tp)
    out, start = [], 0
    for rank in range(tp):
        n = base + (1 if rank < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def make_rank(
    case: Case, role: str, rank: int, heads: range
) -> tuple[KVTransferEngine, np.ndarray, RankKV]:
    engine = create_engine(
        TransferConfig(case.backend, f"bench-{role}{rank}-{case.p_tp}{case.d_tp}")
    )
    buffer = np.zeros(len(heads) * case.pool_pages * case.head_page_bytes, dtype=np.uint8)
    if role == "p":
        buffer[:] = np.random.default_rng(rank).integers(0, 256, buffer.size, dtype=np.uint8)
    engine.register([MemoryRegion("kv", buffer.ctypes.data, buffer.nbytes)])
    peer_id = f"d{case.d_tp}" if rank == 0 else f"d{case.d_tp}#tp{rank}"
    kv = RankKV(rank, peer_id, buffer.ctypes.data, heads, case.head_page_bytes)
    return engine, buffer, kv


def head_slice(kv: RankKV, case: Case, local_head: int, page: int) -> int:
    """Byte offset of one KV head's part of one page in a rank's buffer."""
    hpb = case.head_page_bytes
    if case.layout == "head-major":
        return (local_head * case.pool_pages + page) * hpb
    return page * kv.page_bytes + local_head * hpb


def write_plan(case: Case, src: list[RankKV], dst: list[RankKV], rank: int) -> WritePlan:
    routes = [r for r in plan_routes(src, dst) if r.src.tp_rank == rank]
    if case.layout == "page-major":
        return route_pages(routes, case.src_pages, case.dst_pages)
    plan: WritePlan = {}
    hpb = case.head_page_bytes
    for route in routes:  # head-major: one range per (head, page run)
        for i in range(route.num_heads):
            s_base = route.src.kv_base + (route.src_head + i) * case.pool_pages * hpb
            d_base = route.dst.kv_base + (route.dst_head + i) * case.pool_pages * hpb
            ranges = coalesce_pages(case.src_pages, case.dst_pages, hpb, s_base, d_base)
            plan.setdefault(rank, {}).setdefault(route.dst.peer_id, []).extend(ranges)
    return plan


def slice_crcs(buffer: np.ndarray, kv: RankKV, case: Case, pages: tuple[int, ...]) -> dict:
    hpb = case.head_page_bytes
    out = {}
    for local, head in enumerate(kv.kv_heads):
        offsets = [head_slice(kv, case, local, p) for p in pages]
        out[head] = zlib.crc32(b"".join(buffer[o : o + hpb].tobytes() for o in offsets))
    return out


def decode_rank(case: Case, rank: int, heads: range, conn: Connection) -> None:
    engine, buffer, kv = make_rank(case, "d", rank, heads)
    region = MemoryRegion("kv", buffer.ctypes.data, buffer.nbytes)
    conn.send(RankReady(kv, engine.local_endpoint(), region))
    conn.recv()  # all writes done: report what arrived
    conn.send(slice_crcs(buffer, kv, case, case.dst_pages))
    conn.recv()
    engine.close()


def prefill_rank(
    case: Case, rank: int, heads: list[range], dst: list[RankReady], conn: Connection
) -> None:
    engine, buffer, mine = make_rank(case, "p", rank, heads[rank])
    for d in dst:
        engine.connect(PeerInfo(d.rank.peer_id, d.endpoint, {"kv": d.region}))
    src = [
        mine if r == rank else RankKV(r, "", 0, h, mine.head_page_bytes)
        for r, h in enumerate(heads)
    ]
    writes = write_plan(case, src, [d.rank for d in dst], rank).get(rank, {})
    conn.send(sum(len(v) for v in writes.values()))
    for _ in range(case.repeats + 1):  # the first is a warm-up
        conn.recv()
        start = time.perf_counter()
        handles = [engine.write(peer, ranges) for peer, ranges in writes.items()]
        states = []
        for h in handles:
            while (state := engine.poll(h)) is TransferState.PENDING:
                time.sleep(0.0001)
            engine.release(h)
            states.append(state)
        conn.send((start, time.perf_counter(), all(s is TransferState.DONE for s in states)))
    conn.send({h: c for h, c in slice_crcs(buffer, mine, case, case.src_pages).items()})
    conn.recv()
    engine.close()


def run_case(case: Case) -> tuple[int, int, float]:
    """(descriptors, bytes, best seconds) of one P TP -> D TP write of the prompt."""
    ctx = mp.get_context("spawn")
    d_heads, p_heads = heads_of(case.d_tp), heads_of(case.p_tp)
    d_conns, procs = [], []
    for r, h in enumerate(d_heads):
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=decode_rank, args=(case, r, h, child), daemon=True))
        d_conns.append(parent)
    for p in procs:
        p.start()
    ready = [c.recv() for c in d_conns]
    p_conns = []
    for r in range(case.p_tp):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=prefill_rank, args=(case, r, p_heads, ready, child), daemon=True)
        proc.start()
        procs.append(proc)
        p_conns.append(parent)
    descriptors = sum(c.recv() for c in p_conns)
    spans = []
    for _ in range(case.repeats + 1):
        for c in p_conns:
            c.send("go")
        timings = [c.recv() for c in p_conns]
        if not all(ok for _, _, ok in timings):
            raise SystemExit(f"{case}: a write failed")
        spans.append(max(t[1] for t in timings) - min(t[0] for t in timings))
    src_crcs: dict[int, int] = {}
    for c in p_conns:
        src_crcs.update(c.recv())
    for c in d_conns:
        c.send("report")
        for head, crc in c.recv().items():
            if crc != src_crcs[head]:
                raise SystemExit(f"{case.backend} {case.p_tp}->{case.d_tp}: head {head} differs")
    for c in p_conns + d_conns:
        c.send("stop")
    for p in procs:
        p.join(30)
    nbytes = sum(len(h) for h in d_heads) * len(case.src_pages) * case.head_page_bytes
    return descriptors, nbytes, min(spans[1:])


def strided_baseline(backend: str, case: Case) -> tuple[int, int, float]:
    """One KV head of `pages` pages as the token-major layout would need it: 256-byte pieces."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    one = Case(backend, 1, 1, case.page_size, case.src_pages, case.dst_pages, case.pool_pages, 1)
    proc = ctx.Process(target=decode_rank, args=(one, 0, range(0, 1), child), daemon=True)
    proc.start()
    ready: RankReady = parent.recv()
    engine, buffer, mine = make_rank(one, "p", 0, range(0, 1))
    engine.connect(PeerInfo(ready.rank.peer_id, ready.endpoint, {"kv": ready.region}))
    piece = HEAD_DIM * ELEM
    ranges = [
        TransferRange(
            mine.kv_base + s * one.head_page_bytes + i * piece,
            ready.rank.kv_base + d * one.head_page_bytes + i * piece,
            piece,
        )
        for s, d in zip(case.src_pages, case.dst_pages, strict=True)
        for i in range(one.head_page_bytes // piece)
    ]
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        handle = engine.write(ready.rank.peer_id, ranges)
        while (state := engine.poll(handle)) is TransferState.PENDING:
            time.sleep(0.0001)
        engine.release(handle)
        if state is not TransferState.DONE:
            raise SystemExit(f"strided baseline on {backend} ended {state}")
        best = min(best, time.perf_counter() - start)
    parent.send("report")
    if parent.recv() != slice_crcs(buffer, mine, one, case.src_pages):
        raise SystemExit(f"strided baseline on {backend}: the destination differs")
    parent.send("stop")
    proc.join(30)
    engine.close()
    return len(ranges), len(ranges) * piece, best


def scatter(num_pages: int, pool: int, max_run: int, rng: np.random.Generator) -> tuple[int, ...]:
    runs: list[int] = []
    while (placed := sum(runs)) < num_pages:
        runs.append(min(int(rng.integers(1, max_run + 1)), num_pages - placed))
    slot = pool // len(runs)
    pages: list[int] = []
    for run, place in zip(runs, rng.permutation(len(runs)), strict=True):
        first = int(place) * slot + int(rng.integers(0, slot - run + 1))
        pages.extend(range(first, first + run))
    return tuple(pages)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="mooncake,nixl")
    parser.add_argument("--pairs", default="1:1,2:2,3:3,2:1,1:2,1:3,3:1", help="P_TP:D_TP,...")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-run", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layouts", default="page-major,head-major")
    parser.add_argument("--strided", action="store_true", help="add the token-major baseline")
    args = parser.parse_args()
    num_pages = -(-args.tokens // args.page_size)
    pool = 2 * num_pages + args.max_run
    rng = np.random.default_rng(0)
    src, dst = (
        scatter(num_pages, pool, args.max_run, rng),
        scatter(num_pages, pool, args.max_run, rng),
    )
    print("| backend | layout | P TP -> D TP | descriptors | MB | best ms | GB/s |")
    print("|---|---|---|---:|---:|---:|---:|")
    for backend in args.backends.split(","):
        for layout in args.layouts.split(","):
            for pair in args.pairs.split(","):
                p_tp, d_tp = (int(x) for x in pair.split(":"))
                case = Case(
                    backend, p_tp, d_tp, args.page_size, src, dst, pool, args.repeats, layout
                )
                descriptors, nbytes, seconds = run_case(case)
                print(
                    f"| {backend} | {layout} | {p_tp} -> {d_tp} | {descriptors} | "
                    f"{nbytes / 1e6:.1f} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.2f} |",
                    flush=True,
                )
        if args.strided:
            case = Case(backend, 1, 1, args.page_size, src, dst, pool, 1)
            descriptors, nbytes, seconds = strided_baseline(backend, case)
            print(
                f"| {backend} | token-major | 1 KV head, 1 -> 1 | {descriptors} | "
                f"{nbytes / 1e6:.1f} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
