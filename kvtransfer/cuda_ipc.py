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
reductions), planned into a pinned buffer reused from a few slots, uploaded by one
asynchronous driver copy on the engine's stream, and the kernel is launched through its
compiled form (kvtransfer/cuda_ipc_queue.py). `write_pages` (page ids and a page size instead of
ranges) skips the range objects too: its checks are the smallest and largest page id on each
side. A page-id write can instead be one call of the driver's batched copy
(`cuMemcpyBatchAsync`, kvtransfer/cuda_batch_copy.py: a descriptor a run of pages, no
table, no kernel), chosen by `TransferConfig.ipc_copy` (`--cuda-ipc-copy batch` or
`batch-overlap`; the kernel by default); a driver without it falls back to the kernel with
a warning (`copy_fallback` says why).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtransfer import base
from kvtransfer.cuda_batch_copy import CopyMethod, page_descriptors, parse_copy_method
from kvtransfer.cuda_driver import CudaDriver
from kvtransfer.cuda_ipc_kernel import CopyLauncher
from kvtransfer.cuda_ipc_plan import (
    BACKEND_FLAG,
    CopyPlan,
    ExportedRegion,
    IpcEndpoint,
    boot_id,
    check_registrable,
    group_ranges,
    lowest_bit,
    page_ids,
    page_regions,
    plan_columns,
    plan_pages,
)
from kvtransfer.cuda_ipc_queue import CopyQueue, RowTables, TableSlot
from kvtransfer.process_memory import (
    ProcessMemoryError,
    allow_peer_writes,
    write_process_memory,
)

logger = logging.getLogger(__name__)


@dataclass
class MappedPeer:
    endpoint_bytes: bytes
    endpoint: IpcEndpoint
    bases: dict[int, int]  # peer GPU region index -> its address mapped in this process
    opened: list[int]  # mappings to close (none for a peer in this same process)


@dataclass
class CudaIpcHandle(base.TransferHandle):
    peer_id: str
    events: list[Any] = field(default_factory=list)  # torch.cuda.Event after each kernel
    keep: list[Any] = field(default_factory=list)  # the kernels' row tables, until done
    error: str = ""
    settled: bool = False  # a poll saw every kernel done (release need not ask again)


class CudaIpcEngine(base.KVTransferEngine):
    name = "cuda_ipc"
    stream_ordered = True  # its kernel's stream waits for the caller's

    def __init__(self, config: base.TransferConfig) -> None:
        super().__init__(config)
        if not torch.cuda.is_available():
            raise base.TransferError(
                f"{BACKEND_FLAG} needs CUDA GPUs (torch {torch.__version__} sees none); use "
                "--transfer-backend nixl or mooncake on this host"
            )
        try:
            method = parse_copy_method(config.ipc_copy)
        except ValueError as exc:
            raise base.TransferError(str(exc)) from None
        self._driver = CudaDriver()
        self.copy_method, self.copy_fallback = method, ""  # what page-id writes use, and why
        if method.batched and self._driver.batch_copier is None:
            self.copy_method = CopyMethod.KERNEL
            self.copy_fallback = (
                f"--cuda-ipc-copy {method.value} asked, but {self._driver.batch_missing}: "
                "page-id writes use the copy kernel"
            )
            logger.warning("%s: %s", config.node_name, self.copy_fallback)
        self._boot_id = boot_id()
        self._regions: list[ExportedRegion] = []
        self._peers: dict[str, MappedPeer] = {}
        self._queues: dict[int, CopyQueue] = {}  # per GPU that runs copies
        self._launcher = CopyLauncher()

    def register(self, regions: Sequence[base.MemoryRegion]) -> None:
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
            raise base.TransferError(
                f"cuda_ipc engine {self.config.node_name!r}: register the GPU KV pool before "
                "connecting to peers"
            )
        return gpu[0].device_index

    def connect(self, peer: base.PeerInfo) -> None:
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
                        raise base.TransferError(
                            f"both engines are in this process, {region.device} and cuda:"
                            f"{device}: within one process the copy stays on one GPU"
                        )
                    mapped.bases[i] = region.addr
                    continue
                if region.ipc_handle not in by_handle:
                    by_handle[region.ipc_handle] = self._driver.open(region.ipc_handle, device)
                    mapped.opened.append(by_handle[region.ipc_handle])
                mapped.bases[i] = by_handle[region.ipc_handle] + region.offset
        except base.TransferError as exc:
            self._unmap(mapped)
            raise base.TransferError(
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
            except base.TransferError as exc:
                logger.warning("%s: %s", self.config.node_name, exc)
        peer.opened.clear()

    def _peer(self, peer_id: str) -> MappedPeer:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise base.TransferError(
                f"cuda_ipc engine {self.config.node_name!r}: peer {peer_id!r} is not "
                "connected; call connect() with its PeerInfo first"
            )
        return peer

    def write(self, peer_id: str, ranges: Sequence[base.TransferRange]) -> base.TransferHandle:
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
            peer_base = peer.bases[peer_i]
            columns[0] -= local.addr  # offsets into both regions (the columns are ours)
            columns[1] -= remote.addr
            slot = self._tables(local.device_index).take()
            out = None if slot is None else slot.host_rows
            plan = plan_columns(columns, align=(local.addr, peer_base), out=out)
            self._launch(handle, plan, local, peer_base, slot)
        return handle

    def write_pages(
        self,
        peer_id: str,
        src_pages: Sequence[int] | np.ndarray,
        dst_pages: Sequence[int] | np.ndarray,
        page_bytes: int,
        src_base: int,
        dst_base: int,
    ) -> base.TransferHandle:
        """Whole pages of one pool into the peer's, checked by the smallest and largest page
        id and planned straight from the ids (kvtransfer/cuda_ipc_plan.py's `plan_pages`):
        no range object, no per-range check. Anything else (pages beyond a pool, CPU
        memory) takes the range path, which refuses it naming the range."""
        if self.copy_method.batched:
            return self.write_pages_batched(
                peer_id, src_pages, dst_pages, page_bytes, (src_base, dst_base), self.copy_method
            )
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
            return self.write(
                peer_id, base.coalesce_pages(src, dst, page_bytes, src_base, dst_base)
            )
        local = self._regions[planned.local_index]
        peer_base = peer.bases[planned.peer_index]
        plan = planned.plan
        word = lowest_bit(plan.chunk_bytes | local.addr | peer_base, 8)
        if word != plan.word_bytes:  # the mapped base is less aligned than the peer's own
            plan = CopyPlan(plan.chunk_bytes, word, plan.rows, plan.longest)
        handle = CudaIpcHandle(peer_id)
        self._launch(handle, plan, local, peer_base, slot if local.device_index == device else None)
        return handle

    def write_pages_batched(
        self,
        peer_id: str,
        src_pages: Sequence[int] | np.ndarray,
        dst_pages: Sequence[int] | np.ndarray,
        page_bytes: int,
        bases: tuple[int, int],
        method: CopyMethod = CopyMethod.BATCH,
    ) -> base.TransferHandle:
        """`write_pages` by the driver's batched copy, whatever `copy_method` says (the
        benchmarks run both): checked as the kernel's page-id write is, then one descriptor
        a run of pages adjacent on both sides, queued by one driver call after the caller's
        stream."""
        peer = self._peer(peer_id)
        copier = self._driver.batch_copier
        if copier is None:
            raise base.TransferError(
                f"cuda_ipc engine {self.config.node_name!r}: no batched copy here "
                f"({self._driver.batch_missing}); use --cuda-ipc-copy kernel"
            )
        src, dst = page_ids(src_pages), page_ids(dst_pages)
        if src.ndim != 1 or src.shape != dst.shape:
            raise ValueError(f"{src.shape} source pages but {dst.shape} destination pages")
        pair = None
        if len(src) and page_bytes > 0:
            pair = page_regions(src, dst, page_bytes, bases, self._regions, peer.endpoint.regions)
        if pair is None:  # the range path refuses what is wrong, naming the range
            ranges = base.coalesce_pages(src.tolist(), dst.tolist(), page_bytes, *bases)
            return self.write(peer_id, ranges)
        local, remote = self._regions[pair[0]], peer.endpoint.regions[pair[1]]
        mapped = peer.bases[pair[1]] + (bases[1] - remote.addr)  # the peer's page 0, here
        desc = page_descriptors(src, dst, page_bytes, bases[0], mapped)
        handle = CudaIpcHandle(peer_id)
        handle.keep.append(desc)  # its arrays live until the write is done
        overlap = method is CopyMethod.BATCH_OVERLAP
        self._submit(handle, local.device_index,
                     lambda queue: queue.submit_batch(copier, desc, overlap))  # fmt: skip
        return handle

    def _copy_queue(self, device: int) -> CopyQueue:
        if device not in self._queues:
            self._queues[device] = CopyQueue(device, self._launcher, self._driver)
        return self._queues[device]

    def _tables(self, device: int) -> RowTables:
        return self._copy_queue(device).tables

    def _launch(
        self,
        handle: CudaIpcHandle,
        plan: CopyPlan,
        local: ExportedRegion,
        dst_base: int,
        slot: TableSlot | None,
    ) -> None:
        """One kernel for the whole plan on the copy queue of the local pool's GPU, after
        the caller's stream; its event completes the write. `slot`: the table slot the rows
        were planned into, if any."""
        if not plan.num_rows:
            return
        src, keep = local.addr, handle.keep
        self._submit(handle, local.device_index,
                     lambda queue: queue.submit(plan, src, dst_base, slot, keep))  # fmt: skip

    def _submit(
        self, handle: CudaIpcHandle, device: int, submit: Callable[[CopyQueue], Any]
    ) -> None:
        """`submit` on `device`'s copy queue with that device current (Triton launches and
        the driver copies there); the event it returns completes the write."""
        queue = self._copy_queue(device)
        try:
            if torch.cuda.current_device() != device:
                with torch.cuda.device(device):
                    done = submit(queue)
            else:
                done = submit(queue)
        except Exception as exc:  # a copy the runtime refused: this write fails, loudly
            self._fail(handle, f"copy on cuda:{device}: {type(exc).__name__}: {exc}")
            return
        handle.events.append(done)

    def _fail(self, handle: CudaIpcHandle, reason: str) -> None:
        if not handle.error:
            handle.error = f"write to peer {handle.peer_id!r} failed: {reason}"
            logger.warning("%s: %s", self.config.node_name, handle.error)

    def poll(self, handle: base.TransferHandle) -> base.TransferState:
        assert isinstance(handle, CudaIpcHandle)
        for event in [] if handle.settled else handle.events:
            try:
                if not event.query():
                    return base.TransferState.PENDING
            except RuntimeError as exc:  # the kernel faulted (e.g. the peer's memory is gone)
                self._fail(handle, f"copy kernel: {exc}")
        handle.settled = True
        return base.TransferState.FAILED if handle.error else base.TransferState.DONE

    def release(self, handle: base.TransferHandle) -> None:
        assert isinstance(handle, CudaIpcHandle)
        if self.poll(handle) is base.TransferState.PENDING:  # no event query once polled settled
            raise base.TransferError(
                f"cuda_ipc engine {self.config.node_name!r}: cannot release a write that is "
                "still in flight; poll until DONE or FAILED"
            )
        handle.events.clear()
        handle.keep.clear()

    def synchronize(self) -> None:
        """Wait for every copy this engine queued."""
        for queue in self._queues.values():
            queue.stream.synchronize()

    def close(self) -> None:
        if self._regions:
            for peer in self._peers.values():
                self._unmap(peer)
        self._peers.clear()
        self._regions.clear()
        self._queues.clear()
