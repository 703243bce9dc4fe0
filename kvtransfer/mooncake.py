"""Mooncake Transfer Engine backend (`mooncake-transfer-engine*`): P2P handshake, no metadata.

Facts of the 0.3.13 Python binding that shape this file (checked on loopback TCP):
- `batch_transfer_async_write` returns a batch id, or 0 when the batch could not be submitted
  (peer unreachable, bad arguments; older bindings returned -1, i.e. 2**64 - 1). The
  connection to a peer opens on the first write, so `connect` only remembers its session.
- `get_batch_transfer_status(ids)` is *blocking*: it spins until every batch completed (0) or
  one failed or timed out (-1; timeout = MC_TRANSFER_TIMEOUT, default 30 s, plus 1 ns per byte),
  and frees the batch ids either way, so it may be called once per id. There is no
  non-blocking status for a whole batch, so one waiter thread per engine makes that call and
  `poll` reads its future. The spin costs a core: on a 2-core host it halved loopback
  throughput, so the waiter runs at the lowest priority and gets only otherwise idle CPU.
- The TCP transport caps queued transfers per peer (1024 queued + 1024 pending admissions by
  default); descriptors over that fail the batch with a "queue-full" error, and the cap counts
  every batch in flight to the peer, so splitting batches alone does not avoid it. The
  constructor raises both caps to the library maximum unless the operator has set them.
- `initialize` returns 0 for protocol "rdma" even when no RDMA device matches: the engine then
  runs over TCP. The constructor refuses that instead.

KV pools in GPU memory (the CUDA builds `mooncake-transfer-engine` / `-cuda13`; 0.3.14 checked
on one H200, two processes on the GPU, benchmarks/gpu-2026-11-23-mooncake-h200.md):
- The binding's `protocol` argument only picks the allocator of its managed buffers; the
  transport comes from the environment at `initialize`: `MC_INTRANODE_NVLINK` installs
  "nvlink_intra" (CUDA IPC handles of registered `cudaMalloc` memory, copies by the GPU),
  `MC_FORCE_TCP` (or no RDMA device and no setting) the TCP transport, which stages GPU memory
  through host buffers (~2 GB/s). Protocol "nvlink_intra" here sets the first for the duration
  of `initialize` only. The wheel has no "nvlink" (multi-node NVLink) transport.
- A copy between two processes on one GPU takes 0.1-1.4 ms, but the waiter thread's answer
  reached a caller polling in a loop ~10 ms after the write: the waiter needs the GIL twice (to
  start the status call, to return from it) and a thread that keeps the GIL hands it over only
  every switch interval (5 ms). With "nvlink_intra" a `poll` that finds the write pending
  therefore releases the GIL once (`time.sleep(0)`) before answering. (Asking the batches from
  `poll` with the binding's non-blocking `transfer_check_status` and then freeing them with the
  status call crashed the process: SIGSEGV.) A thread busy elsewhere (a model step) still
  delays the answer by up to the switch interval. TCP and RDMA polls are unchanged.
- "nvlink_intra" registers device memory only (CPU memory: rc -1, "Unsupported memory type"),
  so a node's CPU aux slots cannot share its engine. Checked between two processes on one GPU;
  between GPUs it relies on CUDA peer access (not run yet). The CPU build knows no such
  transport and would silently use TCP, so the constructor refuses it there.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtransfer import base

if TYPE_CHECKING:
    from mooncake.engine import TransferEngine

logger = logging.getLogger(__name__)

# Library settings applied where the environment says nothing; this constructor is the one
# place the library is configured. The log level is read when `mooncake.engine` is imported, so
# the import waits for the constructor. 65535 is the largest cap the TCP transport accepts.
MOONCAKE_ENV_DEFAULTS = {
    "MC_LOG_LEVEL": "ERROR",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
}


INVALID_BATCH_IDS = (0, (1 << 64) - 1)
# Lines the library writes to stderr on every start that read as errors but are not: glog's
# notice that nobody initialised it, and the P2P handshake looking up this engine's own segment
# before it is published. `initialize`'s stderr is captured; these are dropped, the rest shown.
EXPECTED_AT_START = (
    re.compile(r"Logging before InitGoogleLogging\(\) is written to STDERR"),
    re.compile(r"transfer_metadata\.cpp:\d+\] Local segment descriptor not found"),
)

NVLINK_INTRA = "nvlink_intra"
CUDA_DISTRIBUTIONS = ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine")


def cuda_build() -> str:
    """The installed CUDA build of Mooncake as "name==version" ("" when only the CPU one is)."""
    for name in CUDA_DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{name}=={importlib.metadata.version(name)}"
    return ""


@contextlib.contextmanager
def _start_lines_filtered() -> Iterator[None]:
    """Capture the library's stderr (fd 2) inside the block; then drop the EXPECTED_AT_START
    lines (one INFO line says so) and pass every other line on, real errors included."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
    expected = [line for line in lines if any(p.search(line) for p in EXPECTED_AT_START)]
    sys.stderr.write("".join(line for line in lines if line not in expected))
    if expected:
        logger.info(
            "mooncake: %d start-up line(s) of the library left out (glog not initialised; "
            "own segment looked up before it is published): expected, not errors",
            len(expected),
        )


@contextlib.contextmanager
def _environment(settings: dict[str, str]) -> Iterator[None]:
    """`settings` in os.environ inside the block (the library reads them in `initialize`)."""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def lower_thread_priority() -> None:
    """Nice 19 for the calling thread (Linux niceness is per thread)."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


@dataclass
class MooncakeHandle(base.TransferHandle):
    peer_id: str
    batch_ids: list[int]
    error: str = ""  # the first failure seen (starting or finishing a batch); ends FAILED
    completion: Future[int] | None = field(default=None, repr=False)


class MooncakeEngine(base.KVTransferEngine):
    name = "mooncake"
    notifies_completion = True  # its waiter thread sees each write end: `_completed`

    def __init__(self, config: base.TransferConfig) -> None:
        super().__init__(config)
        for key, value in MOONCAKE_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        transport_env = {}
        if config.protocol == NVLINK_INTRA:
            if not cuda_build():
                raise base.TransferError(
                    f"mooncake engine {config.node_name!r}: protocol {NVLINK_INTRA!r} needs "
                    "Mooncake's CUDA build (pip install mooncake-transfer-engine-cuda13, or "
                    "mooncake-transfer-engine for CUDA 12, instead of the -non-cuda wheel)"
                )
            transport_env["MC_INTRANODE_NVLINK"] = "1"
        from mooncake.engine import TransferEngine

        self._engine: TransferEngine | None = TransferEngine()
        with _environment(transport_env), _start_lines_filtered():
            rc = self._engine.initialize(
                config.host, "P2PHANDSHAKE", config.protocol, config.device_names
            )
        if rc != 0:
            raise base.TransferError(
                f"mooncake engine {config.node_name!r} failed to start on host {config.host!r} "
                f"with protocol {config.protocol!r} devices {config.device_names!r} (rc={rc}); "
                "for rdma check the device names, for tcp the host address"
            )
        if config.protocol == "rdma":
            self._require_rdma_devices()
        self._regions: list[base.MemoryRegion] = []
        self._peer_sessions: dict[str, str] = {}
        # nvlink_intra copies finish well inside a GIL switch interval (see the docstring).
        self._yield_in_poll = config.protocol == NVLINK_INTRA
        # One thread: the library's status call spins a core while it waits.
        self._waiter = ThreadPoolExecutor(
            1,
            thread_name_prefix=f"mooncake-wait-{config.node_name}",
            initializer=lower_thread_priority,
        )

    def _require_rdma_devices(self) -> None:
        """The engine falls back to TCP without a word when it finds no RDMA device."""
        topology = json.loads(self._live_engine().get_local_topology())
        if not any(preferred or available for preferred, available in topology.values()):
            raise base.TransferError(
                f"mooncake engine {self.config.node_name!r}: protocol 'rdma' was asked for but "
                f"no RDMA device matched {self.config.device_names or 'any'!r} (it would run "
                "over tcp); check the device names (ibv_devices) or use protocol 'tcp'"
            )

    def _live_engine(self) -> TransferEngine:
        if self._engine is None:
            raise base.TransferError(f"mooncake engine {self.config.node_name!r} is closed")
        return self._engine

    def register(self, regions: Sequence[base.MemoryRegion]) -> None:
        engine = self._live_engine()
        for region in regions:
            if region.device == "cpu":
                rc = engine.register_memory(region.addr, region.length)
            else:  # the library's location names for GPU memory are "cuda:N" too
                rc = engine.register_memory(region.addr, region.length, region.device)
            if rc != 0:
                hint = ""
                if self.config.protocol == NVLINK_INTRA:
                    hint = (
                        f"; protocol {NVLINK_INTRA!r} registers only cudaMalloc'd GPU memory "
                        "(not CPU memory, not PyTorch's expandable segments)"
                    )
                raise base.TransferError(
                    f"mooncake engine {self.config.node_name!r} could not register region "
                    f"{region.name!r} ({region.length} bytes at {region.addr:#x} on "
                    f"{region.device}, rc={rc}){hint}"
                )
            self._regions.append(region)

    def local_endpoint(self) -> bytes:
        return f"{self.config.host}:{self._live_engine().get_rpc_port()}".encode()

    def connect(self, peer: base.PeerInfo) -> None:
        self._peer_sessions[peer.node_id] = peer.endpoint.decode()

    def write(self, peer_id: str, ranges: Sequence[base.TransferRange]) -> base.TransferHandle:
        engine = self._live_engine()
        session = self._peer_sessions.get(peer_id)
        if session is None:
            raise base.TransferError(
                f"mooncake engine {self.config.node_name!r}: peer {peer_id!r} is not connected; "
                "call connect() with its PeerInfo first"
            )
        handle = MooncakeHandle(peer_id=peer_id, batch_ids=[])
        step = self.config.max_descriptors_per_batch
        src, dst, length = base.columns_of(ranges)
        for start in range(0, len(ranges), step):
            batch = slice(start, start + step)
            batch_id = engine.batch_transfer_async_write(
                session, src[batch].tolist(), dst[batch].tolist(), length[batch].tolist()
            )
            if batch_id in INVALID_BATCH_IDS:
                count = len(length[batch])
                self._fail(handle, f"a batch of {count} descriptors was not accepted")
                break
            handle.batch_ids.append(batch_id)
        if handle.batch_ids:
            handle.completion = self._waiter.submit(
                engine.get_batch_transfer_status, list(handle.batch_ids)
            )
            handle.completion.add_done_callback(self._completed)
        return handle

    def _completed(self, completion: Future[int]) -> None:
        """On the waiter thread: a write ended; tell whoever waits for one (`bind_completion`)."""
        self._on_completion()

    def _yield_to_waiter(self, completion: Future[int]) -> bool:
        """nvlink_intra: let the waiter thread take the GIL now; whether it has answered."""
        if not self._yield_in_poll:
            return False
        time.sleep(0)
        return completion.done()

    def _fail(self, handle: MooncakeHandle, reason: str) -> None:
        if not handle.error:
            session = self._peer_sessions.get(handle.peer_id)
            handle.error = f"write to peer {handle.peer_id!r} at {session} failed: {reason}"
            logger.warning("%s: %s", self.config.node_name, handle.error)

    def poll(self, handle: base.TransferHandle) -> base.TransferState:
        assert isinstance(handle, MooncakeHandle)
        if handle.completion is not None:
            done = handle.completion.done() or self._yield_to_waiter(handle.completion)
            if not done:
                return base.TransferState.PENDING
            if handle.completion.result() != 0:
                self._fail(
                    handle,
                    "a batch failed or timed out (peer gone, range outside its memory, or more "
                    "descriptors in flight than MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER allows)",
                )
        return base.TransferState.FAILED if handle.error else base.TransferState.DONE

    def release(self, handle: base.TransferHandle) -> None:
        # The status call already freed the batch ids; nothing is held per handle.
        if self.poll(handle) is base.TransferState.PENDING:
            raise base.TransferError(
                f"mooncake engine {self.config.node_name!r}: cannot release a write that is "
                "still in flight (the library cannot cancel it); poll until DONE or FAILED"
            )

    def close(self) -> None:
        if self._engine is None:
            return
        self._waiter.shutdown(wait=True)
        for region in self._regions:
            rc = self._engine.unregister_memory(region.addr)
            if rc != 0:
                logger.warning(
                    "%s: unregistering region %r returned rc=%d",
                    self.config.node_name,
                    region.name,
                    rc,
                )
        self._regions.clear()
        self._engine = None
