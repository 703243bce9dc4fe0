"""The `cuda_ipc` copy kernel: every chunk of a write in one launch.

Program i copies chunk `src_chunks[i]` of the source into chunk `dst_chunks[i]` of the
destination (a peer's pool mapped through CUDA IPC), `BLOCK` words at a time. The chunk size is
a compile-time constant and every chunk starts at a multiple of it, so the compiler sees
16-byte-aligned contiguous runs and issues 128-bit loads and stores; no masks (chunks are whole
blocks). The same kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`) on CPU tensors,
which is how tests/test_cuda_ipc.py checks its page mapping against torch indexing.
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

MAX_BLOCK_BYTES = 8 << 10  # per loop step: 128 threads x 4 x 16 bytes
NUM_WARPS = 4
WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_chunks_kernel(src, dst, src_chunks, dst_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    src_start = tl.load(src_chunks + i).to(tl.int64) * CHUNK
    dst_start = tl.load(dst_chunks + i).to(tl.int64) * CHUNK
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


def copy_chunks(
    src: Any, dst: Any, src_chunks: torch.Tensor, dst_chunks: torch.Tensor, chunk_words: int
) -> None:
    """Queue the copy of `len(src_chunks)` chunks of `chunk_words` words on the current stream.
    `src`, `dst`: tensors or `DevicePointer`s of the word dtype, at chunk index 0."""
    if src_chunks.shape != dst_chunks.shape or src_chunks.dim() != 1:
        raise ValueError(f"chunk lists differ: {src_chunks.shape} vs {dst_chunks.shape}")
    if chunk_words <= 0 or chunk_words & (chunk_words - 1):
        raise ValueError(f"chunk_words must be a power of two, got {chunk_words}")
    if src_chunks.numel() == 0:
        return
    word = torch.empty((), dtype=src.dtype).element_size()
    block = min(chunk_words, MAX_BLOCK_BYTES // word)
    _copy_chunks_kernel[(src_chunks.numel(),)](
        src, dst, src_chunks, dst_chunks, CHUNK=chunk_words, BLOCK=block, num_warps=NUM_WARPS
    )
