"""The pure parts of the `cuda_ipc` backend: its endpoint, and a write planned as equal chunks.

No CUDA here (the tests run it on a CPU):

- `IpcEndpoint`: what the receiver publishes through bootstrap (its `local_endpoint()`): the
  host it runs on (the kernel's boot id: CUDA IPC and `process_vm_writev` work within one
  host only), its pid (for the CPU aux slots), and per registered region its address, length,
  device and, for GPU memory, the CUDA IPC handle of the allocation holding it with the
  region's offset inside that allocation.
- `group_ranges`: a write's ranges as one array per (local region, peer region), each range
  checked (inside a region on both sides; GPU to GPU or CPU to CPU).
- `plan_copy`: a write's byte ranges as rows of chunks (source offset, destination offset,
  length), ranges longer than `MAX_PIECE_BYTES` cut into pieces, with the chunk size
  (the largest power of two, at most `MAX_CHUNK_BYTES`, that divides every offset and length).
  The copy kernel (kvtransfer/cuda_ipc_kernel.py) runs a program per (chunk, row), so a write
  is one launch however many pages it holds, and the host sends the GPU one row a range, not
  one a chunk (256 scattered 2 MiB pages: 256 rows, 6 KiB).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import chain
from operator import attrgetter
from pathlib import Path

import numpy as np

from kvtransfer.base import MemoryRegion, TransferError, TransferRange

BACKEND_FLAG = "--transfer-backend cuda_ipc"
# Measured on one H200 (scripts/gpu/tune_ipc_copy.py): 16 KiB a program, 4 KiB a step, 8 warps
# copied 256 scattered 2 MiB pages in 0.284 ms, 94% of torch's contiguous copy.
MAX_CHUNK_BYTES = 16 << 10
# Rows longer than this are cut, so that the grid (longest row's chunks x rows) wastes few
# programs on short rows beside a long one.
MAX_PIECE_BYTES = 2 << 20
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_RANGE_FIELDS = attrgetter("src_addr", "dst_addr", "length")


def boot_id() -> str:
    """This host's identity for the one-host check ("" where the kernel does not tell)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class ExportedRegion:
    name: str
    addr: int  # in the exporting process
    length: int
    device: str  # "cpu" or "cuda:N"
    ipc_handle: bytes = b""  # cudaIpcMemHandle_t of the allocation holding it (GPU only)
    offset: int = 0  # of `addr` inside that allocation

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def device_index(self) -> int:
        return device_index(self.device)

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.length


def device_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index or 0)


@dataclass(frozen=True)
class IpcEndpoint:
    node_name: str
    boot_id: str
    pid: int
    regions: tuple[ExportedRegion, ...]

    def to_bytes(self) -> bytes:
        rows = [{**asdict(r), "ipc_handle": r.ipc_handle.hex()} for r in self.regions]
        raw = {"cuda_ipc": 1, "node_name": self.node_name, "boot_id": self.boot_id,
               "pid": self.pid, "regions": rows}  # fmt: skip
        return json.dumps(raw).encode()

    @classmethod
    def from_bytes(cls, data: bytes, peer_id: str) -> IpcEndpoint:
        try:
            raw = json.loads(data)
            if raw.get("cuda_ipc") != 1:
                raise ValueError("no cuda_ipc marker")
            regions = tuple(
                ExportedRegion(**{**r, "ipc_handle": bytes.fromhex(r["ipc_handle"])})
                for r in raw["regions"]
            )
            return cls(raw["node_name"], raw["boot_id"], int(raw["pid"]), regions)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TransferError(
                f"peer {peer_id!r} did not publish a cuda_ipc endpoint ({exc}); start both "
                f"nodes with {BACKEND_FLAG}"
            ) from exc

    def check_same_host(self, peer_id: str, local_boot_id: str) -> None:
        if not self.boot_id or self.boot_id != local_boot_id:
            raise TransferError(
                f"peer {peer_id!r} runs on another host (boot id {self.boot_id or 'unknown'} "
                f"!= {local_boot_id or 'unknown'}): {BACKEND_FLAG} moves KV within one host "
                "only; use --transfer-backend nixl or mooncake between hosts"
            )

    def region_for(self, addr: int, length: int) -> ExportedRegion | None:
        return next((r for r in self.regions if r.contains(addr, length)), None)


def check_registrable(region: MemoryRegion) -> None:
    """GPU memory for the KV pool; CPU memory only for the small aux slots, which this
    backend copies with the CPU (process_vm_writev), not through CUDA IPC."""
    if region.device == "cpu" and region.name != "aux":
        raise TransferError(
            f"{BACKEND_FLAG} needs the KV pool in GPU memory, but region {region.name!r} "
            f"({region.length} bytes) is in CPU memory; run the nodes with --device cuda, or "
            "use --transfer-backend nixl or mooncake for CPU nodes"
        )
    if region.device != "cpu" and not region.device.startswith("cuda"):
        raise TransferError(
            f"{BACKEND_FLAG}: region {region.name!r} is on {region.device!r}; only 'cpu' "
            "(aux slots) and 'cuda:N' are supported"
        )


@dataclass(frozen=True)
class CopyPlan:
    """A write as rows of chunks: row i moves `rows[i, 2]` chunks of `chunk_bytes` from local
    chunk `rows[i, 0]` to peer chunk `rows[i, 1]` (counted from the bases the plan was made
    against; in chunks, not bytes, so that the kernel knows every address is a multiple of
    the chunk and vectorises); no row longer than `MAX_PIECE_BYTES`."""

    chunk_bytes: int
    word_bytes: int  # the kernel's element: 8 bytes unless the chunks or the bases forbid it
    rows: np.ndarray  # int64 [n, 3], in chunks

    @property
    def chunk_words(self) -> int:
        return self.chunk_bytes // self.word_bytes

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def max_chunks(self) -> int:
        """Chunks of the longest row: the grid's first dimension."""
        return int(self.rows[:, 2].max()) if len(self.rows) else 0

    @property
    def nbytes(self) -> int:
        return int(self.rows[:, 2].sum()) * self.chunk_bytes


def chunk_size(values: Sequence[int] | np.ndarray, max_chunk: int = MAX_CHUNK_BYTES) -> int:
    """The largest power of two <= `max_chunk` that divides every value (a power of two)."""
    if max_chunk <= 0 or max_chunk & (max_chunk - 1):
        raise ValueError(f"max_chunk must be a power of two, got {max_chunk}")
    # the largest power of two dividing them all is the lowest bit set in any of them
    every = int(np.bitwise_or.reduce(np.asarray(values, dtype=np.int64).ravel(), initial=0))
    every |= max_chunk
    return every & -every


def plan_copy(
    ranges: Sequence[tuple[int, int, int]] | np.ndarray,
    align: Sequence[int] = (),
    max_chunk: int = MAX_CHUNK_BYTES,
    max_piece: int = MAX_PIECE_BYTES,
) -> CopyPlan:
    """`ranges`: (source offset, destination offset, length) in bytes; `align`: the base
    addresses the offsets are relative to (the kernel's words must be aligned in memory).
    Vectorised, and without a per-chunk list: 256 ranges plan in a few microseconds."""
    rows = np.asarray(ranges, dtype=np.int64).reshape(-1, 3)
    if (rows[:, 2] <= 0).any() or (rows[:, :2] < 0).any():
        raise ValueError(f"ranges need non-negative offsets and positive lengths: {rows[:4]}")
    chunk = chunk_size(rows.ravel(), max_chunk)
    word = chunk_size([chunk, *align], max_chunk=8)
    piece = max(max_piece - max_piece % chunk, chunk)
    if len(rows) and rows[:, 2].max() > piece:
        rows = split_rows(rows, piece)
    return CopyPlan(chunk, word, rows // chunk)


def split_rows(rows: np.ndarray, piece: int) -> np.ndarray:
    """Rows cut into pieces of `piece` bytes (the last of a row shorter), in order."""
    counts = -(-rows[:, 2] // piece)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    within = (np.arange(int(counts.sum()), dtype=np.int64) - first) * piece
    out = np.repeat(rows, counts, axis=0)
    out[:, 0] += within
    out[:, 1] += within
    out[:, 2] = np.minimum(out[:, 2] - within, piece)
    return out


def _locate(regions: Sequence[ExportedRegion], addr: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Per row, the index of the region holding [addr, addr + length), or -1."""
    found = np.full(len(addr), -1, dtype=np.int64)
    for i, region in enumerate(regions):
        inside = (addr >= region.addr) & (addr + length <= region.addr + region.length)
        found[inside & (found < 0)] = i
    return found


def _one_pair(
    rows: np.ndarray, local: Sequence[ExportedRegion], peer: Sequence[ExportedRegion]
) -> tuple[int, int] | None:
    """(local region, peer region) holding every row, both GPU or both CPU; None when the
    rows span regions (or none holds them: the per-row checks then say which row)."""
    if not len(rows) or (rows[:, 2] <= 0).any():
        return None
    src_lo, dst_lo = int(rows[:, 0].min()), int(rows[:, 1].min())
    src_hi, dst_hi = int((rows[:, 0] + rows[:, 2]).max()), int((rows[:, 1] + rows[:, 2]).max())
    li = next((i for i, r in enumerate(local) if r.contains(src_lo, src_hi - src_lo)), None)
    pi = next((i for i, r in enumerate(peer) if r.contains(dst_lo, dst_hi - dst_lo)), None)
    if li is None or pi is None or local[li].on_gpu != peer[pi].on_gpu:
        return None
    return li, pi


def group_ranges(
    ranges: Sequence[TransferRange],
    local: Sequence[ExportedRegion],
    peer: IpcEndpoint,
    node_name: str,
) -> dict[tuple[int, int], np.ndarray]:
    """A write's ranges as rows (source, destination, length) per (local region index, peer
    region index), every range checked: inside a region on both sides, GPU to GPU or CPU to
    CPU. Vectorised: the host side of a 256-page write must cost far less than its copy."""
    fields = map(_RANGE_FIELDS, ranges)  # C-level: no Python frame a range
    rows = np.fromiter(chain.from_iterable(fields), np.int64, 3 * len(ranges)).reshape(-1, 3)
    pair = _one_pair(rows, local, peer.regions)
    if pair is not None:  # the usual write: one pool into the other, checked by its bounds
        return {pair: rows}
    local_i = _locate(local, rows[:, 0], rows[:, 2])
    peer_i = _locate(peer.regions, rows[:, 1], rows[:, 2])
    outside = (local_i < 0) | (peer_i < 0)
    if outside.any():
        first = int(np.argmax(outside))
        side = "local" if local_i[first] < 0 else f"peer {peer.node_name!r}"
        raise TransferError(
            f"cuda_ipc engine {node_name!r}: range {ranges[first]} lies outside every "
            f"registered {side} region (the peer's regions come from its endpoint)"
        )
    crossing = (
        np.array([r.on_gpu for r in local])[local_i]
        != np.array([r.on_gpu for r in peer.regions])[peer_i]
    )
    if crossing.any():
        first = int(np.argmax(crossing))
        src, dst = local[local_i[first]], peer.regions[peer_i[first]]
        raise TransferError(
            f"cuda_ipc engine {node_name!r}: range {ranges[first]} goes from {src.device} to "
            f"{dst.device}; {BACKEND_FLAG} copies GPU to GPU (KV) and CPU to CPU (aux) only"
        )
    key = local_i * len(peer.regions) + peer_i
    return {divmod(k, len(peer.regions)): rows[key == k] for k in np.unique(key).tolist()}
