"""CUDA IPC backend (`cuda_ipc`): one kernel writes a room's pages straight into the peer's pool.

For two nodes on one host. The receiver exports a CUDA IPC handle of the allocation holding its
KV pool with its endpoint (`local_endpoint`, published through bootstrap like every backend's);
the sender maps that allocation into its own GPU's context on `connect` (lazy peer access, so
GPU0 -> GPU1 works where the two GPUs can reach each other). A `write` then plans its ranges as
rows of equal chunks (kvtransfer/cuda_ipc_plan.py) and copies them all with ONE kernel launch
(kvtransfer/cuda_ipc_kernel.py) on a stream of the engine's own, which first waits for the
caller's current stream (the prefill that wrote the pages). An event recorded after the kernel
is the write's completion: `poll` answers DONE once it has passed, and the node then reports
the room DONE through bootstrap as with the other backends. Each byte crosses once: no staging,
no per-descriptor launch.

Host time is the cost that is left once the kernel runs at the copy's speed, so a write does
little in Python: its ranges are checked by their bounds (one pool into the other, a few numpy
reductions), planned into a pinned buffer reused from a few slots (`RowTables`), uploaded by
one asynchronous copy on the caller's stream, and the kernel is launched through its compiled
form (`CopyLauncher`). `write_pages` (page ids and a page size instead of ranges) skips the
range objects too: its checks are the smallest and largest page id on each side.

Ranges in CPU memory on both sides (the aux slots with the first token, kvtransfer/aux.py) are
copied by `process_vm_writev` into the peer's pid at `write` (a few hundred bytes; the receiver
allows it under Yama's ptrace_scope 1, kvtransfer/process_memory.py). A KV pool in
CPU memory, a peer on another host (another boot id) or a peer on another backend is refused
with an error naming `--transfer-backend`. Any range layout works, so heterogeneous TP head
routes (one range per page and run of heads) move as they do on NIXL and Mooncake.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtransfer.base import (
    KVTransferEngine,
    MemoryRegion,
    PeerInfo,
    TransferConfig,
    TransferError,
    TransferHandle,
    TransferRange,
    TransferState,
    coalesce_pages,
)
from kvtransfer.cuda_driver import CudaDriver
from kvtransfer.cuda_ipc_kernel import MAX_GRID_ROWS, WORD_DTYPES, CopyLauncher
from kvtransfer.cuda_ipc_plan import (
    BACKEND_FLAG,
    CopyPlan,
    ExportedRegion,
    IpcEndpoint,
    boot_id,
    check_registrable,
    group_ranges,
    lowest_bit,
    plan_columns,
    plan_pages,
)
from kvtransfer.process_memory import (
    ProcessMemoryError,
    allow_peer_writes,
    write_process_memory,
)

logger = logging.getLogger(__name__)
ROW_BYTES = 3 * 8  # one row of the kernel's table: three int64


@dataclass
class MappedPeer:
    endpoint_bytes: bytes
    endpoint: IpcEndpoint
    bases: dict[int, int]  # peer GPU region index -> its address mapped in this process
    opened: list[int]  # mappings to close (none for a peer in this same process)


@dataclass
class CudaIpcHandle(TransferHandle):
    peer_id: str
    events: list[Any] = field(default_factory=list)  # torch.cuda.Event after each kernel
    keep: list[Any] = field(default_factory=list)  # the kernels' row tables, until done
    error: str = ""


@dataclass
class TableSlot:
    """A pinned host buffer and a device buffer for one kernel's row table, and the event
    after the last kernel that read it (its upload ran before that kernel)."""

    host: torch.Tensor  # pinned int64 [CAPACITY, 3]
    host_rows: np.ndarray  # the same memory, for numpy to plan into
    device: torch.Tensor  # int64 [CAPACITY, 3] on the GPU
    done: Any = None  # torch.cuda.Event
    views: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (n, host[:n], device[:n])

    def free(self) -> bool:
        return self.done is None or bool(self.done.query())

    def first(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(host[:n], device[:n]), kept for the next write of as many rows (slicing a
        tensor costs more host time than the rest of the upload)."""
        if self.views is None or self.views[0] != n:
            self.views = (n, self.host[:n], self.device[:n])
        return self.views[1], self.views[2]


class RowTables:
    """Row tables to the GPU without allocating: `SLOTS` pairs of pinned host and device
    buffers, taken in turn. A slot is reused only once the event after its last kernel has
    passed, so neither the host buffer (read by the upload) nor the device one (read by the
    kernel) can change under a write in flight; with every slot busy, or a table over
    `CAPACITY` rows, a write takes fresh buffers (the handle keeps them until done)."""

    SLOTS = 4
    CAPACITY = 4096  # rows: a write of up to 4,096 ranges (8 GiB of 2 MiB pages)

    def __init__(self, device: torch.device) -> None:
        self.slots: list[TableSlot] = []
        for _ in range(self.SLOTS):
            host = torch.empty((self.CAPACITY, 3), dtype=torch.int64).pin_memory()
            device_rows = torch.empty((self.CAPACITY, 3), dtype=torch.int64, device=device)
            self.slots.append(TableSlot(host, host.numpy(), device_rows))
        self._next = 0

    def take(self) -> TableSlot | None:
        """A free slot (round robin), or None."""
        count = len(self.slots)
        for i in range(count):
            slot = self.slots[(self._next + i) % count]
            if slot.free():
                self._next = (self._next + i + 1) % count
                return slot
        return None


class CudaIpcEngine(KVTransferEngine):
    name = "cuda_ipc"

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        if not torch.cuda.is_available():
            raise TransferError(
                f"{BACKEND_FLAG} needs CUDA GPUs (torch {torch.__version__} sees none); use "
                "--transfer-backend nixl or mooncake on this host"
            )
        self._driver = CudaDriver()
        self._boot_id = boot_id()
        self._regions: list[ExportedRegion] = []
        self._peers: dict[str, MappedPeer] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._row_tables: dict[int, RowTables] = {}
        self._ready: dict[int, Any] = {}  # per device: an event on the caller's stream
        self._launcher = CopyLauncher()

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        for region in regions:
            check_registrable(region)
            exported = ExportedRegion(region.name, region.addr, region.length, region.device)
            if exported.on_gpu:
                handle, offset = self._driver.export(region.addr, exported.device_index)
                exported = ExportedRegion(
                    region.name, region.addr, region.length, region.device, handle, offset
                )
            else:  # the peer writes our aux slots with process_vm_writev
                allow_peer_writes()
            self._regions.append(exported)

    def local_endpoint(self) -> bytes:
        return IpcEndpoint(
            self.config.node_name, self._boot_id, os.getpid(), tuple(self._regions)
        ).to_bytes()

    def _kernel_device(self) -> int:
        """The GPU that runs this engine's copies: the one holding its KV pool."""
        gpu = [r for r in self._regions if r.on_gpu]
        if not gpu:
            raise TransferError(
                f"cuda_ipc engine {self.config.node_name!r}: register the GPU KV pool before "
                "connecting to peers"
            )
        return gpu[0].device_index

    def connect(self, peer: PeerInfo) -> None:
        known = self._peers.get(peer.node_id)
        if known is not None and known.endpoint_bytes == peer.endpoint:
            return
        endpoint = IpcEndpoint.from_bytes(peer.endpoint, peer.node_id)
        endpoint.check_same_host(peer.node_id, self._boot_id)
        if known is not None:  # the peer restarted: its old pool is gone
            self._unmap(known)
            del self._peers[peer.node_id]
        device = self._kernel_device()
        mapped = MappedPeer(peer.endpoint, endpoint, {}, [])
        by_handle: dict[bytes, int] = {}  # regions of one allocation share one mapping
        try:
            for i, region in enumerate(endpoint.regions):
                if not region.on_gpu:
                    continue
                if endpoint.pid == os.getpid():  # both engines in one process (tests, benches)
                    if region.device_index != device:
                        raise TransferError(
                            f"both engines are in this process, {region.device} and cuda:"
                            f"{device}: within one process the copy stays on one GPU"
                        )
                    mapped.bases[i] = region.addr
                    continue
                if region.ipc_handle not in by_handle:
                    by_handle[region.ipc_handle] = self._driver.open(region.ipc_handle, device)
                    mapped.opened.append(by_handle[region.ipc_handle])
                mapped.bases[i] = by_handle[region.ipc_handle] + region.offset
        except TransferError as exc:
            self._unmap(mapped)
            raise TransferError(
                f"cuda_ipc engine {self.config.node_name!r} could not map the memory of peer "
                f"{peer.node_id!r} (its {endpoint.regions[0].device} into cuda:{device}): {exc}"
            ) from exc
        self._peers[peer.node_id] = mapped

    def _unmap(self, peer: MappedPeer) -> None:
        self.synchronize()  # no kernel of ours may still write through the mapping
        device = self._kernel_device()
        for addr in peer.opened:
            try:
                self._driver.close(addr, device)
            except TransferError as exc:
                logger.warning("%s: %s", self.config.node_name, exc)
        peer.opened.clear()

    def _peer(self, peer_id: str) -> MappedPeer:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferError(
                f"cuda_ipc engine {self.config.node_name!r}: peer {peer_id!r} is not "
                "connected; call connect() with its PeerInfo first"
            )
        return peer

    def write(self, peer_id: str, ranges: Sequence[TransferRange]) -> TransferHandle:
        peer = self._peer(peer_id)
        handle = CudaIpcHandle(peer_id)
        groups = group_ranges(ranges, self._regions, peer.endpoint, self.config.node_name)
        for (local_i, peer_i), columns in groups.items():
            local, remote = self._regions[local_i], peer.endpoint.regions[peer_i]
            if not local.on_gpu:
                rows = [tuple(r) for r in columns.T.tolist()]
                try:
                    write_process_memory(peer.endpoint.pid, rows)
                except ProcessMemoryError as exc:
                    self._fail(handle, f"CPU write of {len(rows)} ranges: {exc}")
                continue
            base = peer.bases[peer_i]
            columns[0] -= local.addr  # offsets into both regions (the columns are ours)
            columns[1] -= remote.addr
            slot = self._tables(local.device_index).take()
            out = None if slot is None else slot.host_rows
            plan = plan_columns(columns, align=(local.addr, base), out=out)
            self._launch(handle, plan, local, base, slot)
        return handle

    def write_pages(
        self,
        peer_id: str,
        src_pages: Sequence[int] | np.ndarray,
        dst_pages: Sequence[int] | np.ndarray,
        page_bytes: int,
        src_base: int,
        dst_base: int,
    ) -> TransferHandle:
        """Whole pages of one pool into the peer's, checked by the smallest and largest page
        id and planned straight from the ids (kvtransfer/cuda_ipc_plan.py's `plan_pages`):
        no range object, no per-range check. Anything else (pages beyond a pool, CPU
        memory) takes the range path, which refuses it naming the range."""
        peer = self._peer(peer_id)
        device = self._kernel_device()
        slot = self._tables(device).take()
        planned = plan_pages(
            src_pages,
            dst_pages,
            page_bytes,
            (src_base, dst_base),
            self._regions,
            peer.endpoint.regions,
            out=None if slot is None else slot.host_rows,
        )
        if planned is None:
            src, dst = np.asarray(src_pages).tolist(), np.asarray(dst_pages).tolist()
            return self.write(peer_id, coalesce_pages(src, dst, page_bytes, src_base, dst_base))
        local = self._regions[planned.local_index]
        base = peer.bases[planned.peer_index]
        plan = planned.plan
        word = lowest_bit(plan.chunk_bytes | local.addr | base, 8)
        if word != plan.word_bytes:  # the mapped base is less aligned than the peer's own
            plan = CopyPlan(plan.chunk_bytes, word, plan.rows)
        handle = CudaIpcHandle(peer_id)
        self._launch(handle, plan, local, base, slot if local.device_index == device else None)
        return handle

    def _stream(self, device: int) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _tables(self, device: int) -> RowTables:
        if device not in self._row_tables:
            self._row_tables[device] = RowTables(torch.device("cuda", device))
        return self._row_tables[device]

    def _launch(
        self,
        handle: CudaIpcHandle,
        plan: CopyPlan,
        local: ExportedRegion,
        dst_base: int,
        slot: TableSlot | None,
    ) -> None:
        """Upload the plan's rows on the caller's stream (after the work that wrote the
        pages), let the engine's stream wait for it, and queue one kernel there, then its
        event. `slot`: the table slot the rows were planned into, if any."""
        if not plan.num_rows:
            return
        device = local.device_index
        try:
            if torch.cuda.current_device() != device:  # Triton launches on the current one
                with torch.cuda.device(device):
                    self._queue(handle, plan, local.addr, dst_base, device, slot)
            else:
                self._queue(handle, plan, local.addr, dst_base, device, slot)
        except Exception as exc:  # a launch the runtime refused: this write fails, loudly
            self._fail(handle, f"copy kernel launch: {type(exc).__name__}: {exc}")

    def _queue(
        self,
        handle: CudaIpcHandle,
        plan: CopyPlan,
        src_base: int,
        dst_base: int,
        device: int,
        slot: TableSlot | None,
    ) -> None:
        rows = self._upload(handle, plan, device, slot)
        stream = self._after_caller(device)
        self._kernel(handle, plan, (src_base, dst_base, rows.data_ptr()), device, stream, slot)

    def _upload(
        self, handle: CudaIpcHandle, plan: CopyPlan, device: int, slot: TableSlot | None
    ) -> torch.Tensor:
        """The plan's rows on the device, copied on the caller's stream (queued after the
        work that wrote the pages, which the kernel waits for anyway)."""
        n = plan.num_rows
        if slot is not None and n <= len(slot.host_rows):  # the plan went into the slot
            host, rows = slot.first(n)
        else:  # no free slot, or a table too big: fresh buffers, kept until done
            host = torch.from_numpy(np.ascontiguousarray(plan.rows)).pin_memory()
            rows = torch.empty_like(host, device=torch.device("cuda", device))
            handle.keep += [host, rows]
        rows.copy_(host, non_blocking=True)
        return rows

    def _after_caller(self, device: int) -> torch.cuda.Stream:
        """The engine's stream of `device`, made to wait for the caller's current stream
        (the pages' writes and the table's upload) through one reused event: a wait holds
        the record made before it."""
        ready = self._ready.get(device)
        if ready is None:
            ready = self._ready[device] = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        stream = self._stream(device)
        stream.wait_event(ready)
        return stream

    def _kernel(
        self,
        handle: CudaIpcHandle,
        plan: CopyPlan,
        addrs: tuple[int, int, int],
        device: int,
        stream: torch.cuda.Stream,
        slot: TableSlot | None,
    ) -> None:
        """The copy on the engine's stream (one launch per `MAX_GRID_ROWS` rows), then the
        event that completes the write and frees the table's slot."""
        src, dst, table = addrs
        word = WORD_DTYPES[plan.word_bytes]
        n = plan.num_rows
        for first in range(0, n, MAX_GRID_ROWS):
            grid = (plan.max_chunks, min(MAX_GRID_ROWS, n - first))
            part = (src, dst, table + first * ROW_BYTES)
            self._launcher.launch(stream.cuda_stream, device, word, part, plan.chunk_words, grid)
        done = torch.cuda.Event()
        done.record(stream)
        handle.events.append(done)
        if slot is not None:
            slot.done = done

    def _fail(self, handle: CudaIpcHandle, reason: str) -> None:
        if not handle.error:
            handle.error = f"write to peer {handle.peer_id!r} failed: {reason}"
            logger.warning("%s: %s", self.config.node_name, handle.error)

    def poll(self, handle: TransferHandle) -> TransferState:
        assert isinstance(handle, CudaIpcHandle)
        for event in handle.events:
            try:
                if not event.query():
                    return TransferState.PENDING
            except RuntimeError as exc:  # the kernel faulted (e.g. the peer's memory is gone)
                self._fail(handle, f"copy kernel: {exc}")
        return TransferState.FAILED if handle.error else TransferState.DONE

    def release(self, handle: TransferHandle) -> None:
        assert isinstance(handle, CudaIpcHandle)
        if self.poll(handle) is TransferState.PENDING:
            raise TransferError(
                f"cuda_ipc engine {self.config.node_name!r}: cannot release a write that is "
                "still in flight; poll until DONE or FAILED"
            )
        handle.events.clear()
        handle.keep.clear()

    def synchronize(self) -> None:
        """Wait for every copy this engine queued."""
        for stream in self._streams.values():
            stream.synchronize()

    def close(self) -> None:
        if self._regions:
            for peer in self._peers.values():
                self._unmap(peer)
        self._peers.clear()
        self._regions.clear()
        self._streams.clear()
        self._row_tables.clear()
        self._ready.clear()
