"""Triton kernels of the decoder layers' elementwise steps (see `elementwise.py`, whose plain-torch
references they match). Each reads its inputs once and writes its outputs once:

- RMSNorm, optionally fused with the residual add: one program per row (the whole row in
  registers), sum rounded to the activation dtype and stored, norm in fp32;
- SiLU(gate) * up: one program per (row, block of columns) of the gate_up projection's output;
- RoPE: one program per token, rotating all its q heads and k heads with one cos/sin load; the
  inputs may be the strided q/k views of the fused QKV projection's output.

Everything is shape-static per call, so a captured CUDA graph replays them.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from engine.models.dependent_launch import dependent_start, launch_options

SILU_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * rstd).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, w.to(tl.float32) * normed.to(tl.float32), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm_launch(
    x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res_rows = _rows(res) if res is not None else rows
    summed = torch.empty_like(out) if res is not None else out
    n_cols = rows.shape[1]
    if rows.shape[0] == 0:
        return out.view(x.shape), (summed.view(x.shape) if res is not None else None)
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        res_rows,
        weight,
        out,
        summed,
        rows.stride(0),
        res_rows.stride(0),
        out.stride(0),
        summed.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=res is not None,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
        **launch_options(x),
    )
    return out.view(x.shape), (summed.view(x.shape) if res is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out, _ = _norm_launch(x, None, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = _norm_launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed


@triton.jit
def _silu_and_mul_kernel(
    in_ptr, out_ptr, stride_in, stride_out, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    dependent_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(in_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(in_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)  # F.silu rounds to the dtype here
    tl.store(out_ptr + row * stride_out + cols, act.to(tl.float32) * up.to(tl.float32), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows = _rows(gate_up)
    n_cols = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    grid = (rows.shape[0], triton.cdiv(n_cols, SILU_BLOCK))
    if rows.shape[0] == 0:
        return out.view(*gate_up.shape[:-1], n_cols)
    _silu_and_mul_kernel[grid](
        rows, out, rows.stride(0), out.stride(0), n_cols, BLOCK=SILU_BLOCK, num_warps=4,
        **launch_options(gate_up),
    )  # fmt: skip
    return out.view(*gate_up.shape[:-1], n_cols)


@triton.jit
def _rotate_heads(
    in_ptr, out_ptr, t, stride_t, stride_h, stride_ot, stride_oh, cos, sin, mask_d, offs_d,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < NUM_HEADS)[:, None] & mask_d[None, :]
    src = in_ptr + t * stride_t + heads[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, a * cos[None, :] - b * sin[None, :], mask=mask)
    tl.store(dst + HALF, b * cos[None, :] + a * sin[None, :], mask=mask)


@triton.jit
def _rope_at(pos, cos_ptr, sin_ptr, stride_table, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """(cos, sin, mask_d, offs_d) of position `pos` over the first HALF dims, cos/sin in fp32."""
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    cos = tl.load(cos_ptr + pos * stride_table + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_table + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    return cos, sin, mask_d, offs_d


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_table,
    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    dependent_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos, sin, mask_d, offs_d = _rope_at(pos, cos_ptr, sin_ptr, stride_table, HALF, BLOCK_D)
    _rotate_heads(q_ptr, q_out_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  mask_d, offs_d, HQ, BLOCK_HQ, HALF)  # fmt: skip
    _rotate_heads(k_ptr, k_out_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  mask_d, offs_d, HK, BLOCK_HK, HALF)  # fmt: skip


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
    q_out, k_out = (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )
    num_tokens, hq, dim = q.shape
    hk = k.shape[1]
    half = dim // 2
    if num_tokens == 0:
        return q_out, k_out
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_table, sin_table,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_table.stride(0),
        HQ=hq, HK=hk, HALF=half,
        BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
        BLOCK_D=triton.next_power_of_2(half),
        num_warps=4, **launch_options(q),
    )  # fmt: skip
    return q_out, k_out
