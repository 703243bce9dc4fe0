"""The `cuda_ipc` copy kernel: every range of a write in one launch.

The grid is (chunks of the longest row, rows): program (c, r) copies chunk c of row r (source
chunk, destination chunk, length in chunks; kvtransfer/cuda_ipc_plan.py) from the
source into the destination (a peer's pool mapped through CUDA IPC), `BLOCK` words a step;
programs past their row's end return at once. The chunk size is a compile-time constant and
every address a chunk index times it, so the compiler sees 16-byte-aligned contiguous runs
and issues 128-bit loads and stores; no masks (chunks are whole blocks). The same kernel runs under
Triton's interpreter (`TRITON_INTERPRET=1`) on CPU tensors, which is how
tests/test_cuda_ipc.py checks its page mapping against torch indexing.
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

# Measured on one H200 (scripts/gpu/tune_ipc_copy.py): 4 KiB a step, 8 warps (256 threads, one
# 16-byte load and store each a step) was the fastest of the sweep.
MAX_BLOCK_BYTES = 4 << 10
NUM_WARPS = 8
MAX_GRID_ROWS = 65535  # CUDA's limit on a grid's second dimension
WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_rows_kernel(src, dst, rows, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    row = rows + tl.program_id(1).to(tl.int64) * 3
    if chunk < tl.load(row + 2):
        src_start = (tl.load(row) + chunk) * CHUNK
        dst_start = (tl.load(row + 1) + chunk) * CHUNK
        offsets = tl.arange(0, BLOCK)
        for step in tl.static_range(0, CHUNK, BLOCK):
            words = tl.load(src + src_start + step + offsets)
            tl.store(dst + dst_start + step + offsets, words)


class DevicePointer:
    """A raw device address typed for Triton (it takes anything with `data_ptr` and `dtype`):
    the peer's pool mapped through IPC is no torch tensor."""

    def __init__(self, addr: int, dtype: torch.dtype) -> None:
        self.addr = addr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.addr


def copy_rows(src: Any, dst: Any, rows: torch.Tensor, chunk_words: int, max_chunks: int) -> None:
    """Queue the copy of every row of `rows` (int64 [n, 3] on the device: source chunk,
    destination chunk, length in chunks, none above `max_chunks`; a chunk is `chunk_words`
    words) on the current stream. `src`, `dst`: tensors or `DevicePointer`s of the word
    dtype, at chunk 0."""
    if rows.dim() != 2 or rows.shape[1] != 3:
        raise ValueError(f"rows must be [n, 3], got {tuple(rows.shape)}")
    if chunk_words <= 0 or chunk_words & (chunk_words - 1):
        raise ValueError(f"chunk_words must be a power of two, got {chunk_words}")
    word = torch.empty((), dtype=src.dtype).element_size()
    block = min(chunk_words, MAX_BLOCK_BYTES // word)
    for first in range(0, rows.shape[0], MAX_GRID_ROWS):
        part = rows[first : first + MAX_GRID_ROWS]
        _copy_rows_kernel[(max_chunks, part.shape[0])](
            src, dst, part, CHUNK=chunk_words, BLOCK=block, num_warps=NUM_WARPS
        )
