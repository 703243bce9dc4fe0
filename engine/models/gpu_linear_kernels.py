"""Triton kernels of the skinny GEMM `out[M, N] = x[M, K] @ w[N, K]^T (+ bias)` for decode batches.

Stage 1 (`_skinny_gemm_kernel`): one program per (row tile, BLOCK_N weight rows, K slice); it
streams its [BLOCK_N, K slice] of the weight once through `tl.dot` (tiles >= 16, products
accumulated in fp32). Without split-K the program adds the bias and stores the output in the
activation dtype. With split-K each slice stores its fp32 partial into a [SPLIT_K, M, N]
workspace and stage 2 (`_splitk_reduce_kernel`) sums the slices in a fixed order, adds the bias
and rounds once.

Why a second pass and not fp32 atomic adds into a zeroed output: the sum's order is fixed, so a
request's logits do not depend on which other requests share its batch or on timing (greedy
output stays reproducible), and no memset plus cast kernels are needed around the atomics.
The partials are small (16 rows x 4096 x 4 slices x 4 bytes = 1 MiB) and stay in L2.

`_gate_up_silu_kernel` is the gated MLP's first half in one pass: each program streams the gate
rows and the up rows of the same output columns and writes `SiLU(gate) * up`, rounded where
`elementwise.silu_and_mul` rounds (gate and up to the activation dtype, then SiLU, then the
product), so the [M, 2I] gate_up output never goes to memory and the SiLU launch is gone.

Every size is fixed by (M, N, K, tile): nothing syncs with the host and nothing is tuned at
launch, so a captured CUDA graph replays these launches. The tile comes from `gemm_tiles`.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from engine.models.dependent_launch import dependent_start, launch_options
from engine.models.gemm_tiles import GemmTile

REDUCE_BLOCK = 1024


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [N, K], unit stride along K
    bias_ptr,  # [N] or a dummy when HAS_BIAS is False
    out_ptr,  # [M, N] (SPLIT_K == 1) or the fp32 workspace [SPLIT_K, M, N]
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: every K block is whole, no mask along K
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: every weight row exists
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_start(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # The weight, read once, is the whole cost: unmasked (vectorised) loads where the
        # shape allows; the activation rows are few and always masked.
        if EVEN_K:
            a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_rows + offs_k[None, :])
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
        else:
            mask_k = offs_k < k_end
            a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + split.to(tl.int64) * M * N + out_offs, acc, mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    part_ptr,  # [SPLIT_K, M, N] fp32, contiguous
    bias_ptr,
    out_ptr,  # [M, N] contiguous
    M,
    N,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_start(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    total = M * N
    mask = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _dot_precision(x: torch.Tensor) -> str:
    """fp32 inputs get exact fp32 products (not tf32); 16-bit inputs ignore the setting."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _rows(x: torch.Tensor, weight: torch.Tensor, who: str) -> torch.Tensor:
    """x [..., K] as [M, K] with unit stride along K; the weight must have it already."""
    if weight.stride(-1) != 1:
        raise ValueError(f"{who} needs a weight with unit stride along K")
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: GemmTile
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [..., K] through the skinny kernels with `tile`."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2d = _rows(x, weight, "skinny_linear")
    m = x2d.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    splits = tile.num_splits(k)
    has_bias = bias is not None
    bias_arg = bias if bias is not None else out
    target = out
    if splits > 1:
        target = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _skinny_gemm_kernel[tile.grid(m, n, k)](
        x2d, weight, bias_arg, target, m, n, k, tile.k_per_split(k),
        x2d.stride(0), weight.stride(0), n,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SPLIT_K=splits,
        HAS_BIAS=has_bias and splits == 1, EVEN_K=k % tile.block_k == 0,
        EVEN_N=n % tile.block_n == 0, DOT_PRECISION=_dot_precision(x),
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(x),
    )  # fmt: skip
    if splits > 1:
        _splitk_reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            target, bias_arg, out, m, n,
            SPLIT_K=splits, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK, num_warps=4,
            **launch_options(x),
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # [2 INTER, K]: the gate rows, then the up rows
    out_ptr,  # [M, INTER]
    M,
    INTER,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_start(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < INTER
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    gate_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K and EVEN_N:
            a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            wg = tl.load(gate_rows + offs_k[None, :])
            wu = tl.load(up_rows + offs_k[None, :])
        else:
            mask_k = offs_k < K
            a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            mask_w = mask_n[:, None] & mask_k[None, :]
            wg = tl.load(gate_rows + offs_k[None, :], mask=mask_w, other=0.0)
            wu = tl.load(up_rows + offs_k[None, :], mask=mask_w, other=0.0)
        acc_gate += tl.dot(a, tl.trans(wg), input_precision=DOT_PRECISION)
        acc_up += tl.dot(a, tl.trans(wu), input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # F.silu rounds to the dtype here
    out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(out_ptr + out_offs, act.to(tl.float32) * up, mask=mask)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, tile: GemmTile) -> torch.Tensor:
    """`silu_and_mul(F.linear(x, weight))` for a gate_up weight [2I, K] (gate rows first) and x
    [..., K], in one kernel with `tile` (its split_k must be 1: the SiLU needs whole sums)."""
    if tile.split_k != 1:
        raise ValueError(f"gate_up_silu needs a tile without split-K, got {tile.describe()}")
    k = x.shape[-1]
    inter = weight.shape[0] // 2
    x2d = _rows(x, weight, "gate_up_silu")
    m = x2d.shape[0]
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], inter)
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(inter, tile.block_n))
    _gate_up_silu_kernel[grid](
        x2d, weight, out, m, inter, k, x2d.stride(0), weight.stride(0), inter,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        EVEN_K=k % tile.block_k == 0, EVEN_N=inter % tile.block_n == 0,
        DOT_PRECISION=_dot_precision(x),
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(x),
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], inter)
