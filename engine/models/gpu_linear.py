"""Linear layers on a CUDA GPU with decode-sized GEMMs through the skinny Triton kernel.

`linear_kernel="triton"` (engine/models/linear_backends.py) swaps every nn.Linear of the model
for a `TritonLinear` that shares its weight and bias (no copy: a tied LM head stays tied). On a
GPU model with measured tiles (`gemm_tiles.MEASURED`, written from `scripts/gpu/gemm_chain.py`)
a call runs `gpu_linear_kernels.skinny_linear` where the table says the Triton kernel won for
its weight shape and row count, and cuBLAS (F.linear) everywhere else, prefill chunks included.
On any other GPU the tile comes from the `gemm_tiles.choose_tile` rule up to `max_rows` rows.
The tile of each row count is chosen once, in plain Python, the first time that count is seen
(the warm-up before a CUDA graph capture), so nothing is tuned or synced with the host while a
graph is captured or replayed.

Why: a decode step is a chain of short kernels. With programmatic dependent launch
(engine/models/dependent_launch.py) each Triton kernel starts while the one before it finishes,
which cuBLAS's kernels do not do; with measured tiles the Triton GEMMs stream the weights as fast
as cuBLAS, so the step is shorter by the boundaries they overlap. The engine's default ("auto")
takes this backend on a GPU with measured tiles and keeps cuBLAS on the others.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.gemm_tiles import GemmTile, GpuTiles, TileTable, measured_for, tile_for
from engine.models.linear_backends import swap_linears

# Decode batches up to this many rows take the Triton kernel. Above it the weight tile is read
# by several row tiles, and cuBLAS's larger tiles are the better trade.
MAX_ROWS = 64
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MEASURED_DTYPES = (torch.bfloat16, torch.float16)  # fp32 tiles would need twice the smem


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


def auto_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why linear_kernel "auto" does not take this backend here, or None when it does: it runs
    here, the weights are 16-bit (what the tiles were measured with) and this GPU model has
    measured tiles."""
    reason = unusable_reason(device, dtype)
    if reason is None and dtype not in _MEASURED_DTYPES:
        reason = f"the measured decode tiles are for 16-bit weights (got {dtype})"
    if reason is None and tiles_here(device) is None:
        reason = "no measured decode tiles for this GPU (engine/models/gemm_tiles.py, MEASURED)"
    return reason


def tiles_here(device: torch.device) -> GpuTiles | None:
    """The measured tiles of `device`'s GPU model (None off CUDA or where none were measured)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _tiles_of_device(index)


@functools.cache
def _tiles_of_device(index: int) -> GpuTiles | None:
    return measured_for(torch.cuda.get_device_name(index))


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
    """Replace every nn.Linear in `model` by a TritonLinear; returns how many were replaced.
    Without a `table`, the measured one of the weights' GPU model for 16-bit weights, if any
    (else the rule's tiles)."""
    weight = next(model.parameters(), None)
    if table is None and weight is not None and weight.dtype in _MEASURED_DTYPES:
        measured = tiles_here(weight.device)
        table = measured.linear if measured is not None else None
    return swap_linears(model, lambda linear: TritonLinear(linear, max_rows, table))
