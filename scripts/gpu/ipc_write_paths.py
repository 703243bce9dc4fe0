"""A `cuda_ipc` write three ways, step by step, for the GPU benchmarks (imported, not run).

- `before`: the write as it was when benchmarks/gpu-2026-11-26-cuda-ipc-h200.md measured it
  (0.17 ms of host time a 256-page write on an H200 host): the ranges read into rows with one
  tuple a range, their bounds reduced down the columns, `plan_copy`'s eight numpy calls, the
  engine's stream waiting on the caller's (`wait_stream`), a stream switch, the table copied
  into one pinned buffer and uploaded there, and Triton's JIT entry. Kept here, frozen, only
  so that one GPU call can time it beside the engine of today.
- `ranges`: the engine's `write` (kvtransfer/cuda_ipc.py) of the same ranges.
- `pages`: the engine's `write_pages`: page ids and a page size, no range objects.
- `batch`, `batch-overlap`: the engine's `write_pages_batched` (`--cuda-ipc-copy batch`):
  the same page ids as one `cuMemcpyBatchAsync` call (kvtransfer/cuda_batch_copy.py), without
  and with the hint to overlap with compute.

Each path is a function `(engine, job, ranges, marks) -> handle` (`ranges`: the job's,
built beforehand as a node builds them before it writes; the page path ignores them);
`marks`, when a list, receives (step, time.perf_counter()) after each host step. The
`ranges` and `pages` functions repeat the engine's own calls in order (its `write` and
`write_pages`, inlined with marks); the rows that time a whole write call the engine itself
(`engine_call`).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from kvtransfer.base import TransferRange, TransferState, coalesce_pages
from kvtransfer.cuda_batch_copy import CopyMethod, page_descriptors
from kvtransfer.cuda_ipc import CudaIpcEngine, CudaIpcHandle
from kvtransfer.cuda_ipc_kernel import WORD_DTYPES, DevicePointer, copy_rows
from kvtransfer.cuda_ipc_plan import (
    MAX_CHUNK_BYTES,
    MAX_PIECE_BYTES,
    CopyPlan,
    ExportedRegion,
    chunk_size,
    group_ranges,
    page_ids,
    page_regions,
    plan_columns,
    plan_pages,
    split_rows,
)

PATHS = ("before", "ranges", "pages", "batch", "batch-overlap")
BATCH_PATHS = {"batch": CopyMethod.BATCH, "batch-overlap": CopyMethod.BATCH_OVERLAP}
_RANGE_FIELDS = attrgetter("src_addr", "dst_addr", "length")


@dataclass(frozen=True)
class PageJob:
    """One write: pages of the sender's pool into the receiver's."""

    peer_id: str
    src_pages: list[int]
    dst_pages: list[int]
    page_bytes: int
    src_base: int
    dst_base: int

    def ranges(self) -> list[TransferRange]:
        return coalesce_pages(
            self.src_pages, self.dst_pages, self.page_bytes, self.src_base, self.dst_base
        )


class _Marks:
    def __init__(self, marks: list[tuple[str, float]] | None) -> None:
        self.marks = marks

    def __call__(self, step: str) -> None:
        if self.marks is not None:
            self.marks.append((step, time.perf_counter()))


# --- before: frozen copy of the engine's write of 2026-11-26 (one GPU pool into another) ---


class _BeforeUpload:
    """The RowUpload of then: one pinned and one device buffer, on the engine's stream."""

    def __init__(self, device: torch.device) -> None:
        self.host = torch.empty((4096, 3), dtype=torch.int64).pin_memory()
        self.host_rows = self.host.numpy()
        self.device_rows = torch.empty((4096, 3), dtype=torch.int64, device=device)
        self.uploaded: Any = None

    def send(self, rows: np.ndarray, stream: Any) -> tuple[torch.Tensor, list[Any]]:
        n = len(rows)
        if n > 4096 or (self.uploaded is not None and not self.uploaded.query()):
            host = torch.from_numpy(rows).pin_memory()
            device_rows = host.to(stream.device, non_blocking=True)
            return device_rows, [host, device_rows]
        self.host_rows[:n] = rows
        device_rows = self.device_rows[:n]
        device_rows.copy_(self.host[:n], non_blocking=True)
        self.uploaded = torch.cuda.Event()
        self.uploaded.record(stream)
        return device_rows, []


_BEFORE_UPLOADS: dict[int, _BeforeUpload] = {}


def _before_plan(ranges: Any, align: tuple[int, int]) -> CopyPlan:
    rows = np.asarray(ranges, dtype=np.int64).reshape(-1, 3)
    if (rows[:, 2] <= 0).any() or (rows[:, :2] < 0).any():
        raise ValueError("ranges need non-negative offsets and positive lengths")
    chunk = chunk_size(rows.ravel(), MAX_CHUNK_BYTES)
    word = chunk_size([chunk, *align], max_chunk=8)
    piece = max(MAX_PIECE_BYTES - MAX_PIECE_BYTES % chunk, chunk)
    if len(rows) and rows[:, 2].max() > piece:
        rows = split_rows(rows, piece)
    return CopyPlan(chunk, word, rows // chunk)


def before_plan(
    ranges: list[TransferRange],
    local: Sequence[ExportedRegion],
    peer: Sequence[ExportedRegion],
    mapped: dict[int, int],
    mark: Any = None,
) -> tuple[ExportedRegion, int, CopyPlan]:
    """The CPU part of then (one GPU pool into another): (local region, mapped peer base,
    plan). `mapped`: peer region index -> its address in this process."""
    mark = mark or _Marks(None)
    fields = map(_RANGE_FIELDS, ranges)
    rows = np.fromiter(chain.from_iterable(fields), np.int64, 3 * len(ranges)).reshape(-1, 3)
    src_lo, dst_lo = int(rows[:, 0].min()), int(rows[:, 1].min())
    src_hi, dst_hi = int((rows[:, 0] + rows[:, 2]).max()), int((rows[:, 1] + rows[:, 2]).max())
    [local_region] = [r for r in local if r.contains(src_lo, src_hi - src_lo)]
    [(pi, remote)] = [(i, r) for i, r in enumerate(peer) if r.contains(dst_lo, dst_hi - dst_lo)]
    if (rows[:, 2] <= 0).any() or not (local_region.on_gpu and remote.on_gpu):
        raise RuntimeError("the `before` path here covers one GPU pool into another only")
    mark("group_ranges")
    base = mapped[pi]
    offsets = rows - np.array([local_region.addr, remote.addr, 0])
    plan = _before_plan(offsets, (local_region.addr, base))
    mark("plan_copy")
    return local_region, base, plan


def before_write(
    engine: CudaIpcEngine, job: PageJob, ranges: list[TransferRange], marks: Any = None
) -> CudaIpcHandle:
    mark = _Marks(marks)
    mark("start")
    peer = engine._peers[job.peer_id]
    regions, peer_regions = engine._regions, peer.endpoint.regions
    local, base, plan = before_plan(ranges, regions, peer_regions, peer.bases, mark)
    device = local.device_index
    stream = engine._copy_queue(device).stream
    stream.wait_stream(torch.cuda.current_stream(device))
    mark("wait_stream")
    handle = CudaIpcHandle(job.peer_id)
    with torch.cuda.stream(stream):
        if device not in _BEFORE_UPLOADS:
            _BEFORE_UPLOADS[device] = _BeforeUpload(torch.device("cuda", device))
        table, keep = _BEFORE_UPLOADS[device].send(plan.rows, stream)
        mark("stream switch + row upload")
        word = WORD_DTYPES[plan.word_bytes]
        copy_rows(DevicePointer(local.addr, word), DevicePointer(base, word), table,
                  plan.chunk_words, plan.max_chunks)  # fmt: skip
        mark("launch (Triton JIT entry)")
        done = torch.cuda.Event()
        done.record(stream)
        mark("event")
    handle.events.append(done)
    handle.keep += keep
    return handle


# --- today: the engine's write and write_pages, inlined with marks -------------------------


def ranges_write(
    engine: CudaIpcEngine, job: PageJob, ranges: list[TransferRange], marks: Any = None
) -> CudaIpcHandle:
    mark = _Marks(marks)
    mark("start")
    peer = engine._peer(job.peer_id)
    groups = group_ranges(ranges, engine._regions, peer.endpoint, engine.config.node_name)
    [((li, pi), columns)] = groups.items()
    mark("columns + bounds")
    local, remote = engine._regions[li], peer.endpoint.regions[pi]
    base = peer.bases[pi]
    columns[0] -= local.addr
    columns[1] -= remote.addr
    slot = engine._tables(local.device_index).take()
    plan = plan_columns(columns, (local.addr, base), out=None if slot is None else slot.host_rows)
    mark("plan into a pinned slot")
    return _queue(engine, job.peer_id, plan, (local.addr, base), local.device_index, slot, mark)


def pages_write(
    engine: CudaIpcEngine, job: PageJob, ranges: list[TransferRange], marks: Any = None
) -> CudaIpcHandle:
    mark = _Marks(marks)
    mark("start")
    peer = engine._peer(job.peer_id)
    device = engine._kernel_device()
    slot = engine._tables(device).take()
    planned = plan_pages(job.src_pages, job.dst_pages, job.page_bytes,
                         (job.src_base, job.dst_base), engine._regions, peer.endpoint.regions,
                         out=None if slot is None else slot.host_rows)  # fmt: skip
    if planned is None:
        raise RuntimeError("the pages of this job are not one GPU pool into another")
    local = engine._regions[planned.local_index]
    base = peer.bases[planned.peer_index]
    word = chunk_size([planned.plan.chunk_bytes, local.addr, base], max_chunk=8)
    plan = CopyPlan(planned.plan.chunk_bytes, word, planned.plan.rows, planned.plan.longest)
    mark("page ids: bounds + rows into a pinned slot")
    return _queue(engine, job.peer_id, plan, (local.addr, base), device, slot, mark)


def _queue(engine: CudaIpcEngine, peer_id: str, plan: CopyPlan, bases: tuple[int, int],
           device: int, slot: Any, mark: _Marks) -> CudaIpcHandle:  # fmt: skip
    handle = CudaIpcHandle(peer_id)
    src, dst = bases
    if torch.cuda.current_device() != device:
        raise RuntimeError(f"run the benchmark with cuda:{device} current")
    queue = engine._copy_queue(device)
    queue.after_caller()
    mark("stream wait (reused event)")
    table = queue.upload(plan, slot, handle.keep)
    mark("upload (one driver copy)")
    handle.events.append(queue.kernel(plan, (src, dst, table), slot))
    mark("launch (compiled kernel) + event")
    return handle


def batch_write(
    engine: CudaIpcEngine,
    job: PageJob,
    ranges: list[TransferRange],
    marks: Any = None,
    overlap: bool = False,
) -> CudaIpcHandle:
    """The engine's `write_pages_batched`, inlined with marks."""
    mark = _Marks(marks)
    mark("start")
    peer = engine._peer(job.peer_id)
    copier = engine._driver.batch_copier
    if copier is None:
        raise RuntimeError(f"no cuMemcpyBatchAsync here: {engine._driver.batch_missing}")
    src, dst = page_ids(job.src_pages), page_ids(job.dst_pages)
    bases = (job.src_base, job.dst_base)
    pair = page_regions(src, dst, job.page_bytes, bases, engine._regions, peer.endpoint.regions)
    if pair is None:
        raise RuntimeError("the pages of this job are not one GPU pool into another")
    local, remote = engine._regions[pair[0]], peer.endpoint.regions[pair[1]]
    mapped = peer.bases[pair[1]] + (job.dst_base - remote.addr)
    desc = page_descriptors(src, dst, job.page_bytes, job.src_base, mapped)
    mark("page ids: bounds + descriptors")
    handle = CudaIpcHandle(job.peer_id)
    handle.keep.append(desc)
    if torch.cuda.current_device() != local.device_index:
        raise RuntimeError(f"run the benchmark with cuda:{local.device_index} current")
    queue = engine._copy_queue(local.device_index)
    queue.after_caller()
    mark("stream wait (reused event)")
    copier.copy(desc, queue.stream.cuda_stream, overlap)
    mark("batched copy (one driver call)")
    done = torch.cuda.Event()
    done.record(queue.stream)
    handle.events.append(done)
    mark("event")
    return handle


PATH_FUNCTIONS: dict[str, Callable[..., CudaIpcHandle]] = {
    "before": before_write,
    "ranges": ranges_write,
    "pages": pages_write,
    "batch": batch_write,
    "batch-overlap": functools.partial(batch_write, overlap=True),
}


def descriptors(path: str, job: PageJob) -> int:
    """Descriptors (kernel rows, or batched copies) the path's write of `job` takes."""
    if path in BATCH_PATHS:
        return page_descriptors(page_ids(job.src_pages), page_ids(job.dst_pages),
                                job.page_bytes, 0, 0).count  # fmt: skip
    return len(job.src_pages) if path == "pages" else len(job.ranges())


def engine_call(engine: CudaIpcEngine, path: str, job: PageJob, ranges: list[TransferRange]) -> Any:
    """One write through the engine itself (`before`: the frozen copy above)."""
    if path == "ranges":
        return engine.write(job.peer_id, ranges)
    if path == "pages":
        return engine.write_pages(job.peer_id, job.src_pages, job.dst_pages, job.page_bytes,
                                  job.src_base, job.dst_base)  # fmt: skip
    if path in BATCH_PATHS:
        return engine.write_pages_batched(job.peer_id, job.src_pages, job.dst_pages,
                                          job.page_bytes, (job.src_base, job.dst_base),
                                          BATCH_PATHS[path])  # fmt: skip
    return before_write(engine, job, ranges)


def wait(engine: CudaIpcEngine, handle: Any) -> None:
    while (state := engine.poll(handle)) is TransferState.PENDING:
        pass
    engine.release(handle)
    if state is not TransferState.DONE:
        raise RuntimeError(f"a cuda_ipc write ended {state.value}")


def timed_write(engine: CudaIpcEngine, path: str, job: PageJob) -> float:
    """ms from the write call (its ranges built before) to its DONE."""
    ranges = job.ranges()
    start = time.perf_counter()
    wait(engine, engine_call(engine, path, job, ranges))
    return (time.perf_counter() - start) * 1e3


def host_split(engine: CudaIpcEngine, path: str, job: PageJob, writes: int) -> dict[str, float]:
    """Median ms of each host step of `path` over `writes` writes (5 more first, dropped), the
    host total before the GPU runs on its own, and the wait until DONE."""
    steps = host_steps(engine, path, job, writes)
    return {name: statistics.median(v) for name, v in steps.items()}


def host_steps(
    engine: CudaIpcEngine, path: str, job: PageJob, writes: int
) -> dict[str, list[float]]:
    """`host_split`'s figures per write: ms of each step of each of the `writes` writes."""
    steps: dict[str, list[float]] = {}
    ranges = job.ranges()
    for i in range(writes + 5):
        torch.cuda.synchronize()
        marks: list[tuple[str, float]] = []
        handle = PATH_FUNCTIONS[path](engine, job, ranges, marks)
        host_end = time.perf_counter()
        wait(engine, handle)
        marks.append(("wait until DONE", time.perf_counter()))
        if i < 5:
            continue
        for (_, a), (name, b) in pairwise(marks):
            steps.setdefault(name, []).append((b - a) * 1e3)
        steps.setdefault("host total", []).append((host_end - marks[0][1]) * 1e3)
    return steps
