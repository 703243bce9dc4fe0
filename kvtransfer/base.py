"""The KV transfer interface: one engine per node, moving byte ranges into a peer's memory.

A node registers its whole KV pool (and its aux buffer) once at start; per request only
descriptors move. Descriptor count is the cost (on two GPUs, 1 GiB in one descriptor moves 15x
faster than in 8192), so callers coalesce contiguous pages with `coalesce_pages` first.

Backends live in sibling modules and are chosen by name through `kvtransfer.create_engine`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from operator import attrgetter
from typing import NamedTuple, Protocol, overload

import numpy as np


class TransferError(RuntimeError):
    """A transfer could not be started or failed; the message names the peer."""


class TransferState(Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferConfig:
    backend: str  # "mooncake" | "nixl" | "cuda_ipc" (kvtransfer.TRANSFER_BACKENDS)
    node_name: str  # unique per process: NIXL agent name, log prefix
    host: str = "127.0.0.1"
    protocol: str = "tcp"  # mooncake: "tcp" or "rdma"
    device_names: str = ""  # mooncake RDMA devices, e.g. "mlx5_0,mlx5_1"
    max_descriptors_per_batch: int = 1024  # larger requests are split into several batches
    fail_rate: float = 0.0  # fault injection: probability that a write fails (tests only)
    aux_corrupt_rate: float = 0.0  # fault injection: probability that an aux write is corrupted
    nixl_progress_delay_us: int = 100  # nixl: progress thread sleep (0 = spin a core)
    ipc_copy: str = "kernel"  # cuda_ipc: page-id writes by its kernel | batch | batch-overlap


@dataclass(frozen=True)
class MemoryRegion:
    name: str  # "kv" or "aux"
    addr: int
    length: int
    device: str = "cpu"  # or "cuda:N"


@dataclass(frozen=True)
class PeerRank:
    """One tensor-parallel rank of a peer node: its own engine endpoint and KV shard."""

    tp_rank: int
    endpoint: bytes
    kv: MemoryRegion
    kv_heads: range  # global KV heads it holds (contiguous)


@dataclass(frozen=True)
class PeerInfo:
    node_id: str
    endpoint: bytes  # what the peer's `local_endpoint()` returned (rank 0's with TP)
    regions: dict[str, MemoryRegion] = field(default_factory=dict)
    ranks: tuple[PeerRank, ...] = ()  # every TP rank (rank 0 included); empty for TP=1

    def rank_peer_id(self, tp_rank: int) -> str:
        """The transfer peer id of one rank: the node id for rank 0."""
        return self.node_id if tp_rank == 0 else f"{self.node_id}#tp{tp_rank}"

    def rank_peers(self) -> list[PeerInfo]:
        """One single-rank PeerInfo per TP rank, to `connect` each; [self] for TP=1. Rank 0
        keeps every region of the node (its aux slots too), the others have their KV only."""
        if not self.ranks:
            return [self]
        return [
            PeerInfo(
                self.rank_peer_id(r.tp_rank),
                r.endpoint,
                {**self.regions, "kv": r.kv} if r.tp_rank == 0 else {"kv": r.kv},
            )
            for r in self.ranks
        ]


class TransferRange(NamedTuple):
    """One descriptor: `length` bytes from a local address into the peer's memory. A named
    tuple, not a frozen dataclass: a write of 256 scattered pages builds 256 of them on the
    host, and a frozen dataclass takes twice as long to build (0.45 against 0.23 us)."""

    src_addr: int
    dst_addr: int
    length: int


class RangeColumns(Sequence[TransferRange]):
    """Many descriptors as int64 columns [3, n] (sources, destinations, lengths), as a planner
    computes them with numpy: a layer group's write (kvtransfer/head_routes.py) is one range
    per page and KV head, 4,096 for an 8k-token prompt, and building a TransferRange for each
    took longer than computing them. To a caller it is a Sequence[TransferRange]; an engine
    that works on columns takes them with `columns_of` at no cost."""

    __slots__ = ("columns",)

    def __init__(self, columns: np.ndarray) -> None:
        if columns.ndim != 2 or columns.shape[0] != 3:
            raise ValueError(f"range columns are [3, n] (src, dst, length), got {columns.shape}")
        self.columns = columns.astype(np.int64, copy=False)

    def __len__(self) -> int:
        return int(self.columns.shape[1])

    @overload
    def __getitem__(self, index: int) -> TransferRange: ...

    @overload
    def __getitem__(self, index: slice) -> RangeColumns: ...

    def __getitem__(self, index: int | slice) -> TransferRange | RangeColumns:
        if isinstance(index, slice):
            return RangeColumns(self.columns[:, index])
        src, dst, length = self.columns[:, index].tolist()
        return TransferRange(src, dst, length)

    def __iter__(self) -> Iterator[TransferRange]:
        return map(TransferRange._make, zip(*self.columns.tolist(), strict=True))

    def __repr__(self) -> str:
        return f"RangeColumns({len(self)} ranges, {total_bytes(self)} bytes)"


_FIELDS = (attrgetter("src_addr"), attrgetter("dst_addr"), attrgetter("length"))


def columns_of(ranges: Sequence[TransferRange]) -> np.ndarray:
    """The ranges as int64 columns [3, n]: a RangeColumns' own (read them, don't change them),
    else built in one C-level pass per field, no Python frame or tuple per range."""
    if isinstance(ranges, RangeColumns):
        return ranges.columns
    n = len(ranges)
    columns = np.empty((3, n), dtype=np.int64)
    for i, field_of in enumerate(_FIELDS):
        columns[i] = np.fromiter(map(field_of, ranges), np.int64, n)
    return columns


class Extent(Protocol):
    """Anything with a base address and a length in bytes (a registered or exported region)."""

    @property
    def addr(self) -> int: ...

    @property
    def length(self) -> int: ...


def holding_region(regions: Sequence[Extent], addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Per range [addr, addr + length), the index of the first region that holds it whole, -1
    where none does (numpy columns in, one pass per region)."""
    found = np.full(len(addr), -1, dtype=np.int64)
    for index in reversed(range(len(regions))):  # the first region that holds it wins
        region = regions[index]
        found[(addr >= region.addr) & (addr + length <= region.addr + region.length)] = index
    return found


def holding_regions(
    local: Sequence[Extent],
    peer: Sequence[Extent],
    columns: np.ndarray,
    ranges: Sequence[TransferRange],
    engine: str,
    peer_name: str,
    peer_source: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Per range (`columns`: `columns_of(ranges)`), the local region holding its source and the
    peer's region holding its destination; a TransferError naming the first range one of them
    does not hold (`engine` and `peer_name` say whose, `peer_source` where the peer's regions
    came from)."""
    local_i = holding_region(local, columns[0], columns[2])
    peer_i = holding_region(peer, columns[1], columns[2])
    outside = (local_i < 0) | (peer_i < 0)
    if outside.any():
        first = int(np.argmax(outside))
        side = "local" if local_i[first] < 0 else f"peer {peer_name!r}"
        raise TransferError(
            f"{engine}: range {ranges[first]} lies outside every registered {side} region "
            f"(the peer's regions come from its {peer_source})"
        )
    return local_i, peer_i


def total_bytes(ranges: Sequence[TransferRange]) -> int:
    if isinstance(ranges, RangeColumns):
        return int(ranges.columns[2].sum())
    return sum(r.length for r in ranges)


class TransferHandle:
    """Opaque per-backend token for one started write (possibly several engine batches)."""


class KVTransferEngine(ABC):
    name: str = ""
    # True when `write` orders its copies after the caller's current CUDA stream (cuda_ipc's
    # kernel stream first waits for it): a write issued from a stream that waits for an event
    # moves what was computed before the event. Otherwise the copy starts once it is posted.
    stream_ordered: bool = False
    # True when the engine calls the callback of `bind_completion` as its writes end, so that
    # a caller may wait for it instead of polling often.
    notifies_completion: bool = False
    # False when a `poll` costs more than a look at local state (a TP node's: a collective
    # over its ranks): a caller then polls seldom.
    cheap_poll: bool = True
    # True when `write` may run on one thread while `poll` and `release` run on another (the
    # engine locks what they share): a caller may then post from a thread of its own.
    concurrent_writes: bool = False

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self._on_completion: Callable[[], None] = _nothing

    def bind_completion(self, callback: Callable[[], None]) -> None:
        """`callback` (thread-safe, quick) is called, from any thread, after a write ended
        (DONE or FAILED; `poll` tells which), by the engines that know (`notifies_completion`)."""
        self._on_completion = callback

    @abstractmethod
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """Register local memory once; every transfer's source/destination lies inside it."""

    @abstractmethod
    def local_endpoint(self) -> bytes:
        """What a peer needs to reach this engine (sent through bootstrap)."""

    @abstractmethod
    def connect(self, peer: PeerInfo) -> None:
        """Make `peer` reachable for writes; idempotent."""

    @abstractmethod
    def write(self, peer_id: str, ranges: Sequence[TransferRange]) -> TransferHandle:
        """Start writing local ranges into the peer's memory; does not block on completion."""

    def write_pages(
        self,
        peer_id: str,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        page_bytes: int,
        src_base: int,
        dst_base: int,
    ) -> TransferHandle:
        """Write whole pages: local page `s` (at `src_base + s * page_bytes`) into the peer's
        page `d` (at `dst_base + d * page_bytes`), pairwise. The same as `write` of the pages'
        coalesced ranges (what this default does); a backend may check and plan page ids
        without building a range per page (cuda_ipc does)."""
        src, dst = [int(p) for p in src_pages], [int(p) for p in dst_pages]
        return self.write(peer_id, coalesce_pages(src, dst, page_bytes, src_base, dst_base))

    def write_remote(self, plan: dict[int, dict[str, Sequence[TransferRange]]]) -> TransferHandle:
        """Start the writes of TP ranks other than 0 (prefill rank -> decode peer -> ranges).
        Only a TP node's engine can (engine/node/tp_transfer.py); a plain engine refuses."""
        ranks = sorted(rank for rank in plan if rank != 0)
        raise TransferError(
            f"the {self.name or type(self).__name__} engine writes only from TP rank 0, "
            f"but the plan has writes from ranks {ranks}: a TP prefill node needs its TP engine"
        )

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState:
        """Non-blocking state of a started write."""

    @abstractmethod
    def release(self, handle: TransferHandle) -> None:
        """Forget a finished (DONE or FAILED) write."""

    @abstractmethod
    def close(self) -> None:
        """Unregister memory and stop the engine."""


def _nothing() -> None:
    return None


def coalesce_pages(
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    page_bytes: int,
    src_base: int,
    dst_base: int,
) -> list[TransferRange]:
    """One range per run of pages that is contiguous on both sides."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    ranges: list[TransferRange] = []
    i = 0
    while i < len(src_pages):
        j = i + 1
        while (
            j < len(src_pages)
            and src_pages[j] == src_pages[j - 1] + 1
            and dst_pages[j] == dst_pages[j - 1] + 1
        ):
            j += 1
        ranges.append(
            TransferRange(
                src_addr=src_base + src_pages[i] * page_bytes,
                dst_addr=dst_base + dst_pages[i] * page_bytes,
                length=(j - i) * page_bytes,
            )
        )
        i = j
    return ranges
