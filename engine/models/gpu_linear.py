"""Linear layers on a CUDA GPU with decode-sized GEMMs through the skinny Triton kernel.

`linear_kernel="triton"` (engine/models/linear_backends.py) swaps every nn.Linear of the model
for a `TritonLinear` that shares its weight and bias (no copy: a tied LM head stays tied). A call
with at most `max_rows` rows (a decode batch) runs `gpu_linear_kernels.skinny_linear` with the
tile `gemm_tiles.choose_tile` picks for its shape; larger calls (prefill chunks) stay on cuBLAS
through F.linear, which is at its best there. The tile of each row count is chosen once, in
plain Python, the first time that count is seen (the warm-up before a CUDA graph capture), so
nothing is tuned or synced with the host while a graph is captured or replayed.

Why: at B=64 on an H100 cuBLAS streams the Llama-3-8B decode weights at 75-90% of the copy
bandwidth (benchmarks/gpu-2026-11-26-decode-accounting-h100.md); `python -m
scripts.gpu.tune_decode_kernels` times both per shape. The engine's default ("auto") keeps cuBLAS
on CUDA until that table shows the Triton kernel winning.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.gemm_tiles import GemmTile, TileTable, tile_for
from engine.models.linear_backends import swap_linears

# Decode batches up to this many rows take the Triton kernel. Above it the weight tile is read
# by several row tiles, and cuBLAS's larger tiles are the better trade.
MAX_ROWS = 64
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def unusable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why linear_kernel 'triton' cannot run here, or None when it can."""
    if device.type != "cuda":
        return f"needs a CUDA device (got {device})"
    if dtype not in _DTYPES:
        return f"needs bfloat16, float16 or float32 weights (got {dtype})"
    try:
        _kernels()
    except ImportError as exc:
        return f"needs the package 'triton' (torch's CUDA wheels bring it): {exc}"
    return None


@functools.cache
def _kernels() -> ModuleType:
    from engine.models import gpu_linear_kernels

    return gpu_linear_kernels


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter on CPU tensors (tests): any small count
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


class TritonLinear(nn.Module):
    """`F.linear(x, weight, bias)`; decode-sized calls through the skinny Triton GEMM: rows
    <= max_rows with the rule's tile, or as a measured `table` says for this weight's shape."""

    def __init__(
        self, linear: nn.Linear, max_rows: int = MAX_ROWS, table: TileTable | None = None
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the same Parameter: tied weights stay tied
        self.bias = linear.bias
        self.max_rows = max_rows
        self.table = table
        self._tiles: dict[int, GemmTile | None] = {}

    def tile_for(self, rows: int) -> GemmTile | None:
        """The tile a call of `rows` rows runs with; None: F.linear (cuBLAS) takes it."""
        if rows == 0:
            return None
        if rows not in self._tiles:
            n, k = self.weight.shape
            sms = _num_sms(self.weight.device)
            self._tiles[rows] = tile_for(rows, n, k, sms, self.max_rows, self.table)
        return self._tiles[rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        tile = self.tile_for(rows)
        if tile is None:
            return F.linear(x, self.weight, self.bias)
        out: torch.Tensor = _kernels().skinny_linear(x, self.weight, self.bias, tile)
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"Triton up to {self.max_rows} rows{', measured tiles' if self.table else ''}"
        )


@torch.no_grad()
def replace_linears(
    model: nn.Module, max_rows: int = MAX_ROWS, table: TileTable | None = None
) -> int:
    """Replace every nn.Linear in `model` by a TritonLinear; returns how many were replaced."""
    return swap_linears(model, lambda linear: TritonLinear(linear, max_rows, table))
