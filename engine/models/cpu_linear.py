"""Linear layers on the CPU through oneDNN, with each weight packed once when the model loads.

Why: torch's CPU `F.linear` goes to MKL's sgemm, which on this project's dev/CI CPUs (AMD EPYC,
AVX-512) runs 2.3-3.4x slower than oneDNN's inner product over a weight reordered once into its
blocked layout (SmolLM2-135M's linears, fp32, 2 threads: 1 row 28.9 -> 9.8 ms, 16 rows 58.1 ->
17.2 ms, 2,048 rows 2,723 -> 1,158 ms; `python -m scripts.bench.linear`,
benchmarks/cpu-2026-11-24.md).
The packed weight is an opaque oneDNN tensor: the layer keeps it instead of its plain weight, so
the model's memory does not grow (a tied LM head is the exception: the embedding keeps the plain
matrix and the head a packed copy). Results differ from MKL's only in summation order (~1e-6).

Row buckets: oneDNN builds kernels per row count, and each new count leaves memory behind: 1,000
random counts of 1-2,048 rows through one layer's linears grew a process by 2.0 GiB, still
growing at the end. So a GEMM of more than 32 rows is padded with zero rows up to one of 8
buckets per power of two (at most 12.5% more rows; 80 counts up to 2,048): the same stream then
levels off at +203 MiB. Up to 32 rows (decode batches) the count stays exact.

`EngineConfig.linear_kernel` chooses (engine/models/linear_backends.py, where this module is the
"onednn" backend): "onednn" packs, "aten" keeps nn.Linear, "auto" packs on the CPU for
float32/bfloat16 when this torch build has the oneDNN ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.linear_backends import check_linear_kernel, swap_linears

_PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Row-count hint for the reorder; the packed layout serves any row count (hints of 64, 256 and
# 2,048 timed alike at 16-2,048 rows).
_ROWS_HINT = 256
_EXACT_ROWS = 32  # row counts up to this run unpadded (see "Row buckets" above)


def onednn_linear_available() -> bool:
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def onednn_dtype_supported(dtype: torch.dtype) -> bool:
    """float32 always; bfloat16 only on CPUs with the instructions oneDNN's bf16 path needs
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): elsewhere packing a bf16 weight raises."""
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def unusable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why oneDNN packing cannot run here, or None when it can (the registry's question)."""
    available = onednn_linear_available()
    on_cpu = device.type == "cpu" and dtype in _PACKED_DTYPES
    if on_cpu and available and onednn_dtype_supported(dtype):
        return None
    bf16 = available and onednn_dtype_supported(torch.bfloat16)
    return (
        f"needs the CPU, float32 or bfloat16 (bfloat16 only where this CPU has oneDNN's bf16 "
        f"instructions) and a torch build with oneDNN (device {device}, dtype {dtype}, oneDNN "
        f"ops {'present' if available else 'missing'}, bf16 instructions "
        f"{'present' if bf16 else 'missing'})"
    )


def wants_packed_linears(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `kernel` (one of LINEAR_KERNELS) packs the linears of a model on `device`."""
    check_linear_kernel(kernel)
    if kernel not in ("auto", "onednn"):
        return False
    reason = unusable_reason(device, dtype)
    if kernel == "onednn" and reason is not None:
        raise ValueError(f"linear_kernel 'onednn' {reason}; use 'auto' or 'aten'")
    return reason is None


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held in oneDNN's packed layout (no plain copy kept)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        rows = x2d.shape[0]
        padded = bucket_rows(rows)
        if padded != rows:
            x2d = F.pad(x2d, (0, 0, 0, padded - rows))  # zero rows, one new tensor
        out = torch.ops.mkldnn._linear_pointwise(x2d, self.packed_weight, self.bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


def bucket_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at: at most 12.5% more, few distinct values."""
    if rows <= _EXACT_ROWS:
        return rows
    step = (1 << (rows.bit_length() - 1)) // 8
    return -(-rows // step) * step


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear; returns how many were packed."""
    return swap_linears(model, PackedLinear)


replace_linears = pack_linears  # the registry's name for what this backend does at load
