"""KV pages GPU -> GPU through Mooncake's CUDA build: two processes on one GPU, checked byte-exact.

    python3 -m scripts.gpu.mooncake_wheels pack .mooncake            # here (no index there)
    python3 -m scripts.gpu.bench_mooncake_gpu --carry .mooncake --out "$OUT"   # on the GPU host

A prefill process and a decode process share GPU 0, each with the engine's KV pool
(`PagedKVCache` of a Llama-3-8B shape: 32 layers, 8 KV heads, head dim 128, bf16, 16-token
pages, all layers of a page together: 2 MiB a page, 1024 pages) registered with
`kvtransfer.mooncake.MooncakeEngine`. A 1k or 4k-token prompt (64 or 256 pages) is written as
one contiguous run, as runs of 1-8 pages scattered over the pool (independently on each side,
as two allocators would place them), or as single scattered pages, coalesced by
`coalesce_pages`. Transports: Mooncake "nvlink_intra" (CUDA IPC, the GPU copies), the same
with `poll` keeping the GIL (the engine before it yielded to its waiter thread), Mooncake "tcp"
with `MC_FORCE_TCP` (GPU memory staged through host buffers) and NIXL's UCX when its wheel is
there. Before timing, the decode pool is poisoned, one write is made and every destination
page must equal its source byte for byte while every other page keeps the poison; the check is
repeated after the timed writes. Times: `write` until `poll` says DONE, polled in a busy loop
(as a step loop that keeps the GIL) and with `time.sleep(0)` between polls; for Mooncake also
the binding's blocking batch call alone. Ceiling: torch's copy of the same bytes on the same
GPU (one contiguous copy, and one `copy_` per coalesced range). `--only LABEL...` runs some
transports; `--device cpu --pool-pages 64 --tokens 256` is a dry run of the flow on a CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from engine.memory.kv_cache import KVLayout, PagedKVCache
from kvtransfer import (
    MemoryRegion,
    PeerInfo,
    TransferConfig,
    TransferRange,
    TransferState,
    coalesce_pages,
    create_engine,
)
from scripts.gpu import mooncake_wheels
from scripts.gpu.environment import add_site_arg, site_dir, use_site

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
POOL_PAGES = 1024  # 2 GiB a process
POISON = 0xA5
SEED = 1234
MAX_RUN = 8


@dataclass(frozen=True)
class Variant:
    label: str
    backend: str
    protocol: str = "tcp"
    env: dict[str, str] = field(default_factory=dict)
    no_yield: bool = False  # nvlink_intra: poll without handing the GIL to the waiter, as TCP


VARIANTS = (
    Variant("mooncake nvlink_intra", "mooncake", "nvlink_intra"),
    Variant("mooncake nvlink_intra, poll keeps GIL", "mooncake", "nvlink_intra", no_yield=True),
    Variant("mooncake tcp, GPU memory staged", "mooncake", "tcp", {"MC_FORCE_TCP": "1"}),
    Variant("nixl UCX", "nixl"),
)


@dataclass(frozen=True)
class Shape:
    tokens: int
    layout: str  # "contiguous" | "runs" | "pages"
    src_pages: list[int]
    dst_pages: list[int]


@dataclass
class Row:
    variant: str
    tokens: int
    layout: str
    descriptors: int
    mib: float
    ms: float  # median wall time, write() until poll() says DONE, polling in a busy loop
    ms_spread: str  # min-max
    gbps: float
    checked: bool
    yielding_ms: float = 0.0  # the same with time.sleep(0) between polls (GIL released)
    library_sync_ms: float = 0.0  # mooncake: the binding's blocking batch call, no wrapper
    error: str = ""


@dataclass
class TorchRow:
    tokens: int
    layout: str
    descriptors: int
    contiguous_ms: float
    contiguous_gbps: float
    per_range_ms: float
    per_range_gbps: float


def scattered_runs(n_pages: int, pool_pages: int, max_run: int, rng: random.Random) -> list[int]:
    """`n_pages` distinct pages of a pool, in runs of 1..max_run consecutive pages placed at
    random, with at least one free page between two runs (so runs never merge)."""
    runs: list[int] = []
    while sum(runs) < n_pages:
        runs.append(min(rng.randint(1, max_run), n_pages - sum(runs)))
    spare = pool_pages - n_pages - (len(runs) - 1)
    if spare < 0:
        raise ValueError(f"{n_pages} pages in {len(runs)} runs do not fit {pool_pages} pages")
    cuts = sorted(rng.randint(0, spare) for _ in range(len(runs)))
    gaps = [b - a for a, b in zip([0, *cuts], cuts, strict=False)]
    starts, position = [], 0
    for i, (gap, length) in enumerate(zip(gaps, runs, strict=True)):
        position += gap + (1 if i else 0)
        starts.append(position)
        position += length
    order = list(range(len(runs)))
    rng.shuffle(order)  # a request's runs need not be in pool order
    return [starts[i] + j for i in order for j in range(runs[i])]


def shapes(token_counts: tuple[int, ...], pool_pages: int = POOL_PAGES) -> list[Shape]:
    rng = random.Random(SEED)
    out = []
    for tokens in token_counts:
        n = tokens // LAYOUT.page_size
        dst_start = pool_pages - n  # the other end of the pool
        out.append(Shape(tokens, "contiguous", list(range(n)), list(range(dst_start, pool_pages))))
        src = scattered_runs(n, pool_pages, MAX_RUN, rng)
        out.append(Shape(tokens, "runs", src, scattered_runs(n, pool_pages, MAX_RUN, rng)))
        pages = rng.sample(range(pool_pages), n), rng.sample(range(pool_pages), n)
        out.append(Shape(tokens, "pages", *pages))
    return out


@dataclass(frozen=True)
class Pool:
    """Where each process keeps its KV pool (`--device cpu` is a dry run of the flow)."""

    device: str = "cuda:0"
    pages: int = POOL_PAGES

    def cache(self) -> PagedKVCache:
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))
        return PagedKVCache(LAYOUT, self.pages, torch.device(self.device))

    def source_bytes(self) -> torch.Tensor:
        """The prefill pool's content, the same in every process (seeded)."""
        gen = torch.Generator(device=self.device).manual_seed(SEED)
        total = self.pages * LAYOUT.page_bytes
        data = torch.randint(0, 256, (total,), dtype=torch.uint8, device=self.device, generator=gen)
        return data.view(self.pages, LAYOUT.page_bytes)

    def page_bytes(self, cache: PagedKVCache) -> torch.Tensor:
        return cache.buffer.view(torch.uint8).view(self.pages, LAYOUT.page_bytes)

    def region(self, cache: PagedKVCache) -> MemoryRegion:
        buf = cache.buffer
        return MemoryRegion("kv", buf.data_ptr(), buf.numel() * buf.element_size(), self.device)

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def _engine(variant: Variant, name: str):
    return create_engine(TransferConfig(backend=variant.backend, node_name=name,
                                        protocol=variant.protocol))  # fmt: skip


def _receiver(variant: Variant, pool: Pool, parent, sender) -> None:  # `pool`: the receiver's
    """Decode side: owns a pool, poisons it and checks what arrived when the sender asks."""
    cache = pool.cache()
    pages = pool.page_bytes(cache)
    expected = pool.source_bytes()
    engine = _engine(variant, "decode")
    region = pool.region(cache)
    engine.register([region])
    parent.send((engine.local_endpoint(), region))
    while (msg := sender.recv())[0] != "quit":
        if msg[0] == "poison":
            pages.fill_(POISON)
            pool.sync()
            sender.send(True)
        else:  # ("check", src_pages, dst_pages)
            src = torch.tensor(msg[1], device=pool.device)
            dst = torch.tensor(msg[2], device=pool.device)
            untouched = torch.ones(pool.pages, dtype=torch.bool, device=pool.device)
            untouched[dst] = False
            landed = torch.equal(pages[dst], expected[src])
            kept = bool((pages[untouched] == POISON).all())
            sender.send(landed and kept)
    engine.close()


def _time_write(engine, ranges: list[TransferRange], yielding: bool = False) -> float:
    start = time.perf_counter()
    handle = engine.write("decode", ranges)
    while (state := engine.poll(handle)) is TransferState.PENDING:
        if yielding:
            time.sleep(0)
    engine.release(handle)
    if state is not TransferState.DONE:
        raise RuntimeError(f"write of {len(ranges)} ranges ended {state.value}")
    return (time.perf_counter() - start) * 1e3


def _library_sync_ms(engine, session: str, ranges: list[TransferRange], repeats: int) -> float:
    """The binding's blocking batch write, timed without the project's waiter thread."""
    lib = engine._live_engine()
    args = ([r.src_addr for r in ranges], [r.dst_addr for r in ranges], [r.length for r in ranges])
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        rc = lib.batch_transfer_sync_write(session, *args)
        times.append((time.perf_counter() - start) * 1e3)
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_write returned {rc}")
    return statistics.median(times[2:])


def _sender(variant: Variant, pool: Pool, endpoint: bytes, remote: MemoryRegion, receiver,
            parent, shape_list: list[Shape], repeats: int) -> None:  # fmt: skip
    cache = pool.cache()
    pool.page_bytes(cache).copy_(pool.source_bytes())
    pool.sync()
    engine = _engine(variant, "prefill")
    if variant.no_yield:
        engine._yield_in_poll = False
    local = pool.region(cache)
    engine.register([local])
    engine.connect(PeerInfo("decode", endpoint, {"kv": remote}))
    for shape in shape_list:
        ranges = coalesce_pages(shape.src_pages, shape.dst_pages, LAYOUT.page_bytes,
                                local.addr, remote.addr)  # fmt: skip
        nbytes = len(shape.src_pages) * LAYOUT.page_bytes
        row = Row(variant.label, shape.tokens, shape.layout, len(ranges), nbytes / 2**20,
                  0.0, "", 0.0, False)  # fmt: skip
        try:
            receiver.send(("poison",))
            receiver.recv()
            _time_write(engine, ranges)
            receiver.send(("check", shape.src_pages, shape.dst_pages))
            first_ok = receiver.recv()
            times = [_time_write(engine, ranges) for _ in range(repeats + 2)][2:]
            yielding = [_time_write(engine, ranges, True) for _ in range(repeats + 2)][2:]
            row.yielding_ms = statistics.median(yielding)
            receiver.send(("check", shape.src_pages, shape.dst_pages))
            row.checked = first_ok and receiver.recv()
            row.ms = statistics.median(times)
            row.ms_spread = f"{min(times):.2f}-{max(times):.2f}"
            row.gbps = nbytes / row.ms / 1e6
            if variant.backend == "mooncake":
                session = endpoint.decode()
                row.library_sync_ms = _library_sync_ms(engine, session, ranges, repeats)
        except Exception as exc:  # the row records it; the next shape still runs
            row.error = f"{type(exc).__name__}: {exc}"[:300]
        print(row, flush=True)
        parent.send(row)
    receiver.send(("quit",))
    engine.close()
    parent.send(None)


def run_variant(variant: Variant, pool: Pool, shape_list: list[Shape], repeats: int,
                timeout_s: float, receiver_pool: Pool | None = None) -> list[Row]:  # fmt: skip
    ctx = mp.get_context("spawn")
    from_receiver, to_parent_r = ctx.Pipe()
    from_sender, to_parent_s = ctx.Pipe()
    sender_end, receiver_end = ctx.Pipe()
    saved = {key: os.environ.get(key) for key in variant.env}
    os.environ.update(variant.env)  # children inherit the environment at start
    receiver = ctx.Process(
        target=_receiver,
        args=(variant, receiver_pool or pool, to_parent_r, receiver_end),
        daemon=True,
    )
    receiver.start()
    rows: list[Row] = []
    sender = None
    try:
        if not from_receiver.poll(timeout_s):
            raise RuntimeError(f"receiver did not start (exit code {receiver.exitcode})")
        endpoint, remote = from_receiver.recv()
        sender_args = (
            variant,
            pool,
            endpoint,
            remote,
            sender_end,
            to_parent_s,
            shape_list,
            repeats,
        )
        sender = ctx.Process(target=_sender, args=sender_args, daemon=True)
        sender.start()
        receive_rows(sender, from_sender, timeout_s, rows)
    except Exception as exc:  # one variant failing must not lose the others
        rows.append(Row(variant.label, 0, "-", 0, 0.0, 0.0, "", 0.0, False, error=str(exc)))
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        for proc in (sender, receiver):
            if proc is not None:
                proc.join(timeout=20)
                if proc.is_alive():
                    proc.kill()
    return rows


def _device_ms(fn, repeats: int, pool: Pool, other: Pool | None = None) -> float:
    if not pool.device.startswith("cuda"):
        return _wall_ms(fn, repeats)
    if other is not None and other.device != pool.device:  # a peer copy: both GPUs' clocks
        return _wall_ms(lambda: (fn(), pool.sync(), other.sync()), repeats)
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _wall_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def _torch_row(pool: Pool, src: torch.Tensor, dst: torch.Tensor, shape: Shape,
               repeats: int, other: Pool) -> TorchRow:  # fmt: skip
    n, page = len(shape.src_pages), LAYOUT.page_bytes
    ranges = coalesce_pages(shape.src_pages, shape.dst_pages, page, 0, 0)
    flat_src, flat_dst = src.view(-1), dst.view(-1)

    def per_range() -> None:
        for r in ranges:
            flat_dst[r.dst_addr : r.dst_addr + r.length].copy_(
                flat_src[r.src_addr : r.src_addr + r.length]
            )

    contiguous = _device_ms(lambda: dst[:n].copy_(src[:n]), repeats, pool, other)
    ranged = _device_ms(per_range, repeats, pool, other)
    dst.fill_(POISON)
    per_range()
    src_idx = torch.tensor(shape.src_pages, device=src.device)
    dst_idx = torch.tensor(shape.dst_pages, device=dst.device)
    if not torch.equal(dst[dst_idx].to(src.device), src[src_idx]):
        raise RuntimeError("the torch reference copy is wrong")
    nbytes = n * page
    return TorchRow(shape.tokens, shape.layout, len(ranges), contiguous,
                    nbytes / contiguous / 1e6, ranged, nbytes / ranged / 1e6)  # fmt: skip


def torch_reference(pool: Pool, shape_list: list[Shape], repeats: int,
                    receiver_pool: Pool | None = None) -> list[TorchRow]:  # fmt: skip
    """torch's copy of the same bytes from the sender's pool to the receiver's (inside GPU 0,
    or GPU 0 -> GPU 1: the peer copy): one contiguous copy, then one `copy_` per coalesced range
    between two pools (the launch-per-descriptor floor)."""
    other = receiver_pool or pool
    dst = other.page_bytes(other.cache())
    src = pool.page_bytes(pool.cache())  # last: the sender's GPU stays the current one
    src.copy_(pool.source_bytes())
    rows = [_torch_row(pool, src, dst, shape, repeats, other) for shape in shape_list]
    del src, dst
    if pool.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


TRANSPORT_SETTINGS = ("MC_FORCE_TCP", "MC_INTRANODE_NVLINK")
PROBE = """
import json, torch
from mooncake.engine import TransferEngine
engine = TransferEngine()
rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
cpu = torch.empty(1 << 20, dtype=torch.uint8)
cpu_rc = engine.register_memory(cpu.data_ptr(), 1 << 20)
print(json.dumps({"initialize": rc, "register CPU memory": cpu_rc}))
"""


def probe_transports() -> dict[str, str]:
    """`initialize` of the CUDA build with protocol "tcp" under each transport setting."""
    found = {}
    for setting in ("", *TRANSPORT_SETTINGS):
        env = {k: v for k, v in os.environ.items() if k not in TRANSPORT_SETTINGS}
        if setting:
            env[setting] = "1"
        env["MC_LOG_LEVEL"] = "INFO"
        try:
            done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                                  text=True, timeout=60)  # fmt: skip
            said = [ln for ln in (done.stdout + done.stderr).splitlines()
                    if "ransport" in ln or "rror" in ln][-3:]  # fmt: skip
            found[f"initialize, {setting or 'no setting'}"] = (
                f"{done.stdout.strip().splitlines()[-1] if done.stdout.strip() else '?'}"
                f" (exit {done.returncode}); log: {' / '.join(s[-120:] for s in said)}"
            )
        except subprocess.TimeoutExpired:
            found[f"initialize, {setting or 'no setting'}"] = "timed out after 60 s"
    return found


def receive_rows(sender: Any, from_sender: Any, timeout_s: float, rows: list[Any]) -> None:
    """Append the rows the sender process sends until its None; an error if it dies first or
    takes longer than `timeout_s` (the rows that came stay in `rows`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if from_sender.poll(1.0):
            row = from_sender.recv()
            if row is None:
                return
            rows.append(row)
        elif not sender.is_alive():
            raise RuntimeError(f"sender died (exit code {sender.exitcode})")
    raise RuntimeError(f"timed out after {timeout_s:.0f} s")


def versions() -> dict[str, str]:
    import importlib.metadata as md

    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "CUDA (torch)": str(torch.version.cuda),
        "GPU": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }
    for name in ("mooncake-transfer-engine-cuda13", "nixl", "nixl-cu13"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = "not installed"
    return found


def markdown(info: dict[str, str], torch_rows: list[TorchRow], rows: list[Row]) -> str:
    ceiling = {(t.tokens, t.layout): t for t in torch_rows}
    lines = [
        "| transport | prompt | pages as | descriptors | MiB | ms (median) | min-max | GB/s "
        "| ms, poll yields | library sync ms | torch copy GB/s (1 copy / per range) "
        "| % of one copy | % of per-range copy | byte-exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error and not r.ms:
            lines.append(f"| {r.variant} | {r.tokens} | {r.layout} | | | | | | | | | | | failed: "
                         f"{r.error.replace('|', '/')} |")  # fmt: skip
            continue
        t = ceiling.get((r.tokens, r.layout))
        ref = f"{t.contiguous_gbps:.0f} / {t.per_range_gbps:.0f}" if t else ""
        pct = f"{100 * r.gbps / t.per_range_gbps:.1f}%" if t else ""
        pct_one = f"{100 * r.gbps / t.contiguous_gbps:.1f}%" if t else ""
        lib = f"{r.library_sync_ms:.2f}" if r.library_sync_ms else ""
        lines.append(f"| {r.variant} | {r.tokens} | {r.layout} | {r.descriptors} | {r.mib:.0f} "
                     f"| {r.ms:.2f} | {r.ms_spread} | {r.gbps:.1f} | {r.yielding_ms:.2f} | {lib} "
                     f"| {ref} | {pct_one} | {pct} "
                     f"| {'yes' if r.checked else 'NO'} |")  # fmt: skip
    head = [f"- {k}: {v}" for k, v in info.items()]
    return "\n".join([*head, "", *lines]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--carry", type=Path, help="folder from mooncake_wheels.py pack")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--variant-timeout", type=float, default=150.0)
    parser.add_argument("--only", nargs="*", help="variant labels to run (default: all)")
    parser.add_argument("--device", default="cuda:0", help="cpu: a dry run of the flow")
    parser.add_argument(
        "--receiver-device", default=None, help="the decode process's GPU (default: --device)"
    )
    parser.add_argument("--pool-pages", type=int, default=POOL_PAGES)
    add_site_arg(parser)
    args = parser.parse_args()
    if args.carry:
        site = site_dir(args.site)
        use_site(site, mooncake_wheels.install(args.carry, site))  # the spawned engines too
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    info = {"date (UTC)": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), **versions()}
    if args.carry:
        info.update(probe_transports())
    print(json.dumps(info, indent=1), flush=True)
    pool = Pool(args.device, args.pool_pages)
    receiver_pool = Pool(args.receiver_device or args.device, args.pool_pages)
    info["sender -> receiver"] = f"{pool.device} -> {receiver_pool.device}"
    shape_list = shapes(tuple(args.tokens), pool.pages)
    torch_rows = torch_reference(pool, shape_list, args.repeats, receiver_pool)
    for t in torch_rows:
        print(t, flush=True)
    rows: list[Row] = []
    for variant in VARIANTS:
        if args.only and variant.label not in args.only:
            continue
        if variant.backend == "nixl" and info["nixl-cu13"] == "not installed":
            continue
        if variant.protocol == "nvlink_intra" and pool.device == "cpu":
            continue
        rows += run_variant(
            variant, pool, shape_list, args.repeats, args.variant_timeout, receiver_pool
        )
    table = markdown(info, torch_rows, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mooncake_gpu.md").write_text(table)
    raw = {
        "info": info,
        "torch": [asdict(t) for t in torch_rows],
        "rows": [asdict(r) for r in rows],
    }
    (args.out / "mooncake_gpu.json").write_text(json.dumps(raw, indent=1))
    print(table)


if __name__ == "__main__":
    main()
