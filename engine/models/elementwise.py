"""The decoder layers' elementwise steps: RMSNorm (alone and fused with the residual add),
SiLU(gate) * up (on decode batches fused with the gate_up GEMM before it), and the rotary
embedding of q and k together.

On a CUDA tensor each step is one Triton kernel of `elementwise_kernels` (one pass over memory
where torch's eager version makes four to ten, each a kernel launch). Anywhere else, the
plain-torch references below run: they are what the CPU has always computed, and what the kernels
are checked against (tests/test_elementwise_gpu.py, scripts/gpu/run_all.py). The kernels keep the
references' rounding points: sums in the activation dtype, norms and rotations in fp32, one
rounding back.

`torch_elementwise()` makes the references run on the GPU too, inside a `with` block that does
not nest: the GPU checks and benchmarks compare both paths on the same model.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.gemm_tiles import GATE_UP_SILU_MAX_ROWS, gate_up_silu_tile
from engine.models.gpu_linear import tiles_here

_force_torch = False


@contextmanager
def torch_elementwise() -> Iterator[None]:
    """Run the plain-torch references even on CUDA tensors (for A/B checks and timings)."""
    global _force_torch
    if _force_torch:
        raise RuntimeError("torch_elementwise() blocks do not nest")
    _force_torch = True
    try:
        yield
    finally:
        _force_torch = False


@functools.cache
def _load_kernels() -> ModuleType:
    try:
        from engine.models import elementwise_kernels
    except ImportError as exc:
        raise ImportError(
            f"the fused elementwise kernels on GPU need the package 'triton' (torch's CUDA "
            f"wheels bring it): {exc}"
        ) from exc
    return elementwise_kernels


@functools.cache
def _gemm_kernels() -> ModuleType:
    from engine.models import gpu_linear_kernels

    return gpu_linear_kernels


def _kernels(x: torch.Tensor) -> ModuleType | None:
    return _load_kernels() if x.is_cuda and not _force_torch else None


def kernels_on(x: torch.Tensor) -> bool:
    """Whether `x`'s elementwise steps run as Triton kernels (a CUDA tensor, outside
    `torch_elementwise()`): a caller fusing one of them into its own kernel checks this."""
    return _kernels(x) is not None


# ---- public steps -----------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ops = _kernels(x)
    if ops is None or weight.dtype != x.dtype:
        return rms_norm_reference(x, weight, eps)
    out: torch.Tensor = ops.rms_norm(x, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual): the layer's input to its next block, and the new
    residual stream."""
    ops = _kernels(x)
    if ops is None or weight.dtype != x.dtype:
        return add_rms_norm_reference(x, residual, weight, eps)
    normed, summed = ops.add_rms_norm(x, residual, weight, eps)
    return normed, summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, where `gate_up` [..., 2I] holds gate in its first I columns."""
    ops = _kernels(gate_up)
    if ops is None:
        return silu_and_mul_reference(gate_up)
    out: torch.Tensor = ops.silu_and_mul(gate_up)
    return out


def gate_up_silu(x: torch.Tensor, gate_up_proj: nn.Module) -> torch.Tensor:
    """`silu_and_mul(gate_up_proj(x))`. A decode-sized 16-bit call on CUDA (at most
    GATE_UP_SILU_MAX_ROWS rows, no bias) runs one kernel that streams the gate and up weight
    rows and writes SiLU(gate) * up, rounded where the two steps round (its GEMM sums in
    another order than cuBLAS, so a bf16 gate or up may differ in its last bit)."""
    rows = x.numel() // x.shape[-1]
    weight = getattr(gate_up_proj, "weight", None)  # a CPU backend's packed layer has none
    fusable = (
        _kernels(x) is not None
        and 0 < rows <= GATE_UP_SILU_MAX_ROWS
        and isinstance(weight, torch.Tensor)
        and getattr(gate_up_proj, "bias", None) is None
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
    )
    if not fusable:
        return silu_and_mul(gate_up_proj(x))
    tile = gate_up_silu_tile(rows, tiles_here(x.device))
    out: torch.Tensor = _gemm_kernels().gate_up_silu(x, weight, tile)
    return out


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) RoPE of q [N, Hq, D] and k [N, Hkv, D] at `positions` [N]; the
    tables are [max_positions, D/2]. Returns new contiguous tensors."""
    ops = _kernels(q)
    if ops is None:
        return rotary_reference(q, k, positions, cos_table, sin_table)
    q_out, k_out = ops.rotary(q, k, positions, cos_table, sin_table)
    return q_out, k_out


# ---- plain-torch references -------------------------------------------------------------------
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 whatever the activation dtype, as the HF reference does.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def rotary_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
