"""KV transfer GPU0 -> GPU1 through the project's NIXL engine, against the torch peer copy.

    python3 -m scripts.gpu.bench_kv_transfer          # or as a section of run_all.py

Two processes, as a prefill node and a decode node would be: this one owns GPU0 (the sender),
a spawned one owns GPU1 (the receiver). Each registers a KV pool of Llama-3-8B pages (page size
16, all 32 layers in a page: 2 MiB) with `kvtransfer.nixl.NixlEngine`. A 1k- or 4k-token prompt
is 64 or 256 pages, sent either as contiguous runs (coalesced: one descriptor) or scattered
(one descriptor per page). Every transfer is checked by checksum on the receiver. Ceiling: a
torch copy of the same bytes GPU0 -> GPU1 in this process.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass

import torch

from kvtransfer import (
    MemoryRegion,
    PeerInfo,
    TransferConfig,
    TransferState,
    coalesce_pages,
    create_engine,
)

PAGE_BYTES = 32 * 2 * 16 * 8 * 128 * 2  # layers * (K, V) * page_size * kv_heads * head_dim * bf16
POOL_PAGES = 1024  # 2 GiB per GPU
REPEATS = 7


@dataclass
class TransferRow:
    tokens: int
    layout: str  # "contiguous" | "scattered"
    descriptors: int
    ms: float
    gbps: float
    peer_copy_gbps: float
    checked: bool


def _receiver(conn) -> None:  # runs in the spawned process, on GPU1
    torch.cuda.set_device(1)
    pool = torch.zeros(POOL_PAGES * PAGE_BYTES, dtype=torch.uint8, device="cuda:1")
    engine = create_engine(TransferConfig(backend="nixl", node_name="decode-gpu1"))
    region = MemoryRegion("kv", pool.data_ptr(), pool.numel(), "cuda:1")
    engine.register([region])
    conn.send((engine.local_endpoint(), region))
    while True:
        msg = conn.recv()
        if msg[0] == "quit":
            break
        pages = torch.tensor(msg[1], device="cuda:1")
        conn.send(_checksum(pool, pages))
        pool.zero_()
        torch.cuda.synchronize()
    engine.close()


def _checksum(pool: torch.Tensor, pages: torch.Tensor) -> int:
    view = pool.view(torch.int32).view(POOL_PAGES, -1)
    return int(view[pages].sum(dtype=torch.int64))


def _time_write(engine, ranges) -> float:
    start = time.perf_counter()
    handle = engine.write("decode", ranges)
    while (state := engine.poll(handle)) is TransferState.PENDING:
        pass
    engine.release(handle)
    if state is not TransferState.DONE:
        raise RuntimeError(f"NIXL write of {len(ranges)} ranges failed")
    return (time.perf_counter() - start) * 1e3


def _peer_copy_gbps(nbytes: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    times = []
    for i in range(REPEATS + 2):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def bench_transfer(token_counts: tuple[int, ...] = (1024, 4096)) -> list[TransferRow]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,), daemon=True)
    proc.start()
    try:
        endpoint, remote = parent.recv()
        torch.cuda.set_device(0)
        pool = torch.randint(
            -(2**31), 2**31 - 1, (POOL_PAGES * PAGE_BYTES // 4,), dtype=torch.int32, device="cuda:0"
        ).view(torch.uint8)
        engine = create_engine(TransferConfig(backend="nixl", node_name="prefill-gpu0"))
        engine.register([MemoryRegion("kv", pool.data_ptr(), pool.numel(), "cuda:0")])
        engine.connect(PeerInfo("decode", endpoint, {"kv": remote}))
        rows = []
        gen = torch.Generator().manual_seed(0)
        for tokens in token_counts:
            n = tokens // 16
            ceiling = _peer_copy_gbps(n * PAGE_BYTES)
            layouts = {
                "contiguous": (list(range(n)), list(range(100, 100 + n))),
                "scattered": (
                    torch.randperm(POOL_PAGES, generator=gen)[:n].tolist(),
                    torch.randperm(POOL_PAGES, generator=gen)[:n].tolist(),
                ),
            }
            for layout, (src, dst) in layouts.items():
                ranges = coalesce_pages(src, dst, PAGE_BYTES, pool.data_ptr(), remote.addr)
                times = [_time_write(engine, ranges) for _ in range(REPEATS + 2)][2:]
                ms = statistics.median(times)
                parent.send(("check", dst))
                checked = parent.recv() == _checksum(pool, torch.tensor(src, device="cuda:0"))
                row = TransferRow(tokens, layout, len(ranges), ms, n * PAGE_BYTES / ms / 1e6,
                                  ceiling, checked)  # fmt: skip
                print(row, flush=True)
                rows.append(row)
        engine.close()
        return rows
    finally:
        parent.send(("quit",))
        proc.join(timeout=30)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    for r in bench_transfer():
        print(r)
