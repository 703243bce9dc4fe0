"""The `cuda_ipc` copy kernel: every range of a write in one launch.

The grid is (chunks of the longest row, rows): program (c, r) copies chunk c of row r (source
chunk, destination chunk, length in chunks; kvtransfer/cuda_ipc_plan.py) from the
source into the destination (a peer's pool mapped through CUDA IPC), `BLOCK` words a step;
programs past their row's end return at once. The chunk size is a compile-time constant and
every address a chunk index times it, so the compiler sees 16-byte-aligned contiguous runs
and issues 128-bit loads and stores; no masks (chunks are whole blocks). The same kernel runs under
Triton's interpreter (`TRITON_INTERPRET=1`) on CPU tensors, which is how
tests/test_cuda_ipc.py checks its page mapping against torch indexing.

`CopyLauncher` is the engine's way in: Triton's JIT entry (`kernel[grid](...)`) binds and
specialises every argument and looks the compiled kernel up on each call (~0.03 ms of host
time a write on an H200 host); the launcher compiles a variant once through `warmup` (the
same specialisation: the word dtype, the chunk and step, whether each pointer is 16-byte
aligned) and then calls the compiled kernel directly with integer addresses on the engine's
stream, with no stream switch.
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
WORD_BYTES = {dtype: size for size, dtype in WORD_DTYPES.items()}


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


def block_words(chunk_words: int, word_bytes: int) -> int:
    """Words a program moves a step: its chunk, at most `MAX_BLOCK_BYTES`."""
    return min(chunk_words, MAX_BLOCK_BYTES // word_bytes)


def variant_key(
    device: int, word: torch.dtype, chunk_words: int, addrs: tuple[int, int, int]
) -> tuple[Any, ...]:
    """What the compiled kernel depends on (Triton's specialisation of these arguments): a
    pointer 16-byte aligned or not is another variant."""
    src, dst, rows = addrs
    return (device, word, chunk_words, src % 16 == 0, dst % 16 == 0, rows % 16 == 0)


class CopyLauncher:
    """The copy kernel launched through its compiled form: one `warmup` per variant (on the
    current device, which must be the copy's), then a direct launch."""

    def __init__(self) -> None:
        self._compiled: dict[tuple[Any, ...], tuple[Any, int]] = {}

    def launch(
        self,
        stream: int,
        device: int,
        word: torch.dtype,
        addrs: tuple[int, int, int],
        chunk_words: int,
        grid: tuple[int, int],
    ) -> None:
        """Queue the kernel on `stream` (a CUstream handle) of `device` (the current one):
        `addrs` = (source, destination, row table on the device); `grid` = (chunks of the
        longest row, rows), rows at most `MAX_GRID_ROWS`."""
        key = variant_key(device, word, chunk_words, addrs)
        compiled = self._compiled.get(key)
        if compiled is None:
            src, dst, rows = addrs
            block = block_words(chunk_words, WORD_BYTES[word])
            kernel = _copy_rows_kernel.warmup(
                DevicePointer(src, word),
                DevicePointer(dst, word),
                DevicePointer(rows, torch.int64),
                CHUNK=chunk_words,
                BLOCK=block,
                num_warps=NUM_WARPS,
                grid=(1,),
            )
            compiled = self._compiled[key] = (kernel, block)
        kernel, block = compiled
        kernel[(grid[0], grid[1], 1)](*addrs, chunk_words, block, stream=stream)


def copy_rows(src: Any, dst: Any, rows: torch.Tensor, chunk_words: int, max_chunks: int) -> None:
    """Queue the copy of every row of `rows` (int64 [n, 3] on the device: source chunk,
    destination chunk, length in chunks, none above `max_chunks`; a chunk is `chunk_words`
    words) on the current stream. `src`, `dst`: tensors or `DevicePointer`s of the word
    dtype, at chunk 0."""
    if rows.dim() != 2 or rows.shape[1] != 3:
        raise ValueError(f"rows must be [n, 3], got {tuple(rows.shape)}")
    if chunk_words <= 0 or chunk_words & (chunk_words - 1):
        raise ValueError(f"chunk_words must be a power of two, got {chunk_words}")
    block = block_words(chunk_words, torch.empty((), dtype=src.dtype).element_size())
    for first in range(0, rows.shape[0], MAX_GRID_ROWS):
        part = rows[first : first + MAX_GRID_ROWS]
        _copy_rows_kernel[(max_chunks, part.shape[0])](
            src, dst, part, CHUNK=chunk_words, BLOCK=block, num_warps=NUM_WARPS
        )
