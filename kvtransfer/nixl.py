"""NIXL backend (`nixl`, UCX plugin): one agent per node, one-sided WRITEs into a peer's memory.

Facts of nixl 1.5.1 that shape this file (checked on loopback, two processes):
- `add_remote_agent(metadata)` returns the peer's agent name (bytes); the peer's metadata comes
  from its `get_agent_metadata()`, which is this engine's endpoint. UCX connects lazily.
- Errors are exceptions of `nixl._bindings` (all subclasses of `Exception`): `initialize_xfer`
  to an unknown agent or to memory the peer never registered raises `nixlNotFoundError`;
  `transfer` to a peer that died raises `nixlRemoteDisconnectError`. A write the library
  refuses ends FAILED here (the peer may be gone); only a write that can never work (peer not
  connected, range outside every registered region) raises `TransferError`.
- `check_xfer_state` answers "DONE", "PROC" or "ERR" and does not block. Between two processes
  of one host UCX picks cma (process_vm_writev), whose copy runs inside `transfer()`: there
  `write` returns after the bytes have moved (2-3 GB/s on 2 cores). Without cma
  (`UCX_TLS=^cma`) it returns at once but moves 3-5x slower over tcp.
- One transfer request carries one memory type on each side, so ranges are grouped by
  (local, remote) memory type before they become descriptor lists.
- The wheel bundles its own rdma-core, but UCX's EFA module links the system's `libefa.so.1`
  when the host has it (Debian `ibverbs-providers`, installed with Mooncake's `libibverbs1`);
  that drags in a second `libnl-route`, and every process that created a UCX agent dies with
  SIGSEGV at exit (exit code 139, in `rtnl_tc_unregister`). The constructor sets
  `UCX_MODULES=^efa` unless the environment sets it (AWS EFA hosts should set their own).
- UCX uses every interface unless `UCX_NET_DEVICES` names some: on loopback it also tries the
  host's other interfaces, and a node bound to one address (a network namespace, a host with a
  private and a public NIC) would offer its peers addresses they cannot reach. The constructor
  sets it, only when unset, to the device of the node's host: `lo` for a loopback name, else
  the interface holding that IPv4 address (`net_device_for`); a wildcard host leaves it unset.
- The agent's progress thread is required (without it the *target* of writes never makes UCX
  progress and writes into it hang), but `nixl_agent` hard-codes its wake-up delay
  (`nixlAgentConfig.pthrDelay`, microseconds) to 0: it then spins a whole core per process even
  when idle. `_progress_delay` raises that delay while the agent is built (measured idle CPU:
  100% at 0, 3% at 100 us, 0% at 100 ms).
- The agent is built with thread sync NONE (the wrapper's default), so this engine serialises
  its own calls into it (`_agent_lock`): a write may be posted from another thread than the one
  that polls (`concurrent_writes`; the prefill node's layer-group poster,
  prefill_node/group_poster.py). `transfer()` lets go of the GIL while UCX posts (the cma copy
  runs inside it), so the other thread runs on; a `poll` that finds the lock taken answers
  PENDING instead of waiting for the post.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtransfer import base

if TYPE_CHECKING:
    from nixl._api import nixl_agent

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
MemoryKind = tuple[str, int]  # ("DRAM" | "VRAM", device id)
FEW_RANGES = 8  # `NixlEngine._group` checks this many ranges or fewer one by one


def net_device_for(host: str) -> str:
    """The network interface that holds `host` ("lo" for loopback names; "" if none does)."""
    if host in LOOPBACK_HOSTS:
        return "lo"
    try:
        wanted = socket.inet_aton(host)
    except OSError:  # a name or an IPv6 address: UCX picks its devices itself
        return ""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface
                continue
            if answer[20:24] == wanted:
                return name
    return ""


def memory_kind(region: base.MemoryRegion) -> MemoryKind:
    if region.device.startswith("cuda"):
        _, _, index = region.device.partition(":")
        return "VRAM", int(index or 0)
    return "DRAM", 0


def find_kind(regions: Sequence[base.MemoryRegion], addr: int, length: int) -> MemoryKind | None:
    for region in regions:
        if region.addr <= addr and addr + length <= region.addr + region.length:
            return memory_kind(region)
    return None


def _kind_ids(regions: Sequence[base.MemoryRegion]) -> tuple[list[MemoryKind], np.ndarray]:
    """The distinct memory kinds of `regions`, and each region's index among them."""
    kinds = list(dict.fromkeys(memory_kind(r) for r in regions))
    return kinds, np.array([kinds.index(memory_kind(r)) for r in regions], dtype=np.int64)


_agent_build = threading.Lock()


@contextlib.contextmanager
def _progress_delay(delay_us: int) -> Iterator[None]:
    """Agents built inside get a progress thread that sleeps `delay_us` between rounds.

    `nixl_agent.__init__` sets `pthrDelay = 0` on a fresh `nixlBind.nixlAgentConfig`; for the
    duration of the build that class is swapped for a subclass that keeps `delay_us` instead.
    """
    from nixl._api import nixl_agent

    api = sys.modules[nixl_agent.__module__]  # the CUDA-flavoured module the wrapper re-exports
    original = api.nixlBind.nixlAgentConfig

    class DelayedConfig(original):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, delay_us if name == "pthrDelay" else value)

    with _agent_build:
        api.nixlBind.nixlAgentConfig = DelayedConfig
        try:
            yield
        finally:
            api.nixlBind.nixlAgentConfig = original


@dataclass
class NixlHandle(base.TransferHandle):
    peer_id: str
    requests: list[Any] = field(default_factory=list)  # nixl_xfer_handle
    error: str = ""  # the first failure seen (starting or checking a request); ends FAILED


@dataclass
class NixlPeer:
    node_id: str
    endpoint: bytes  # the agent metadata it was loaded from
    agent_name: str
    regions: list[base.MemoryRegion]


class NixlEngine(base.KVTransferEngine):
    name = "nixl"
    concurrent_writes = True

    def __init__(self, config: base.TransferConfig) -> None:
        super().__init__(config)
        # The library is configured here and only where the environment says nothing. NIXL
        # reads its log level when imported (its INFO lines go to stdout), hence the late import.
        # UCX_MODULES: see the module docstring (EFA module -> SIGSEGV at exit).
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        os.environ.setdefault("UCX_MODULES", "^efa")
        device = net_device_for(config.host)
        if device:
            os.environ.setdefault("UCX_NET_DEVICES", device)
        from nixl._api import nixl_agent, nixl_agent_config

        with _progress_delay(config.nixl_progress_delay_us):
            self._agent: nixl_agent = nixl_agent(
                config.node_name, nixl_agent_config(backends=["UCX"])
            )
        if "UCX" not in self._agent.backends:
            raise base.TransferError(
                f"nixl agent {config.node_name!r} has no UCX backend; the installed nixl "
                "wheel lacks its UCX plugin (pip install nixl)"
            )
        self._regions: list[base.MemoryRegion] = []
        self._registrations: list[Any] = []  # nixlRegDList, one per region
        self._peers: dict[str, NixlPeer] = {}
        self._agent_lock = threading.Lock()  # one call into the agent at a time (see top)

    def register(self, regions: Sequence[base.MemoryRegion]) -> None:
        for region in regions:
            mem, device = memory_kind(region)
            try:
                descs = self._agent.register_memory([(region.addr, region.length, device, "")], mem)
            except Exception as exc:  # nixl raises its own Exception subclasses
                raise base.TransferError(
                    f"nixl agent {self.config.node_name!r} could not register region "
                    f"{region.name!r} ({region.length} bytes of {mem} at {region.addr:#x}): {exc}"
                ) from exc
            self._registrations.append(descs)
            self._regions.append(region)

    def local_endpoint(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def connect(self, peer: base.PeerInfo) -> None:
        with self._agent_lock:
            self._connect(peer)

    def _connect(self, peer: base.PeerInfo) -> None:
        known = self._peers.get(peer.node_id)
        if known is not None and known.endpoint == peer.endpoint:
            return
        if known is not None:  # the peer restarted: forget its old agent
            self._agent.remove_remote_agent(known.agent_name)
        try:
            agent_name = self._agent.add_remote_agent(peer.endpoint)
        except Exception as exc:
            raise base.TransferError(
                f"nixl agent {self.config.node_name!r} could not load the metadata of peer "
                f"{peer.node_id!r}: {exc}"
            ) from exc
        self._peers[peer.node_id] = NixlPeer(
            peer.node_id, peer.endpoint, agent_name, list(peer.regions.values())
        )

    def write(self, peer_id: str, ranges: Sequence[base.TransferRange]) -> base.TransferHandle:
        with self._agent_lock:
            return self._write(peer_id, ranges)

    def _write(self, peer_id: str, ranges: Sequence[base.TransferRange]) -> base.TransferHandle:
        peer = self._peers.get(peer_id)
        if peer is None:
            raise base.TransferError(
                f"nixl agent {self.config.node_name!r}: peer {peer_id!r} is not connected; "
                "call connect() with its PeerInfo first"
            )
        handle = NixlHandle(peer_id=peer_id)
        step = self.config.max_descriptors_per_batch
        for (local_kind, remote_kind), rows in self._group(peer, ranges).items():
            for start in range(0, len(rows), step):
                if not self._post(
                    handle, peer, rows[start : start + step], local_kind, remote_kind
                ):
                    return handle
        return handle

    def _group(
        self, peer: NixlPeer, ranges: Sequence[base.TransferRange]
    ) -> dict[tuple[MemoryKind, MemoryKind], np.ndarray]:
        """Rows (src, dst, length: uint64 [n, 3]) per (local kind, remote kind), in the order
        of their first range; checks every range's bounds (as columns: no Python per range,
        but ~30 us of numpy calls, so a write of a few ranges, the aux slot's, goes by hand)."""
        if len(ranges) <= FEW_RANGES and not isinstance(ranges, base.RangeColumns):
            return self._group_few(peer, ranges)
        columns = base.columns_of(ranges)
        local, remote = base.holding_regions(
            self._regions, peer.regions, columns, ranges,
            f"nixl agent {self.config.node_name!r}", peer.node_id, "PeerInfo",
        )  # fmt: skip
        local_kinds, local_kind = _kind_ids(self._regions)
        remote_kinds, remote_kind = _kind_ids(peer.regions)
        pair = local_kind[local] * len(remote_kinds) + remote_kind[remote]
        keys, firsts = np.unique(pair, return_index=True)
        rows = columns.T.astype(np.uint64)
        groups: dict[tuple[MemoryKind, MemoryKind], np.ndarray] = {}
        for key in keys[np.argsort(firsts)].tolist():
            kinds = (local_kinds[key // len(remote_kinds)], remote_kinds[key % len(remote_kinds)])
            groups[kinds] = rows if len(keys) == 1 else rows[pair == key]
        return groups

    def _group_few(
        self, peer: NixlPeer, ranges: Sequence[base.TransferRange]
    ) -> dict[tuple[MemoryKind, MemoryKind], np.ndarray]:
        """`_group` range by range."""
        groups: dict[tuple[MemoryKind, MemoryKind], list[base.TransferRange]] = {}
        for r in ranges:
            local = find_kind(self._regions, r.src_addr, r.length)
            remote = find_kind(peer.regions, r.dst_addr, r.length)
            if local is None or remote is None:
                side = "local" if local is None else f"peer {peer.node_id!r}"
                raise base.TransferError(
                    f"nixl agent {self.config.node_name!r}: range {r} lies outside every "
                    f"registered {side} region (the peer's regions come from its PeerInfo)"
                )
            groups.setdefault((local, remote), []).append(r)
        return {kinds: np.array(rows, dtype=np.uint64) for kinds, rows in groups.items()}

    def _post(
        self,
        handle: NixlHandle,
        peer: NixlPeer,
        rows: np.ndarray,
        local_kind: MemoryKind,
        remote_kind: MemoryKind,
    ) -> bool:
        """Start one transfer request; False (and the handle marked failed) if NIXL refused."""
        local = np.stack([rows[:, 0], rows[:, 2], np.full_like(rows[:, 0], local_kind[1])], 1)
        remote = np.stack([rows[:, 1], rows[:, 2], np.full_like(rows[:, 0], remote_kind[1])], 1)
        request = None
        try:
            request = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(local, local_kind[0]),
                self._agent.get_xfer_descs(remote, remote_kind[0]),
                peer.agent_name,
                b"",
            )
            state = self._agent.transfer(request)
        except Exception as exc:  # nixlNotFoundError, nixlRemoteDisconnectError, ...
            state, detail = "ERR", f"{type(exc).__name__}: {exc}"
        else:
            detail = "transfer() answered ERR"
        if request is not None:
            handle.requests.append(request)
        if state == "ERR":
            self._fail(handle, f"write of {len(rows)} descriptors was refused: {detail}")
            return False
        return True

    def _fail(self, handle: NixlHandle, reason: str) -> None:
        if not handle.error:
            handle.error = f"write to peer {handle.peer_id!r} failed: {reason}"
            logger.warning("%s: %s", self.config.node_name, handle.error)

    def poll(self, handle: base.TransferHandle) -> base.TransferState:
        assert isinstance(handle, NixlHandle)
        if not self._agent_lock.acquire(blocking=False):
            return base.TransferState.PENDING  # another thread is posting: ask again later
        try:
            states = [self._request_state(handle, request) for request in handle.requests]
        finally:
            self._agent_lock.release()
        if "PROC" in states:
            return base.TransferState.PENDING
        if handle.error or "ERR" in states:
            return base.TransferState.FAILED
        return base.TransferState.DONE

    def _request_state(self, handle: NixlHandle, request: Any) -> str:
        try:
            state = str(self._agent.check_xfer_state(request))
        except Exception as exc:  # a request whose post failed raises that error again
            state, detail = "ERR", f"{type(exc).__name__}: {exc}"
        else:
            detail = "check_xfer_state answered ERR"
        if state == "ERR":
            self._fail(handle, detail)
        return state

    def release(self, handle: base.TransferHandle) -> None:
        assert isinstance(handle, NixlHandle)
        with self._agent_lock:
            self._release(handle)

    def _release(self, handle: NixlHandle) -> None:
        for request in handle.requests:
            try:
                self._agent.release_xfer_handle(request)
            except Exception as exc:
                raise base.TransferError(
                    f"nixl agent {self.config.node_name!r}: could not release a write to peer "
                    f"{handle.peer_id!r} (still in flight and not cancellable?): {exc}"
                ) from exc
        handle.requests.clear()

    def close(self) -> None:
        with self._agent_lock:
            self._close()

    def _close(self) -> None:
        for descs in self._registrations:
            self._agent.deregister_memory(descs)
        self._registrations.clear()
        self._regions.clear()
        for peer in self._peers.values():
            self._agent.remove_remote_agent(peer.agent_name)
        self._peers.clear()
