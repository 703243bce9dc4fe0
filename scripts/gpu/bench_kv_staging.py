"""256 scattered KV pages through the transfer engines: staging, prepared lists, cuda_ipc.

Commands (the first two made benchmarks/gpu-2026-11-26-kv-staging-h200.md):

    python3 -m scripts.gpu.mooncake_wheels pack .mooncake            # here (no index there)
    # grpcio / protobuf wheels for the PD check: see scripts/gpu/check_pd.py (.pdwheels)
    python3 -m scripts.gpu.bench_kv_staging --carry .mooncake --wheels .pdwheels --out "$OUT"
    python3 -m scripts.gpu.bench_kv_staging --carry .mooncake --out "$OUT" \\
        --receiver-device cuda:1 --no-pd-check                                     # GPU0 -> GPU1
    python3 -m scripts.gpu.bench_kv_staging --backends cuda_ipc --pd-backends cuda_ipc \\
        --wheels .pdwheels --out "$OUT"              # cuda_ipc alone (needs no NIXL/Mooncake)

A prefill and a decode process (one GPU, or the decode one on `--receiver-device`), each with
the engine's KV pool of a Llama-3-8B shape (32 layers, 8 KV heads, head dim 128, bf16, 16-token
pages: 2 MiB a page, 1024 pages) plus 256 staging pages after it (`PagedKVCache(staging_pages)`,
one registered region), move a 4k-token prompt (256 pages, 512 MiB) four ways per engine:

- `contiguous`: 256 consecutive pages on both sides, one descriptor (the ceiling);
- `scattered`: 256 pages at random on both sides, one descriptor a page (today's path);
- `staged`: the same pages gathered on the sender into its staging span (`PageStager.gather`,
  one kernel), one descriptor span -> span, scattered on the receiver into its pages
  (`PageStager.scatter`, one kernel) after the write is DONE; timed from the gather to the
  receiver's scatter done (a pipe round trip included, as the node's DONE message would be);
- `staged x4`: the same in four pieces, the gather of a piece overlapping the write of the one
  before (what a prefill node's chunks give when a prompt spans several);
- `prepped` (NIXL): page tables of both pools prepared once (`prep_xfer_dlist`), each write
  built by page indices (`make_prepped_xfer`); Mooncake has no prepared lists, so its row is
  the binding's own blocking batch call on the 256 descriptors (no waiter thread).

The `cuda_ipc` engine (kvtransfer/cuda_ipc.py: the receiver's pool mapped through CUDA IPC,
one Triton kernel a write) has a `contiguous` row and its scattered write three ways
(scripts/gpu/ipc_write_paths.py): `scattered` (the engine's `write` of the ranges),
`scattered, page ids` (its `write_pages`) and `scattered, before` (the write of the
2026-11-26 report, frozen): each is one kernel launch whatever the layout, timed from `write`
to its event passed in `poll`, with its host time split step by step in the parts column
(median; p10-p90 of the host total; every write's steps in the JSON). Three more rows copy
the same page ids with the driver's batched copy (`--cuda-ipc-copy batch`, one
`cuMemcpyBatchAsync` call, kvtransfer/cuda_batch_copy.py): `contiguous, driver batch`,
`scattered, driver batch` and `scattered, driver batch, overlap hint`; a driver without it
fails those rows (and the run), the others still print. After the page-id row the sender
notes the facts that explain its host time against the one-process profile
(scripts/gpu/host_probe.py): its CPU, NUMA nodes, threads, a numpy calibration (the parent's
is in the header), the CPU the receiver and the parent burned meanwhile, the same split with
the peer's pool in the sender's own process, and with the sender on the GPU's NUMA node.
Its reference checks run first in this process (one GPU only): the engine's kernel between
two pools of this process against torch indexing, timed for both layouts beside torch's
contiguous copy.
The PD check with `--pd-backends cuda_ipc` runs both nodes on it, without staging (the
staging flags are forced for the other backends only).

Checks first: the staging kernels against torch indexing on the GPU, torch's copy of the same
pages between the two pools (the copy ceiling), and for every row one write into a poisoned
receiver pool, every destination page equal to its source byte for byte and every other page
still poisoned; repeated after the timed writes. A row whose check fails prints no speed, and
the run then exits with code 1 (also on a failed reference or PD check, or a cuda_ipc row
that could not write).
`--device cpu --pool-pages 64 --tokens 256` is a dry run of the flow on a CPU (NIXL DRAM,
Mooncake tcp).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.memory.kv_cache import KVLayout, PagedKVCache
from engine.memory.staging import PageStager, StagingSpan
from kvtransfer import MemoryRegion, PeerInfo, TransferConfig, TransferState, create_engine
from kvtransfer.base import coalesce_pages
from kvtransfer.cuda_batch_copy import COPY_METHODS, page_descriptors
from kvtransfer.cuda_ipc_plan import (
    CopyPlan,
    ExportedRegion,
    IpcEndpoint,
    group_ranges,
    page_ids,
    page_regions,
    plan_columns,
    plan_pages,
)
from scripts.gpu import check_pd
from scripts.gpu.bench_mooncake_gpu import receive_rows, versions
from scripts.gpu.environment import add_site_arg

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
POOL_PAGES = 1024
POISON = 0xA5
SEED = 1234
METHODS = ("contiguous", "scattered", "staged", "staged x4", "prepped")
PIECES = 4  # "staged x4": gather piece k+1 while the engine moves piece k
PD_STAGING = ["--kv-staging-pages", "128", "--kv-staging-min-runs", "0"]
# cuda_ipc: the layout does not change the launch; row -> (layout, ipc_write_paths.py path):
# the engine's `write` ("scattered"), its `write_pages`, the write of the 2026-11-26 report,
# frozen ("before"), and the page ids by the driver's batched copy (`write_pages_batched`)
IPC_METHODS = {
    "scattered": ("scattered", "ranges"),
    "scattered, page ids": ("scattered", "pages"),
    "scattered, before": ("scattered", "before"),
    "contiguous, driver batch": ("contiguous", "batch"),
    "scattered, driver batch": ("scattered", "batch"),
    "scattered, driver batch, overlap hint": ("scattered", "batch-overlap"),
}
ONE_KERNEL = ("contiguous", *IPC_METHODS)
HOST_FACTS_AFTER = "scattered, page ids"  # the row the sender's host facts follow


@dataclass(frozen=True)
class Engine:
    label: str
    backend: str
    protocol: str = "tcp"
    methods: tuple[str, ...] = METHODS


CUDA_IPC = Engine("cuda_ipc kernel", "cuda_ipc", methods=ONE_KERNEL)
CUDA_IPC_CHECK = "cuda_ipc kernel == torch indexing (one process)"
ENGINES = (
    Engine("nixl UCX", "nixl"),
    Engine("mooncake nvlink_intra", "mooncake", "nvlink_intra"),
    CUDA_IPC,
)
CPU_ENGINES = (Engine("nixl UCX", "nixl"), Engine("mooncake tcp", "mooncake", "tcp"))


@dataclass(frozen=True)
class Setup:
    device: str
    pool_pages: int
    staging_pages: int
    tokens: int

    @property
    def n(self) -> int:
        return self.tokens // LAYOUT.page_size

    def cache(self, device: str) -> PagedKVCache:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        return PagedKVCache(LAYOUT, self.pool_pages, torch.device(device), self.staging_pages)

    def source(self, device: str) -> torch.Tensor:
        """The sender's pool bytes, the same in every process (seeded) -> [pages, page_bytes]."""
        gen = torch.Generator(device=device).manual_seed(SEED)
        total = self.pool_pages * LAYOUT.page_bytes
        data = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device, generator=gen)
        return data.view(self.pool_pages, LAYOUT.page_bytes)

    def pages(self) -> dict[str, tuple[list[int], list[int]]]:
        rng = random.Random(SEED)
        n, pool = self.n, self.pool_pages
        scattered = rng.sample(range(1, pool), n), rng.sample(range(1, pool), n)
        return {"contiguous": (list(range(1, n + 1)), list(range(pool - n, pool))),
                "scattered": scattered}  # fmt: skip


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def _bytes(cache: PagedKVCache) -> torch.Tensor:
    return cache.buffer.view(torch.uint8).view(cache.num_pages, LAYOUT.page_bytes)


def _region(cache: PagedKVCache, device: str) -> MemoryRegion:
    storage = cache.storage
    return MemoryRegion("kv", storage.data_ptr(), storage.numel() * storage.element_size(), device)


def _engine(engine: Engine, name: str) -> Any:
    config = TransferConfig(backend=engine.backend, node_name=name, protocol=engine.protocol)
    return create_engine(config)


def receiver_main(engine: Engine, setup: Setup, device: str, conn: Any) -> None:
    """The decode side: poisons, checks, and scatters its staging span on request."""
    cache = setup.cache(device)
    stager = PageStager(cache, min_runs=0)
    pool = _bytes(cache)
    expected = setup.source(device)
    transfer = _engine(engine, "decode")
    region = _region(cache, device)
    transfer.register([region])
    conn.send((transfer.local_endpoint(), region, os.getpid()))
    while (msg := conn.recv())[0] != "quit":
        if msg[0] == "poison":
            cache.storage.view(torch.uint8).fill_(POISON)
            _sync(device)
            conn.send(True)
        elif msg[0] == "scatter":  # ("scatter", span start, dst pages)
            span = StagingSpan(msg[1], len(msg[2]))
            start = time.perf_counter()
            stager.scatter(span, 0, msg[2])
            _sync(device)
            conn.send((time.perf_counter() - start) * 1e3)
        else:  # ("check", src pages, dst pages)
            dst = torch.tensor(msg[2], device=device)
            untouched = torch.ones(cache.num_pages, dtype=torch.bool, device=device)
            untouched[dst] = False
            landed = torch.equal(pool[dst], expected[torch.tensor(msg[1], device=device)])
            conn.send(landed and bool((pool[untouched] == POISON).all()))
    transfer.close()


@dataclass
class Row:
    engine: str
    method: str
    descriptors: int = 0
    ms: float = 0.0  # median
    spread: str = ""
    gbps: float = 0.0
    checked: bool = False
    parts: str = ""  # staged: gather / write / scatter medians; cuda_ipc: its host steps
    error: str = ""
    host_steps: dict[str, list[float]] = field(default_factory=dict)  # cuda_ipc: per write
    notes: str = ""  # cuda_ipc: the sender's host facts (scripts/gpu/host_probe.py)


class Sender:
    """The prefill side: one engine, the receiver's pipe, and one timed way per method."""

    def __init__(self, engine: Engine, setup: Setup, conn: Any, endpoint: bytes,
                 remote: MemoryRegion, receiver_pid: int = 0) -> None:  # fmt: skip
        self.setup, self.conn, self.engine_spec, self.remote = setup, conn, engine, remote
        self.receiver_pid = receiver_pid
        self.cache = setup.cache(setup.device)
        _bytes(self.cache).copy_(setup.source(setup.device))
        _sync(setup.device)
        self.stager = PageStager(self.cache, min_runs=0)
        self.engine = _engine(engine, "prefill")
        self.local = _region(self.cache, setup.device)
        self.engine.register([self.local])
        self.engine.connect(PeerInfo("decode", endpoint, {"kv": remote}))
        # staged: gather (and start the writes), wait for the writes, receiver's scatter
        self.parts: dict[str, list[float]] = {"gather": [], "write": [], "scatter": []}

    def ranges(self, src: list[int], dst: list[int]) -> list[Any]:
        return coalesce_pages(src, dst, LAYOUT.page_bytes, self.local.addr, self.remote.addr)

    def write(self, ranges: list[Any]) -> float:
        start = time.perf_counter()
        handle = self.engine.write("decode", ranges)
        while (state := self.engine.poll(handle)) is TransferState.PENDING:
            pass
        self.engine.release(handle)
        if state is not TransferState.DONE:
            raise RuntimeError(f"a write of {len(ranges)} ranges ended {state.value}")
        return (time.perf_counter() - start) * 1e3

    def wait(self, handle: Any) -> None:
        while (state := self.engine.poll(handle)) is TransferState.PENDING:
            pass
        self.engine.release(handle)
        if state is not TransferState.DONE:
            raise RuntimeError(f"a staged write ended {state.value}")

    def staged(self, src: list[int], dst: list[int], pieces: int = 1) -> float:
        n = len(src)
        span = StagingSpan(self.setup.pool_pages, n)  # both sides: the first n staging pages
        bounds = [n * i // pieces for i in range(pieces + 1)]
        start = time.perf_counter()
        handles = []
        for lo, hi in itertools.pairwise(bounds):
            self.stager.gather(src[lo:hi], span, lo)
            ranges = self.ranges(span.ids(lo, hi), span.ids(lo, hi))
            handles.append(self.engine.write("decode", ranges))
        gathered = time.perf_counter()
        for handle in handles:
            self.wait(handle)
        written = time.perf_counter()
        self.conn.send(("scatter", span.start, dst))
        scatter_ms = self.conn.recv()
        end = time.perf_counter()
        self.parts["gather"].append((gathered - start) * 1e3)
        self.parts["write"].append((written - gathered) * 1e3)
        self.parts["scatter"].append(scatter_ms)
        return (end - start) * 1e3

    def prepped(self) -> Any:
        """NIXL: page tables of both pools prepared once; a write is built from indices."""
        agent = self.engine._agent
        peer = self.engine._peers["decode"].agent_name
        dev_local = 0 if self.setup.device == "cpu" else torch.device(self.setup.device).index
        kind = "DRAM" if self.setup.device == "cpu" else "VRAM"
        pb, pool = LAYOUT.page_bytes, self.setup.pool_pages

        def table(base: int, dev: int) -> np.ndarray:
            rows = [(base + p * pb, pb, dev) for p in range(pool)]
            return np.asarray(rows, dtype=np.uint64)

        remote_dev = 0 if self.remote.device == "cpu" else int(self.remote.device.split(":")[1])
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", table(self.local.addr, dev_local), kind)
        remote = agent.prep_xfer_dlist(peer, table(self.remote.addr, remote_dev), kind)

        def write(src: list[int], dst: list[int]) -> float:
            start = time.perf_counter()
            handle = agent.make_prepped_xfer("WRITE", local, src, remote, dst, b"")
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError("a prepared write ended ERR")
            return (time.perf_counter() - start) * 1e3

        return write

    def library_batch(self, src: list[int], dst: list[int]) -> float:
        """Mooncake: the binding's blocking batch write of the descriptors, no waiter thread."""
        lib = self.engine._live_engine()
        ranges = self.ranges(src, dst)
        args = (
            [r.src_addr for r in ranges],
            [r.dst_addr for r in ranges],
            [r.length for r in ranges],
        )
        start = time.perf_counter()
        rc = lib.batch_transfer_sync_write(self.engine._peer_sessions["decode"], *args)
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
        return (time.perf_counter() - start) * 1e3

    def ipc_job(self, src: list[int], dst: list[int]) -> Any:
        from scripts.gpu import ipc_write_paths as ipc

        page_bytes = LAYOUT.page_bytes
        return ipc.PageJob("decode", src, dst, page_bytes, self.local.addr, self.remote.addr)

    def ipc_split(self, path: str, src: list[int], dst: list[int], writes: int,
                  row: Row | None = None) -> str:  # fmt: skip
        """cuda_ipc: the host steps of one path, "host total (p10-p90): step / step ..."
        (medians); every write's steps into `row.host_steps`."""
        from scripts.gpu import ipc_write_paths as ipc

        per_write = ipc.host_steps(self.engine, path, self.ipc_job(src, dst), writes)
        if row is not None:
            row.host_steps = per_write
        return format_split(per_write)

    def host_facts(self, src: list[int], dst: list[int], writes: int) -> str:
        """Why this process's page-id write takes the host time it does, against the
        one-process profile (scripts/gpu/host_probe.py): where the sender runs, a numpy
        calibration (the parent's is in the header), the CPU the receiver and the parent
        burned during a second split, the split with the peer's pool in this process, and
        with the sender on the GPU's NUMA node."""
        from scripts.gpu import host_probe
        from scripts.gpu import ipc_write_paths as ipc

        here = host_probe.snapshot(gpu_bus_id(self.setup.device))
        facts = [here.line(), f"numpy calibration {host_probe.calibration_ms():.4f} ms"]
        job = self.ipc_job(src, dst)
        pids = {"receiver": self.receiver_pid, "parent": os.getppid(), "sender": os.getpid()}
        with host_probe.cpu_use(pids) as use:
            again = ipc.host_steps(self.engine, "pages", job, writes)
        facts.append(f"page ids again: {format_split(again)}; {use.line()}")
        facts.append(f"peer's pool in this process: {self.local_peer_split(src, dst, writes)}")
        near = set()
        if here.gpu_node is not None:
            near = host_probe.node_cpus(here.gpu_node) & os.sched_getaffinity(0)
        if near:
            pinned = host_probe.on_cpus(near, lambda: ipc.host_steps(self.engine, "pages", job,
                                                                     writes))  # fmt: skip
            facts.append(f"on the GPU's NUMA node ({len(near)} CPUs): {format_split(pinned)}")
        else:
            facts.append("the GPU's NUMA node is unknown: no pinned split")
        return "; ".join(facts)

    def local_peer_split(self, src: list[int], dst: list[int], writes: int) -> str:
        """The page-id split into a pool of this process (no IPC mapping, as
        tune_ipc_copy's profile has it): the same code in this process."""
        from scripts.gpu import ipc_write_paths as ipc

        pool = torch.empty(self.remote.length, dtype=torch.uint8, device=self.setup.device)
        peer = _engine(self.engine_spec, "local-decode")
        region = MemoryRegion("kv", pool.data_ptr(), pool.numel(), self.setup.device)
        try:
            peer.register([region])
            self.engine.connect(PeerInfo("local", peer.local_endpoint(), {"kv": region}))
            job = ipc.PageJob("local", src, dst, LAYOUT.page_bytes, self.local.addr, region.addr)
            return format_split(ipc.host_steps(self.engine, "pages", job, writes))
        finally:
            self.engine.synchronize()
            peer.close()

    def method(self, name: str, src: list[int], dst: list[int]) -> tuple[Any, int]:
        """(a callable doing one write, its descriptor count)."""
        if self.engine_spec.backend == "cuda_ipc" and name in IPC_METHODS:
            from scripts.gpu import ipc_write_paths as ipc

            job, path = self.ipc_job(src, dst), IPC_METHODS[name][1]
            return (lambda: ipc.timed_write(self.engine, path, job)), ipc.descriptors(path, job)
        if name == "staged":
            return (lambda: self.staged(src, dst)), 1
        if name == "staged x4":
            return (lambda: self.staged(src, dst, PIECES)), PIECES
        if name == "prepped" and self.engine_spec.backend == "nixl":
            write = self.prepped()
            return (lambda: write(src, dst)), len(src)
        if name == "prepped":
            return (lambda: self.library_batch(src, dst)), len(self.ranges(src, dst))
        ranges = self.ranges(src, dst)
        return (lambda: self.write(ranges)), len(ranges)

    def check(self, src: list[int], dst: list[int]) -> bool:
        self.conn.send(("check", src, dst))
        return bool(self.conn.recv())

    def row(self, name: str, repeats: int) -> Row:
        layout = "contiguous" if name == "contiguous" else "scattered"
        if self.engine_spec.backend == "cuda_ipc" and name in IPC_METHODS:
            layout = IPC_METHODS[name][0]
        src, dst = self.setup.pages()[layout]
        mooncake_batch = name == "prepped" and self.engine_spec.backend != "nixl"
        row = Row(self.engine_spec.label, "library batch call" if mooncake_batch else name)
        try:
            once, row.descriptors = self.method(name, src, dst)
            self.conn.send(("poison",))
            self.conn.recv()
            once()
            first = self.check(src, dst)
            for parts in self.parts.values():
                parts.clear()
            times = [once() for _ in range(repeats + 2)][2:]
            row.checked = first and self.check(src, dst)
        except Exception as exc:  # the row says so; the next method still runs
            row.error = f"{type(exc).__name__}: {exc}"[:300]
            return row
        row.ms = statistics.median(times)
        row.spread = f"{min(times):.2f}-{max(times):.2f}"
        row.gbps = len(src) * LAYOUT.page_bytes / row.ms / 1e6
        if self.engine_spec.backend == "cuda_ipc" and name in IPC_METHODS:
            try:
                row.parts = self.ipc_split(IPC_METHODS[name][1], src, dst, max(repeats, 20), row)
                if name == HOST_FACTS_AFTER:
                    row.notes = self.host_facts(src, dst, max(repeats, 20))
            except Exception as exc:  # the split is extra: the row's time stands
                row.parts += f" split failed: {type(exc).__name__}: {exc}"[:200]
        if name.startswith("staged"):
            row.parts = " / ".join(
                f"{statistics.median(v[2:]):.2f}" for v in self.parts.values() if len(v) > 2
            )
        return row


def format_split(per_write: dict[str, list[float]]) -> str:
    """ "host <median total> (p10-p90 a-b): step <median> / ..." of ipc_write_paths.host_steps."""
    medians = {step: statistics.median(v) for step, v in per_write.items()}
    total = per_write["host total"]
    deciles = statistics.quantiles(total, n=10, method="inclusive") if len(total) > 1 else total * 9
    steps = " / ".join(f"{step} {ms:.3f}" for step, ms in medians.items()
                       if step not in ("host total", "wait until DONE"))  # fmt: skip
    return f"host {medians['host total']:.3f} (p10-p90 {deciles[0]:.3f}-{deciles[-1]:.3f}): {steps}"


def gpu_bus_id(device: str) -> str:
    """ "0000:1b:00.0" of a CUDA device, "" where torch does not say."""
    try:
        props = torch.cuda.get_device_properties(torch.device(device))
    except (AssertionError, RuntimeError):  # no CUDA here (the CPU tests)
        return ""
    ids = [getattr(props, f"pci_{part}_id", -1) for part in ("domain", "bus", "device")]
    if min(ids) < 0:
        return ""
    return f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"


def sender_main(engine: Engine, setup: Setup, conn: Any, parent: Any, endpoint: bytes,
                remote: MemoryRegion, repeats: int, receiver_pid: int = 0) -> None:  # fmt: skip
    sender = Sender(engine, setup, conn, endpoint, remote, receiver_pid)
    for name in engine.methods:
        row = sender.row(name, repeats)
        print(row, flush=True)
        parent.send(row)
    conn.send(("quit",))
    sender.engine.close()
    parent.send(None)


def run_engine(engine: Engine, setup: Setup, receiver_device: str, repeats: int,
               timeout_s: float) -> list[Row]:  # fmt: skip
    ctx = mp.get_context("spawn")
    sender_end, receiver_end = ctx.Pipe()
    from_sender, to_parent = ctx.Pipe()
    receiver = ctx.Process(target=receiver_main, args=(engine, setup, receiver_device,
                                                       receiver_end), daemon=True)  # fmt: skip
    receiver.start()
    rows: list[Row] = []
    sender = None
    try:
        if not sender_end.poll(timeout_s):
            raise RuntimeError(f"receiver did not start (exit code {receiver.exitcode})")
        endpoint, remote, receiver_pid = sender_end.recv()
        sender_args = (engine, setup, sender_end, to_parent, endpoint, remote, repeats,
                       receiver_pid)  # fmt: skip
        sender = ctx.Process(target=sender_main, args=sender_args, daemon=True)
        sender.start()
        receive_rows(sender, from_sender, timeout_s, rows)
    except Exception as exc:  # one engine failing must not lose the other
        rows.append(Row(engine.label, "-", error=str(exc)))
    finally:
        for proc in (sender, receiver):
            if proc is not None:
                proc.join(timeout=20)
                if proc.is_alive():
                    proc.kill()
    return rows


def _time_ms(fn: Any, devices: tuple[str, ...], repeats: int) -> float:
    """Median wall time of `fn` with every device in `devices` synchronized around it."""
    times = []
    for _ in range(repeats + 2):
        for device in devices:
            _sync(device)
        start = time.perf_counter()
        fn()
        for device in devices:
            _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def reference_checks(
    setup: Setup, receiver_device: str, repeats: int, with_cuda_ipc: bool = False
) -> dict[str, str]:
    """The staging kernels against torch indexing, and torch's copy of the pages between two
    pools in this process (the ceiling): each check must pass before its time is printed."""
    out: dict[str, str] = {}
    src_pages, dst_pages = setup.pages()["scattered"]
    a, b = setup.cache(receiver_device), setup.cache(setup.device)  # sender's GPU current
    _bytes(b).copy_(setup.source(setup.device))
    span = StagingSpan(setup.pool_pages, setup.n)
    stager_b, stager_a = PageStager(b, 0), PageStager(a, 0)
    src = torch.tensor(src_pages, device=setup.device)
    dst = torch.tensor(dst_pages, device=receiver_device)
    n = setup.n
    stager_b.gather(src_pages, span, 0)
    b_bytes, a_bytes = _bytes(b), _bytes(a)  # bytes: random bf16 bits hold NaNs
    gather_ok = torch.equal(b.staging[:n].view(torch.uint8).reshape(n, -1), b_bytes[src])
    a.staging[:n].copy_(b.staging[:n])
    stager_a.scatter(span, 0, dst_pages)
    _sync(receiver_device)
    scatter_ok = torch.equal(a_bytes[dst].to(setup.device), b_bytes[src])
    out["staging kernels == torch indexing"] = "PASS" if gather_ok and scatter_ok else "FAIL"
    if gather_ok and scatter_ok:
        nbytes = setup.n * LAYOUT.page_bytes
        g = _time_ms(lambda: stager_b.gather(src_pages, span, 0), (setup.device,), repeats)
        s = _time_ms(lambda: stager_a.scatter(span, 0, dst_pages), (receiver_device,), repeats)
        out[f"gather kernel, {n} pages"] = f"{g:.3f} ms ({nbytes / g / 1e6:.0f} GB/s moved)"
        out[f"scatter kernel, {n} pages"] = f"{s:.3f} ms ({nbytes / s / 1e6:.0f} GB/s moved)"
    both = (setup.device, receiver_device)  # a peer copy: both GPUs' clocks
    copy = _time_ms(lambda: a.staging[:n].copy_(b.staging[:n]), both, repeats)
    a_bytes.fill_(POISON)
    for s_page, d_page in zip(src_pages, dst_pages, strict=True):
        a_bytes[d_page].copy_(b_bytes[s_page])
    _sync(receiver_device)
    copy_ok = torch.equal(a_bytes[dst].to(setup.device), b_bytes[src])
    out["torch page copy == source"] = "PASS" if copy_ok else "FAIL"
    rate = n * LAYOUT.page_bytes / copy / 1e6
    out[f"torch copy, {n} pages as one contiguous copy"] = f"{copy:.3f} ms ({rate:.0f} GB/s)"
    if with_cuda_ipc and receiver_device == setup.device and setup.device.startswith("cuda"):
        out.update(cuda_ipc_reference(setup, a, b, repeats))
    return out


def cuda_ipc_reference(
    setup: Setup, a: PagedKVCache, b: PagedKVCache, repeats: int
) -> dict[str, str]:
    """The cuda_ipc engine's kernel, and its driver batch where the driver has one, between
    two pools of this process (no IPC mapping: the same calls as between processes):
    byte-exact on a poisoned receiver for both layouts, then timed."""
    out: dict[str, str] = {}
    try:
        sender, receiver = _engine(CUDA_IPC, "ref-prefill"), _engine(CUDA_IPC, "ref-decode")
        local, remote = _region(b, setup.device), _region(a, setup.device)
        sender.register([local])
        receiver.register([remote])
        sender.connect(PeerInfo("decode", receiver.local_endpoint(), {"kv": remote}))
    except Exception as exc:  # the backend itself does not start: say why, loudly
        out[CUDA_IPC_CHECK] = "FAIL"
        out["cuda_ipc start error"] = f"{type(exc).__name__}: {exc}"[:400]
        return out
    a_bytes, b_bytes = _bytes(a), _bytes(b)
    driver = sender._driver
    version = f"{driver.version // 1000}.{driver.version % 1000 // 10}"
    copier = driver.batch_copier
    out["CUDA driver, batched copy"] = (
        f"{version}, {copier.symbol if copier else 'none: ' + driver.batch_missing}"
    )
    ok = True
    for layout, (src, dst) in setup.pages().items():
        ranges = coalesce_pages(src, dst, LAYOUT.page_bytes, local.addr, remote.addr)
        ways: dict[str, Any] = {"kernel": lambda r=ranges: sender.write("decode", r)}
        if copier is not None:  # the rows of the driver batch fail loudly where it is missing
            ways["driver batch"] = lambda s=src, d=dst: sender.write_pages_batched(
                "decode", s, d, LAYOUT.page_bytes, (local.addr, remote.addr)
            )
        for way, start in ways.items():
            ms = _reference_write(sender, start, a, (a_bytes, b_bytes), (src, dst), repeats)
            if isinstance(ms, str):  # a write that failed: its message is the finding
                out[f"cuda_ipc error, {way}, {layout}"] = ms
                ok = False
            elif ms < 0:
                ok = False
            else:
                nbytes = len(src) * LAYOUT.page_bytes
                out[f"cuda_ipc {way}, {layout}, one process"] = (
                    f"{ms:.3f} ms ({nbytes / ms / 1e6:.0f} GB/s, {len(ranges)} ranges)"
                )
    out[CUDA_IPC_CHECK] = "PASS" if ok else "FAIL"
    sender.close()
    receiver.close()
    return out


def _reference_write(
    sender: Any,
    start: Any,
    receiver: PagedKVCache,
    pools: tuple[torch.Tensor, torch.Tensor],
    pages: tuple[list[int], list[int]],
    repeats: int,
) -> float | str:
    """One write by `start()` into the poisoned `receiver`, checked byte for byte (every
    destination page its source, every other page still poisoned), then timed: its median
    ms, -1.0 if its bytes were wrong, or the error of a write that failed."""
    a_bytes, b_bytes = pools
    src, dst = pages
    device = str(a_bytes.device)

    def once() -> None:
        handle = start()
        while (state := sender.poll(handle)) is TransferState.PENDING:
            pass
        sender.release(handle)
        if state is not TransferState.DONE:
            raise RuntimeError(f"a cuda_ipc write ended {state.value}")

    receiver.storage.view(torch.uint8).fill_(POISON)
    try:
        once()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:400]
    _sync(device)
    untouched = torch.ones(receiver.num_pages, dtype=torch.bool, device=device)
    untouched[torch.tensor(dst, device=device)] = False
    landed = torch.equal(a_bytes[dst], b_bytes[src])
    if not (landed and bool((a_bytes[untouched] == POISON).all())):
        return -1.0
    return _time_ms(once, (device,), repeats)


def plan_cost(setup: Setup, repeats: int) -> dict[str, str]:
    """The CPU part of a cuda_ipc write before its upload, the scattered pages four ways
    (scripts/gpu/ipc_write_paths.py): `before` (the write of the 2026-11-26 report), `ranges`
    (the engine's `write`: ranges read and checked against both pools, planned into a row
    table), `pages` (`write_pages`: page ids checked and planned) and the driver batch's
    descriptors (`write_pages_batched`: page ids checked, one descriptor a run); median and
    best of `repeats`. The engine's rows include it."""
    from scripts.gpu import ipc_write_paths as ipc

    src, dst = setup.pages()["scattered"]
    pool_bytes = setup.pool_pages * LAYOUT.page_bytes
    local = ExportedRegion("kv", 1 << 40, pool_bytes, "cuda:0")  # any aligned bases
    peer = IpcEndpoint("decode", "", 0, (ExportedRegion("kv", 1 << 41, pool_bytes, "cuda:0"),))
    bases = (local.addr, peer.regions[0].addr)
    ranges = coalesce_pages(src, dst, LAYOUT.page_bytes, *bases)
    out = np.empty((4096, 3), dtype=np.int64)

    def before(mark: Any) -> CopyPlan:
        return ipc.before_plan(ranges, [local], peer.regions, {0: bases[1]}, mark)[2]

    def from_ranges(mark: Any) -> CopyPlan:
        [columns] = group_ranges(ranges, [local], peer, "bench").values()
        mark("columns + bounds")
        columns[0] -= bases[0]
        columns[1] -= bases[1]
        plan = plan_columns(columns, bases, out=out)
        mark("offsets + plan_columns")
        return plan

    def from_pages(mark: Any) -> CopyPlan:
        planned = plan_pages(src, dst, LAYOUT.page_bytes, bases, [local], peer.regions, bases, out)
        mark("plan_pages")
        assert planned is not None
        return planned.plan

    def batch_descriptors(mark: Any) -> CopyPlan:  # the driver batch's host part
        src_ids, dst_ids = page_ids(src), page_ids(dst)
        pair = page_regions(src_ids, dst_ids, LAYOUT.page_bytes, bases, [local], peer.regions)
        assert pair is not None
        desc = page_descriptors(src_ids, dst_ids, LAYOUT.page_bytes, *bases)
        mark("page_regions + page_descriptors")
        return CopyPlan(LAYOUT.page_bytes, 8, np.empty((desc.count, 3), dtype=np.int64))

    planned = from_pages(lambda step: None)

    def caller(mark: Any) -> CopyPlan:  # what a node pays before `write`: building the ranges
        coalesce_pages(src, dst, LAYOUT.page_bytes, *bases)
        mark("coalesce_pages")
        return planned

    out_info = {}
    ways = (("before", before), ("ranges", from_ranges), ("pages", from_pages),
            ("pages as driver-batch descriptors", batch_descriptors),
            ("(for scale) the caller's coalesce_pages alone", caller))  # fmt: skip
    for name, fn in ways:
        times: list[float] = []
        steps: dict[str, list[float]] = {}
        for i in range(repeats + 2):
            marks = [("start", time.perf_counter())]
            plan = fn(lambda step, m=marks: m.append((step, time.perf_counter())))
            if i < 2:
                continue
            times.append((marks[-1][1] - marks[0][1]) * 1e3)
            for (_, a), (step, b) in itertools.pairwise(marks):
                steps.setdefault(step, []).append((b - a) * 1e3)
        split = " + ".join(f"{k} {statistics.median(v):.4f}" for k, v in steps.items())
        key = f"cuda_ipc CPU plan of a {len(src)}-page scattered write, {name}"
        out_info[key] = (f"median {statistics.median(times):.4f} ms ({split}), best "
                         f"{min(times):.4f} ms; {plan.num_rows} rows of chunks of "
                         f"{plan.chunk_bytes >> 10} KiB, {plan.word_bytes} B words")  # fmt: skip
    return out_info


def pd_check(
    device: str, backends: list[str], ipc_copies: tuple[str, ...] = ("kernel",)
) -> list[check_pd.Check]:
    """check_pd's PD trio per backend: staging forced on both nodes, except for cuda_ipc,
    whose kernel writes the scattered pages directly: one trio per `--cuda-ipc-copy` method
    of `ipc_copies` (a node whose driver lacks the batched copy falls back to the kernel
    with a warning in its log; the header's "CUDA driver, batched copy" line says which)."""
    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="kv-staging-pd-"))
    staged = [b for b in backends if b != "cuda_ipc"]
    checks = []
    if staged:
        checks += check_pd.run(device, staged, workdir, PD_STAGING, ", staging forced").checks
    if "cuda_ipc" in backends:
        for method in ipc_copies:
            extra, label = [], ""
            if method != "kernel":
                extra, label = ["--cuda-ipc-copy", method], f", --cuda-ipc-copy {method}"
            checks += check_pd.run(device, ["cuda_ipc"], workdir / method, extra, label).checks
    return checks


def markdown(info: dict[str, str], rows: list[Row], pd: list[check_pd.Check]) -> str:
    contiguous = {r.engine: r.ms for r in rows if r.method == "contiguous" and r.checked}
    fastest = min(contiguous.values(), default=0.0)
    lines = [
        "| engine | method | descriptors | ms (median) | min-max | GB/s | % of contiguous "
        "| % of the fastest contiguous | parts: gather+post / wait / scatter ms; cuda_ipc: "
        "host ms | byte-exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error or not r.checked:
            verdict = f"failed: {r.error.replace('|', '/')}" if r.error else "NO"
            lines.append(f"| {r.engine} | {r.method} | {r.descriptors} | | | | | | | {verdict} |")
            continue
        base = contiguous.get(r.engine)
        pct = f"{100 * base / r.ms:.1f}%" if base else ""
        best = f"{100 * fastest / r.ms:.1f}%" if fastest else ""
        lines.append(f"| {r.engine} | {r.method} | {r.descriptors} | {r.ms:.3f} | {r.spread} "
                     f"| {r.gbps:.0f} | {pct} | {best} | {r.parts} | yes |")  # fmt: skip
    head = [f"- {k}: {v}" for k, v in info.items()]
    checks = ["| check | result | detail |", "|---|---|---|"]
    checks += [f"| {c.name} | {'PASS' if c.ok else 'FAIL'} | {c.detail.replace('|', '/')} |"
               for c in pd]  # fmt: skip
    notes = [f"- {r.engine}, {r.method}, the sender's host facts: {r.notes}" for r in rows
             if r.notes]  # fmt: skip
    notes = ["", *notes] if notes else []
    return "\n".join([*head, "", *(checks if pd else []), "", *lines, *notes]) + "\n"


def _version(package: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return "not installed"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--carry", type=Path, help="folder from mooncake_wheels.py pack")
    parser.add_argument("--wheels", type=Path, help="grpcio / protobuf wheels (check_pd.py)")
    parser.add_argument("--no-pd-check", action="store_true", help="skip the PD trio check")
    parser.add_argument(
        "--pd-backends", nargs="+", default=["nixl"], choices=["nixl", "mooncake", "cuda_ipc"]
    )
    parser.add_argument(
        "--pd-ipc-copy",
        nargs="+",
        default=["kernel"],
        choices=COPY_METHODS,
        help="--pd-backends cuda_ipc: a PD trio per --cuda-ipc-copy method of both nodes",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        default=[e.backend for e in ENGINES],
        choices=[e.backend for e in ENGINES],
        help="the engines whose rows run (GPU; the CPU dry run has nixl and mooncake tcp)",
    )
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--engine-timeout", type=float, default=150.0)
    parser.add_argument("--device", default="cuda:0", help="cpu: a dry run of the flow")
    parser.add_argument("--receiver-device", default=None, help="default: --device")
    parser.add_argument("--pool-pages", type=int, default=POOL_PAGES)
    add_site_arg(parser)
    return parser


def engines_to_run(args: argparse.Namespace, info: dict[str, str]) -> list[Engine]:
    """The engines of `--backends` on a GPU (NIXL only where its CUDA wheel is installed,
    cuda_ipc only if its one-process check passed), both CPU engines on a CPU; none if a
    check of the other paths failed."""
    if any(v == "FAIL" for k, v in info.items() if k != CUDA_IPC_CHECK):
        return []
    if args.device == "cpu":
        return list(CPU_ENGINES)
    skip = {"nixl"} if info.get("nixl-cu13") == "not installed" else set()
    if info.get(CUDA_IPC_CHECK) == "FAIL":
        skip.add("cuda_ipc")
    return [e for e in ENGINES if e.backend in args.backends and e.backend not in skip]


def main() -> None:
    args = build_parser().parse_args()
    check_pd.install(args.carry, args.wheels, args.site)  # the spawned processes too
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    receiver_device = args.receiver_device or args.device
    setup = Setup(args.device, args.pool_pages, args.tokens // LAYOUT.page_size, args.tokens)
    info = {"date (UTC)": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), **versions(),
            "triton": _version("triton"),
            "sender -> receiver": f"{args.device} -> {receiver_device}",
            "prompt": f"{args.tokens} tokens = {setup.n} pages of {LAYOUT.page_bytes >> 20} MiB "
                      f"(8B shape, bf16), pools of {args.pool_pages} pages"}  # fmt: skip
    pd = [] if args.no_pd_check else pd_check(args.device, args.pd_backends, args.pd_ipc_copy)
    with_cuda_ipc = "cuda_ipc" in args.backends
    if with_cuda_ipc:
        from scripts.gpu import host_probe

        info.update(plan_cost(setup, args.repeats))
        info["numpy calibration, parent process (host_probe.calibration_ms)"] = (
            f"{host_probe.calibration_ms():.4f} ms"
        )
    info.update(reference_checks(setup, receiver_device, args.repeats, with_cuda_ipc))
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the checks' pools: each process needs its own now
    print(json.dumps(info, indent=1), flush=True)
    rows: list[Row] = []
    engines = engines_to_run(args, info)
    if any(v == "FAIL" for v in info.values()):
        print("a reference check FAILED: its engines have no rows (see the lines above)")
    for engine in engines:
        rows += run_engine(engine, setup, receiver_device, args.repeats, args.engine_timeout)
    table = markdown(info, rows, pd)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_staging.md").write_text(table)
    raw = {"info": info, "pd": [asdict(c) for c in pd], "rows": [asdict(r) for r in rows]}
    (args.out / "kv_staging.json").write_text(json.dumps(raw, indent=1))
    print(table)
    if failures := failed_checks(info, rows, pd):
        raise SystemExit("FAIL: " + "; ".join(failures))


def failed_checks(info: dict[str, str], rows: list[Row], pd: list[check_pd.Check]) -> list[str]:
    """What must fail the run loudly: a reference or PD check, a row whose bytes were
    checked and wrong, a cuda_ipc row that could not write."""
    failures = [k for k, v in info.items() if v == "FAIL"]
    failures += [f"PD check {c.name}" for c in pd if not c.ok]
    failures += [
        f"{r.engine} {r.method}: bytes differ" for r in rows if not r.error and not r.checked
    ]
    failures += [f"{r.engine} {r.method}: {r.error}" for r in rows
                 if r.error and r.engine == CUDA_IPC.label]  # fmt: skip
    return failures


if __name__ == "__main__":
    main()
