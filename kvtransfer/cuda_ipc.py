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
)
from kvtransfer.cuda_driver import CudaDriver
from kvtransfer.cuda_ipc_kernel import WORD_DTYPES, DevicePointer, copy_rows
from kvtransfer.cuda_ipc_plan import (
    BACKEND_FLAG,
    CopyPlan,
    ExportedRegion,
    IpcEndpoint,
    boot_id,
    check_registrable,
    group_ranges,
    plan_copy,
)
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
class CudaIpcHandle(TransferHandle):
    peer_id: str
    events: list[Any] = field(default_factory=list)  # torch.cuda.Event after each kernel
    keep: list[Any] = field(default_factory=list)  # the kernels' row tables, until done
    error: str = ""


class RowUpload:
    """A write's row table to the GPU without allocating: a pinned host buffer and a device
    buffer, reused. The device buffer is safe to reuse in stream order (the engine's stream
    runs one write's kernel before the next one's upload); the host buffer once the last
    upload from it has run (its event). A table too big, or one arriving while the last
    upload is still queued, takes fresh buffers instead (`keep` holds them until the write
    is done)."""

    CAPACITY = 4096  # rows: a write of up to 4,096 ranges (8 GiB of 2 MiB pages)

    def __init__(self, device: torch.device) -> None:
        self.host = torch.empty((self.CAPACITY, 3), dtype=torch.int64).pin_memory()
        self.host_rows = self.host.numpy()
        self.device_rows = torch.empty((self.CAPACITY, 3), dtype=torch.int64, device=device)
        self.uploaded: Any = None  # the event after the last upload from `host`

    def send(self, rows: np.ndarray, stream: Any) -> tuple[torch.Tensor, list[Any]]:
        """(the rows on the device, what to keep alive until the kernel is done); queued on
        `stream`, the current stream."""
        n = len(rows)
        if n > self.CAPACITY or (self.uploaded is not None and not self.uploaded.query()):
            host = torch.from_numpy(rows).pin_memory()
            device_rows = host.to(stream.device, non_blocking=True)
            return device_rows, [host, device_rows]
        self.host_rows[:n] = rows
        device_rows = self.device_rows[:n]
        device_rows.copy_(self.host[:n], non_blocking=True)
        self.uploaded = torch.cuda.Event()
        self.uploaded.record(stream)
        return device_rows, []


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
        self._uploads: dict[int, RowUpload] = {}

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

    def write(self, peer_id: str, ranges: Sequence[TransferRange]) -> TransferHandle:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferError(
                f"cuda_ipc engine {self.config.node_name!r}: peer {peer_id!r} is not "
                "connected; call connect() with its PeerInfo first"
            )
        handle = CudaIpcHandle(peer_id)
        groups = group_ranges(ranges, self._regions, peer.endpoint, self.config.node_name)
        for (local_i, peer_i), rows in groups.items():
            local, remote = self._regions[local_i], peer.endpoint.regions[peer_i]
            if not local.on_gpu:
                try:
                    write_process_memory(peer.endpoint.pid, [tuple(r) for r in rows.tolist()])
                except ProcessMemoryError as exc:
                    self._fail(handle, f"CPU write of {len(rows)} ranges: {exc}")
                continue
            base = peer.bases[peer_i]
            offsets = rows - np.array([local.addr, remote.addr, 0], dtype=np.int64)
            self._launch(handle, plan_copy(offsets, align=(local.addr, base)), local, base)
        return handle

    def _stream(self, device: int) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _launch(
        self, handle: CudaIpcHandle, plan: CopyPlan, local: ExportedRegion, dst_base: int
    ) -> None:
        """One kernel for the whole plan, after the caller's stream, then its event."""
        device = local.device_index
        stream = self._stream(device)
        word = WORD_DTYPES[plan.word_bytes]
        try:
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # the stream's device too
                rows, keep = self._upload(device).send(plan.rows, stream)
                copy_rows(
                    DevicePointer(local.addr, word),
                    DevicePointer(dst_base, word),
                    rows,
                    plan.chunk_words,
                    plan.max_chunks,
                )
                done = torch.cuda.Event()
                done.record(stream)
        except Exception as exc:  # a launch the runtime refused: this write fails, loudly
            self._fail(handle, f"copy kernel launch: {type(exc).__name__}: {exc}")
            return
        handle.events.append(done)
        handle.keep += keep

    def _upload(self, device: int) -> RowUpload:
        if device not in self._uploads:
            self._uploads[device] = RowUpload(torch.device("cuda", device))
        return self._uploads[device]

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
        self._uploads.clear()
