"""Triton kernels of the in-house GPU attention backend: paged decode and paged extend.

Both read K/V straight from the paged cache (`PagedKVCache`): a token at location `loc` of layer
`l` lives at `base_l + (loc // PAGE_SIZE) * stride_page + (loc % PAGE_SIZE) * stride_token +
head * stride_head`, where `base_l` is the layer's K (or V) view. `triton_reference.py` computes
the same thing in plain torch with the same index math, split boundaries and merge, so the logic
is tested on CPU; this file needs a GPU and Triton.

- Decode (one new token per request): split-KV "flash decoding". Stage 1 runs one program per
  (request, kv head, split) for all query heads of that kv head's group at once (GQA: the group is
  padded to 16 rows for `tl.dot`), writes a partial output and its log-sum-exp; stage 2 merges the
  splits. Every shape is fixed by (batch, splits), so a CUDA graph can replay it.
- Extend (a chunk of new tokens on top of a cached prefix): one program per (request, kv head,
  block of new tokens), its tile's rows being those tokens times the kv head's query heads;
  keys before the block need no causal mask, the diagonal part does.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from engine.attention.triton_reference import (
    DEFAULT_DECODE_TUNING,
    DecodePlan,
    ExtendPlan,
    KVStrides,
    NewToken,
)
from engine.models.dependent_launch import dependent_start, launch_options
from engine.models.elementwise_kernels import _rope_at, _rotate_heads

_LOG2E = 1.4426950408889634

# Launch settings, chosen with scripts/gpu/tune_attention.py on an H100 (2026-11-22): per layer
# of Llama-3-8B shapes at context 1k, decode B=256 393 us (93% of copy bandwidth; the first
# setting, BLOCK_N 64 with 2 stages, took 481 us), B=64 112 us (81%); a fresh 4k extend 0.57 ms,
# 241 TFLOP/s (one query head per tile: 0.56 ms; K/V traffic is not what limits it), where
# torch's SDPA on contiguous K/V takes 0.26 ms. (The knobs, split count included, are
# `triton_reference.DecodeTuning`; scripts/gpu/tune_decode_kernels.py sweeps them.)
DECODE_CONFIG = DEFAULT_DECODE_TUNING.launch_config()
# Extend, re-tuned on an H200 (2026-11-23) once the chunk's own keys came from the packed K/V
# inputs: a fresh 4k extend 0.416 ms, 331 TFLOP/s (0.64 ms with the H100 setting below, which
# fp32 models keep: three stages of fp32 tiles exceed the shared memory).
EXTEND_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
EXTEND_CONFIG_FP32 = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 1}


@triton.jit
def _attend_key_block(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, mask_n, visible, sm_scale_log2, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One block of keys into the online softmax of q's rows (log2 domain): K^T read at `k_ptrs`
    [HEAD_DIM, BLOCK_N], V at `v_ptrs` [BLOCK_N, HEAD_DIM]; `mask_n` marks the keys that exist,
    `visible` ([rows or 1, BLOCK_N]) those each row may see. Returns the new (acc, m_i, l_i)."""
    k = tl.load(k_ptrs, mask=mask_n[None, :], other=0.0)
    qk = tl.dot(q, k, input_precision=DOT_PRECISION) * sm_scale_log2
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _visible(mask_n, pos, q_pos, CAUSAL: tl.constexpr):
    """Which keys (at `pos`) each query row (at `q_pos`) sees: all that exist, or, when CAUSAL,
    those not after the row's own position."""
    visible = mask_n[None, :]
    if CAUSAL:
        visible = visible & (pos[None, :] <= q_pos[:, None])
    return visible


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # layer's K view, addressed by page/offset/head strides
    v_ptr,
    table_ptr,  # req_to_token [slots, max_ctx] int64
    slots_ptr,  # [B] int32
    seq_lens_ptr,  # [B] int32
    mid_o_ptr,  # [B, Hq, S, D] fp32
    mid_lse_ptr,  # [B, Hq, S] fp32
    o_ptr,  # [B, Hq, D]: written here directly when NUM_SPLITS == 1 (no merge)
    new_k_ptr,  # ROPE: the new tokens' K and V before RoPE [B, Hkv, D], any row/head strides
    new_v_ptr,
    pos_ptr,  # ROPE: [B] positions
    cos_ptr,  # ROPE: [max_positions, HEAD_DIM / 2] tables
    sin_ptr,
    pages_ptr,  # ROPE: [B] where each new token's K/V goes
    offsets_ptr,
    sm_scale_log2,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_cs,
    stride_table,
    stride_page,
    stride_tok,
    stride_head,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_start(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    split_len = tl.cdiv(seq_len, NUM_SPLITS)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_h
    mask_h = offs_h < GROUP
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    if ROPE:
        # RoPE and the KV write of the new token, in this kernel instead of two launches before
        # it: the group's q heads are rotated into `out` (their scratch until the output lands
        # there; every split writes the same values), and the split that holds the new token
        # rotates its k into the cache and copies its v beside it. The same `_rotate_heads` as
        # the rotary kernel, so the same bits.
        new_pos = tl.load(pos_ptr + b).to(tl.int64)
        cos, sin, mask_r, offs_r = _rope_at(new_pos, cos_ptr, sin_ptr, stride_cs, HEAD_DIM // 2,
                                            HEAD_DIM // 2)  # fmt: skip
        _rotate_heads(q_ptr + kvh * GROUP * stride_qh, o_ptr + kvh * GROUP * stride_oh, b,
                      stride_qb, stride_qh, stride_ob, stride_oh, cos, sin, mask_r, offs_r,
                      GROUP, BLOCK_H, HEAD_DIM // 2)  # fmt: skip
        if (end == seq_len) & (start < end):
            dst = tl.load(pages_ptr + b).to(tl.int64) * stride_page + kvh * stride_head
            dst += tl.load(offsets_ptr + b).to(tl.int64) * stride_tok
            _rotate_heads(new_k_ptr + kvh * stride_kh, k_ptr + dst, b, stride_kb, 0, 0, 0, cos,
                          sin, mask_r, offs_r, 1, 2, HEAD_DIM // 2)  # fmt: skip
            v_new = tl.load(new_v_ptr + b * stride_vb + kvh * stride_vh + offs_d)
            tl.store(v_ptr + dst + offs_d, v_new)
        tl.debug_barrier()  # the writes above, by other threads, are read below
        q_rows = o_ptr + b * stride_ob + heads[:, None] * stride_oh
    q = tl.load(q_rows + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        loc = tl.load(table_ptr + slot * stride_table + pos, mask=mask_n, other=0)
        addr = (loc // PAGE_SIZE) * stride_page + (loc % PAGE_SIZE) * stride_tok
        addr += kvh * stride_head
        acc, m_i, l_i = _attend_key_block(
            acc, m_i, l_i, q, k_ptr + addr[None, :] + offs_d[:, None],
            v_ptr + addr[:, None] + offs_d[None, :], mask_n, mask_n[None, :], sm_scale_log2,
            DOT_PRECISION,
        )  # fmt: skip

    # An empty split (a context shorter than the split count) leaves l_i == 0: weight 0 in stage 2.
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        # The merge of one split is the split itself (weight exp2(0) = 1): round and store it.
        dst = o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None])
    else:
        mid = (b * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(mid_o_ptr + mid[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask_h[:, None])
        tl.store(mid_lse_ptr + mid, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < NUM_SPLITS
    row = (b * tl.num_programs(1) + h) * NUM_SPLITS
    lse = tl.load(mid_lse_ptr + row + offs_s, mask=mask_s, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(
        mid_o_ptr + (row + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty))


@triton.jit
def _extend_attend_block(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,
    v_ptr,
    table_row_ptr,
    kv_head_off,
    key_start,
    key_end,
    q_pos,  # [BLOCK_M] absolute positions of the query rows
    sm_scale_log2,
    stride_page,
    stride_tok,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(key_start, key_end, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        mask_n = pos < key_end
        loc = tl.load(table_row_ptr + pos, mask=mask_n, other=0)
        addr = (loc // PAGE_SIZE) * stride_page + (loc % PAGE_SIZE) * stride_tok + kv_head_off
        acc, m_i, l_i = _attend_key_block(
            acc, m_i, l_i, q, k_ptr + addr[None, :] + offs_d[:, None],
            v_ptr + addr[:, None] + offs_d[None, :], mask_n,
            _visible(mask_n, pos, q_pos, CAUSAL), sm_scale_log2, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _extend_attend_new(
    acc, m_i, l_i, q, kn_ptr, vn_ptr, row_of_first, key_start, key_end, q_pos, sm_scale_log2,
    stride_kn, stride_vn,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """`_extend_attend_block` over keys of this chunk's new tokens, read from the packed K/V
    inputs (rows `row_of_first + pos`): regular strided rows, no table lookup or page math."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(key_start, key_end, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        mask_n = pos < key_end
        rows = row_of_first + pos
        acc, m_i, l_i = _attend_key_block(
            acc, m_i, l_i, q, kn_ptr + rows[None, :] * stride_kn + offs_d[:, None],
            vn_ptr + rows[:, None] * stride_vn + offs_d[None, :], mask_n,
            _visible(mask_n, pos, q_pos, CAUSAL), sm_scale_log2, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _extend_kernel(
    q_ptr,  # [N, Hq, D] packed new tokens
    o_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    slots_ptr,  # [R] int32
    q_starts_ptr,  # [R] int32 first token row of each request
    extend_lens_ptr,  # [R] int32
    prefix_lens_ptr,  # [R] int32
    kn_ptr,  # [N, Hkv, D] the new tokens' K and V, as written to the cache
    vn_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    sm_scale_log2,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    stride_table,
    stride_page,
    stride_tok,
    stride_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows: TOKENS new tokens x the GROUP query heads of one kv head
    TOKENS: tl.constexpr,  # BLOCK_M // GROUP
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_start(PDL)
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    mb = tl.program_id(2)
    ext = tl.load(extend_lens_ptr + r)
    if mb * TOKENS >= ext:
        return
    prefix = tl.load(prefix_lens_ptr + r)
    q_start = tl.load(q_starts_ptr + r).to(tl.int64)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    # GQA: the query heads sharing a kv head are rows of one tile, so each K/V block is loaded
    # once for all of them.
    row = tl.arange(0, BLOCK_M)
    tok = mb * TOKENS + row // GROUP
    head = kvh * GROUP + row % GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = (tok < ext) & (row < TOKENS * GROUP)
    rows = q_start + tok
    q = tl.load(
        q_ptr + rows[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None],
        other=0.0,
    )
    q_pos = prefix + tok
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_row = table_ptr + slot * stride_table
    kv_head_off = kvh * stride_head
    block_first = prefix + mb * TOKENS  # every row of the block sees keys before this
    block_last = prefix + tl.minimum((mb + 1) * TOKENS, ext)
    # Keys of the cached prefix from the pages; this chunk's own keys (before the block: no
    # mask; the block's diagonal: causal) from the packed new K/V, at row q_start + pos - prefix.
    acc, m_i, l_i = _extend_attend_block(
        acc, m_i, l_i, q, k_ptr, v_ptr, table_row, kv_head_off, 0, prefix, q_pos,
        sm_scale_log2, stride_page, stride_tok, False, HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    row_of_first = q_start - prefix
    kn_head = kn_ptr + kvh * stride_kh
    vn_head = vn_ptr + kvh * stride_vh
    acc, m_i, l_i = _extend_attend_new(
        acc, m_i, l_i, q, kn_head, vn_head, row_of_first, prefix, block_first, q_pos,
        sm_scale_log2, stride_kn, stride_vn, False, HEAD_DIM, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _extend_attend_new(
        acc, m_i, l_i, q, kn_head, vn_head, row_of_first, block_first, block_last, q_pos,
        sm_scale_log2, stride_kn, stride_vn, True, HEAD_DIM, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + rows[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mask_m[:, None],
    )


def _dot_precision(q: torch.Tensor) -> str:
    """fp32 models get exact fp32 products (not tf32), so their greedy output can be compared
    token for token with torch-native; 16-bit inputs ignore the setting."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def paged_decode(
    q: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    table: torch.Tensor,
    plan: DecodePlan,
    out: torch.Tensor,
    config: dict[str, int] | None = None,
    new_token: NewToken | None = None,
) -> None:
    """q, out: [B, Hq, D]; k_view/v_view: the layer's [pages, page_size, Hkv, D] cache views.
    With `new_token`, q (any row/head strides) and the new K are rotated and the new K/V
    written to the cache inside the kernel (the caller checks the cache has q's dtype, so each
    value is rounded once, as the rotary kernel and `store_kv` round it); without, q is rotated
    and the K/V already written."""
    cfg = config or DECODE_CONFIG
    batch, num_heads, head_dim = q.shape
    strides = KVStrides.of(k_view)
    num_kv_heads = k_view.shape[2]
    group = num_heads // num_kv_heads
    sm_scale_log2 = head_dim**-0.5 * _LOG2E
    nt = new_token
    if nt is not None:
        assert KVStrides.of(v_view) == strides and nt.cos_table.is_contiguous()
        assert nt.sin_table.stride() == nt.cos_table.stride()  # one row stride for both
        assert q.stride(-1) == nt.k.stride(-1) == nt.v.stride(-1) == 1
        new_k, new_v, pos, cos, sin = nt.k, nt.v, nt.positions, nt.cos_table, nt.sin_table
        pages, offsets = nt.where
    else:  # unused pointers: any tensor
        new_k = new_v = pos = cos = sin = pages = offsets = q
    _decode_split_kernel[(batch, num_kv_heads, plan.num_splits)](
        q, k_view, v_view, table, plan.slots, plan.seq_lens, plan.mid_o, plan.mid_lse, out,
        new_k, new_v, pos, cos, sin, pages, offsets,
        sm_scale_log2, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), cos.stride(0),
        table.stride(0), strides.page, strides.token, strides.head,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_SIZE=k_view.shape[1], NUM_SPLITS=plan.num_splits, BLOCK_N=cfg["BLOCK_N"],
        DOT_PRECISION=_dot_precision(q), ROPE=nt is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(q),
    )  # fmt: skip
    if plan.num_splits == 1:
        return
    _decode_merge_kernel[(batch, num_heads)](
        plan.mid_o, plan.mid_lse, out, out.stride(0), out.stride(1),
        NUM_SPLITS=plan.num_splits, BLOCK_S=triton.next_power_of_2(plan.num_splits),
        HEAD_DIM=head_dim, num_warps=4, **launch_options(q),
    )  # fmt: skip


def paged_extend(
    q: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    table: torch.Tensor,
    plan: ExtendPlan,
    out: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor],
    config: dict[str, int] | None = None,
) -> None:
    """q, out: [N, Hq, D] packed new tokens of every request; `new_kv`: their K and V [N, Hkv, D]
    (any token/head strides, unit-stride head_dim), already written to the cache too."""
    k_new, v_new = new_kv
    cfg = config or (EXTEND_CONFIG_FP32 if q.dtype == torch.float32 else EXTEND_CONFIG)
    _, num_heads, head_dim = q.shape
    strides = KVStrides.of(k_view)
    num_kv_heads = k_view.shape[2]
    group = num_heads // num_kv_heads
    block_m = max(cfg["BLOCK_M"], triton.next_power_of_2(group))
    tokens = block_m // group
    grid = (plan.num_requests, num_kv_heads, triton.cdiv(plan.max_extend_len, tokens))
    _extend_kernel[grid](
        q, out, k_view, v_view, table, plan.slots, plan.q_starts, plan.extend_lens,
        plan.prefix_lens, k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), head_dim**-0.5 * _LOG2E, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), table.stride(0), strides.page, strides.token,
        strides.head, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=k_view.shape[1],
        BLOCK_M=block_m, TOKENS=tokens, BLOCK_N=cfg["BLOCK_N"], DOT_PRECISION=_dot_precision(q),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(q),
    )  # fmt: skip


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pages_ptr, offsets_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_page, stride_tok, stride_head,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    dependent_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    page = tl.load(pages_ptr + t).to(tl.int64)
    offset = tl.load(offsets_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (heads < NUM_KV_HEADS)[:, None]
    dst = page * stride_page + offset * stride_tok + heads[:, None] * stride_head + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kn + heads[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vn + heads[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """The new tokens' K and V [N, Hkv, D] into the layer's cache views at (pages, offsets): one
    launch for both (two index_put kernels otherwise)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    strides = KVStrides.of(k_view)
    assert KVStrides.of(v_view) == strides and k.stride(-1) == 1 and v.stride(-1) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_view, v_view, where[0], where[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        strides.page, strides.token, strides.head,
        NUM_KV_HEADS=num_kv_heads, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, num_warps=4, **launch_options(k),
    )  # fmt: skip
