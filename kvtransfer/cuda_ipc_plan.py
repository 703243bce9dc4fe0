"""The pure parts of the `cuda_ipc` backend: its endpoint, and a write planned as equal chunks.

No CUDA here (the tests run it on a CPU):

- `IpcEndpoint`: what the receiver publishes through bootstrap (its `local_endpoint()`): the
  host it runs on (the kernel's boot id: CUDA IPC and `process_vm_writev` work within one
  host only), its pid (for the CPU aux slots), and per registered region its address, length,
  device and, for GPU memory, the CUDA IPC handle of the allocation holding it with the
  region's offset inside that allocation.
- `group_ranges`: a write's ranges as one array per (local region, peer region), each range
  checked (inside a region on both sides; GPU to GPU or CPU to CPU). The usual write (one
  pool into the other) is checked by its bounds: a handful of numpy reductions over all
  ranges, not a test per range.
- `plan_pages`: the page-index form of a write (source and destination page ids, one page
  size, the two pools' page-0 addresses): checked by its smallest and largest page ids and
  planned straight into the kernel's rows, without a range object per page.
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
from pathlib import Path

import numpy as np

from kvtransfer.base import (
    MemoryRegion,
    RangeColumns,
    TransferError,
    TransferRange,
    columns_of,
    holding_regions,
)

BACKEND_FLAG = "--transfer-backend cuda_ipc"
# Measured on one H200 (scripts/gpu/tune_ipc_copy.py): 16 KiB a program, 4 KiB a step, 8 warps
# copied 256 scattered 2 MiB pages in 0.284 ms, 94% of torch's contiguous copy.
MAX_CHUNK_BYTES = 16 << 10
# Rows longer than this are cut, so that the grid (longest row's chunks x rows) wastes few
# programs on short rows beside a long one.
MAX_PIECE_BYTES = 2 << 20
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
ADDRESS_LIMIT = 1 << 62  # no memory lies above; below it, start + length fits in int64


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
    the chunk and vectorises); `plan_copy` cuts rows longer than `MAX_PIECE_BYTES`, a page
    plan's rows are its pages."""

    chunk_bytes: int
    word_bytes: int  # the kernel's element: 8 bytes unless the chunks or the bases forbid it
    rows: np.ndarray  # int64 [n, 3], in chunks
    longest: int = -1  # chunks of the longest row where the planner knows it, else -1

    @property
    def chunk_words(self) -> int:
        return self.chunk_bytes // self.word_bytes

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def max_chunks(self) -> int:
        """Chunks of the longest row: the grid's first dimension."""
        if self.longest >= 0:
            return self.longest
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
    addresses the offsets are relative to (the kernel's words must be aligned in memory)."""
    rows = np.asarray(ranges, dtype=np.int64).reshape(-1, 3)
    return plan_columns(rows.T, align, max_chunk, max_piece)


def plan_columns(
    columns: np.ndarray,
    align: Sequence[int] = (),
    max_chunk: int = MAX_CHUNK_BYTES,
    max_piece: int = MAX_PIECE_BYTES,
    out: np.ndarray | None = None,
) -> CopyPlan:
    """`plan_copy` on int64 [3, n] columns (source offsets, destination offsets, lengths),
    into `out` (int64 [>= rows, 3], e.g. a pinned upload buffer) when it is given and large
    enough. Vectorised along the ranges, without a per-chunk list: five numpy calls when no
    range needs cutting (256 ranges: a few microseconds)."""
    if max_chunk <= 0 or max_chunk & (max_chunk - 1):
        raise ValueError(f"max_chunk must be a power of two, got {max_chunk}")
    n = columns.shape[1]
    if not n:
        return CopyPlan(max_chunk, lowest_bit(max_chunk | _or(align), 8), _rows(0, None))
    low = columns.min(axis=1)
    if low[0] < 0 or low[1] < 0 or low[2] <= 0:
        raise ValueError(
            f"ranges need non-negative offsets and positive lengths: {columns.T[:4].tolist()}"
        )
    chunk = lowest_bit(int(np.bitwise_or.reduce(columns, axis=None)), max_chunk)
    word = lowest_bit(chunk | _or(align), 8)
    piece = max(max_piece - max_piece % chunk, chunk)
    shift = chunk.bit_length() - 1
    longest = int(columns[2].max())
    if longest > piece:
        cut = split_rows(columns.T, piece)
        rows = _rows(len(cut), out)
        np.right_shift(cut, shift, out=rows)
        longest = piece
    else:
        rows = _rows(n, out)
        np.right_shift(columns, shift, out=rows.T)
    return CopyPlan(chunk, word, rows, longest >> shift)


def _rows(n: int, out: np.ndarray | None) -> np.ndarray:
    if out is not None and len(out) >= n:
        return out[:n]
    return np.empty((n, 3), dtype=np.int64)


def lowest_bit(value: int, cap: int) -> int:
    """The largest power of two <= `cap` (a power of two) dividing `value` (any, if 0)."""
    value |= cap
    return value & -value


def _or(values: Sequence[int]) -> int:
    out = 0
    for v in values:
        out |= v
    return out


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


def _holder(regions: Sequence[ExportedRegion], lo: int, hi: int) -> int | None:
    """The index of the first region holding all of [lo, hi), or None."""
    for i, region in enumerate(regions):
        if region.addr <= lo and hi <= region.addr + region.length:
            return i
    return None


def _one_pair(
    columns: np.ndarray,
    low: np.ndarray,
    local: Sequence[ExportedRegion],
    peer: Sequence[ExportedRegion],
) -> tuple[int, int] | None:
    """(local region, peer region) holding every range, both GPU or both CPU; None when the
    ranges span regions (or none holds them: the per-range checks then say which). `low`:
    the columns' minima. One more numpy reduction whatever the number of ranges: the highest
    end on each side (a region is one interval: holding the lowest start and the highest
    end, it holds every range)."""
    high = (columns[:2] + columns[2]).max(axis=1)
    li = _holder(local, int(low[0]), int(high[0]))
    pi = _holder(peer, int(low[1]), int(high[1]))
    if li is None or pi is None or local[li].on_gpu != peer[pi].on_gpu:
        return None
    return li, pi


def _check_lengths_and_limits(
    columns: np.ndarray, low: np.ndarray, ranges: Sequence[TransferRange], node_name: str
) -> None:
    """Positive lengths, and addresses and lengths below 2**62: then no start + length
    overflows int64, which would let a range's end wrap below its region's end."""
    if low[2] > 0 and int(columns.max()) < ADDRESS_LIMIT:
        return
    bad = (columns >= ADDRESS_LIMIT).any(axis=0) | (columns[2] <= 0)
    raise TransferError(
        f"cuda_ipc engine {node_name!r}: range {ranges[int(np.argmax(bad))]} has a length "
        f"<= 0 or an address or length >= 2**62; no registered region holds it"
    )


def ranges_to_columns(ranges: Sequence[TransferRange]) -> np.ndarray:
    """int64 [3, n], the caller's to change: source addresses, destination addresses, lengths
    (`columns_of`: one C-level pass per field, no Python frame or tuple per range; a
    RangeColumns' own, copied). Columns, not rows: numpy reduces a [3, n] array along its rows
    several times faster than a [n, 3] one down its columns."""
    columns = columns_of(ranges)
    return columns.copy() if isinstance(ranges, RangeColumns) else columns  # ours to change


def group_ranges(
    ranges: Sequence[TransferRange],
    local: Sequence[ExportedRegion],
    peer: IpcEndpoint,
    node_name: str,
) -> dict[tuple[int, int], np.ndarray]:
    """A write's ranges as columns (sources, destinations, lengths: int64 [3, n]) per (local
    region index, peer region index), every range checked: inside a region on both sides,
    GPU to GPU or CPU to CPU. The usual write (one pool into the other) is checked by its
    bounds; only a write spanning regions (or refused) is checked range by range."""
    columns = ranges_to_columns(ranges)
    if not len(ranges):
        return {}
    low = columns.min(axis=1)
    _check_lengths_and_limits(columns, low, ranges, node_name)
    pair = _one_pair(columns, low, local, peer.regions)
    if pair is not None:  # the usual write: one pool into the other, checked by its bounds
        return {pair: columns}
    local_i, peer_i = holding_regions(
        local, peer.regions, columns, ranges,
        f"cuda_ipc engine {node_name!r}", peer.node_name, "endpoint",
    )  # fmt: skip
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
    return {divmod(k, len(peer.regions)): columns[:, key == k] for k in np.unique(key).tolist()}


@dataclass(frozen=True)
class PagePlan:
    """A page-index write planned: the pair of regions it stays in, and its rows."""

    local_index: int
    peer_index: int
    plan: CopyPlan


def plan_pages(
    src_pages: Sequence[int] | np.ndarray,
    dst_pages: Sequence[int] | np.ndarray,
    page_bytes: int,
    bases: tuple[int, int],
    local: Sequence[ExportedRegion],
    peer: Sequence[ExportedRegion],
    align: Sequence[int] = (),
    out: np.ndarray | None = None,
) -> PagePlan | None:
    """Whole pages: page `s` at `bases[0] + s * page_bytes` here to page `d` at `bases[1] +
    d * page_bytes` in the peer, one kernel row a page. Checked by the smallest and largest
    page id on each side: when both ends lie in one GPU region (an interval), every page
    between does. None when they do not (pages beyond a pool, several regions, CPU memory,
    nothing to write): the caller then takes the range path, whose per-range checks name the
    offending range. `align`: the base addresses the kernel's words are relative to; `out`:
    an int64 [>= n, 3] buffer to plan into (a pinned upload buffer), else a new array."""
    src, dst = _page_ids(src_pages), _page_ids(dst_pages)
    if src.ndim != 1 or src.shape != dst.shape:
        raise ValueError(f"{src.shape} source pages but {dst.shape} destination pages")
    n = len(src)
    if not n or page_bytes <= 0:
        return None
    src_base, dst_base = bases
    pair = page_regions(src, dst, page_bytes, bases, local, peer)
    if pair is None:
        return None
    li, pi = pair
    src_offset, dst_offset = src_base - local[li].addr, dst_base - peer[pi].addr
    chunk = lowest_bit(page_bytes | src_offset | dst_offset, MAX_CHUNK_BYTES)
    per_page = page_bytes // chunk
    rows = _rows(n, out)
    np.multiply(src, per_page, out=rows[:, 0])
    np.multiply(dst, per_page, out=rows[:, 1])
    if src_offset:
        rows[:, 0] += src_offset // chunk
    if dst_offset:
        rows[:, 1] += dst_offset // chunk
    rows[:, 2] = per_page
    return PagePlan(li, pi, CopyPlan(chunk, lowest_bit(chunk | _or(align), 8), rows, per_page))


def page_regions(
    src: np.ndarray,
    dst: np.ndarray,
    page_bytes: int,
    bases: tuple[int, int],
    local: Sequence[ExportedRegion],
    peer: Sequence[ExportedRegion],
) -> tuple[int, int] | None:
    """(local region, peer region) holding every page of a page-id write (int64 id arrays,
    not empty), both on a GPU; None otherwise. Checked by the smallest and largest page id
    on each side: a region is one interval."""
    src_base, dst_base = bases
    li = _holder(local, src_base + int(src.min()) * page_bytes,
                 src_base + (int(src.max()) + 1) * page_bytes)  # fmt: skip
    pi = _holder(peer, dst_base + int(dst.min()) * page_bytes,
                 dst_base + (int(dst.max()) + 1) * page_bytes)  # fmt: skip
    if li is None or pi is None or not (local[li].on_gpu and peer[pi].on_gpu):
        return None
    return li, pi


def page_ids(pages: Sequence[int] | np.ndarray) -> np.ndarray:
    """Page ids as an int64 array (no copy of one already)."""
    return _page_ids(pages)


def _page_ids(pages: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(pages, np.ndarray):
        return pages.astype(np.int64, copy=False)
    if isinstance(pages, list):  # fromiter reads a list of ints twice as fast as asarray
        return np.fromiter(pages, np.int64, len(pages))
    return np.asarray(pages, dtype=np.int64)
