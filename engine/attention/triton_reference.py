"""The Triton backend's plans and its algorithm in plain torch (runs anywhere, CPU included).

A plan is what the kernels need besides q and the cache: int32 tensors on the cache's device, the
split count, the decode workspace. The reference functions below compute exactly what
`triton_kernels.py` computes, with the same address math (flat offsets from page/offset/head
strides), the same split boundaries and the same log2-domain log-sum-exp merge, so that logic is
tested on CPU against the torch-native backend; on a GPU the kernels are checked against both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.models.elementwise import rotary_reference

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 64  # one key block of the decode kernel


@dataclass(frozen=True)
class KVStrides:
    """Element strides of one layer's K (or V) view `[pages, page_size, kv_heads, head_dim]`."""

    page: int
    token: int
    head: int

    @classmethod
    def of(cls, view: torch.Tensor) -> KVStrides:
        if view.stride(-1) != 1:
            raise ValueError("the KV cache view must be contiguous in head_dim")
        return cls(view.stride(0), view.stride(1), view.stride(2))


def token_offsets(locs: torch.Tensor, page_size: int, strides: KVStrides) -> torch.Tensor:
    """Element offset of each location's first K element of head 0 from the view's start."""
    return (locs // page_size) * strides.page + (locs % page_size) * strides.token


def gather_tokens(view: torch.Tensor, locs: torch.Tensor) -> torch.Tensor:
    """[n] locations -> [n, kv_heads, head_dim], read by the kernels' flat address math."""
    pages, page_size, heads, dim = view.shape
    strides = KVStrides.of(view)
    span = (pages - 1) * strides.page + (page_size - 1) * strides.token
    span += (heads - 1) * strides.head + dim
    flat = view.as_strided((span,), (1,), view.storage_offset())
    head_d = torch.arange(heads, device=view.device)[:, None] * strides.head
    head_d = head_d + torch.arange(dim, device=view.device)[None, :]
    return flat[token_offsets(locs, page_size, strides)[:, None, None] + head_d]


@dataclass(frozen=True)
class DecodeTuning:
    """The split-KV decode kernel's knobs; the defaults are what the engine runs.

    The split count (stage 1's programs per request and kv head) comes from the first three:
    enough (request, kv head, split) programs for `blocks_per_sm` per multiprocessor, each split
    at least `min_split_tokens` keys long, at most `max_splits`. The last three are the launch
    settings of stage 1: keys per block (`BLOCK_N`), warps and pipeline stages. None changes
    the result beyond float summation order. Defaults measured on an H100
    (scripts/gpu/tune_attention.py, 2026-11-22); scripts/gpu/tune_decode_kernels.py sweeps them
    against the K/V-read floor. One block per SM (4 until 2026-11-26) gives one split from 17
    requests of 8 kv heads on up, where stage 1 writes the output itself and no merge runs: the
    engine's B=64 decode step went from 9.96 to 9.72 ms on an H100 with it.
    """

    blocks_per_sm: int = 1
    max_splits: int = 64
    min_split_tokens: int = MIN_SPLIT_TOKENS
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def num_splits(self, batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
        want = math.ceil(self.blocks_per_sm * num_sms / max(1, batch * num_kv_heads))
        longest = math.ceil(max_seq_len / self.min_split_tokens)
        return max(1, min(want, self.max_splits, longest))

    def launch_config(self) -> dict[str, int]:
        """Stage 1's settings as `triton_kernels.paged_decode` takes them."""
        return {"BLOCK_N": self.block_n, "num_warps": self.num_warps, "num_stages": self.num_stages}


DEFAULT_DECODE_TUNING = DecodeTuning()


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    tuning: DecodeTuning = DEFAULT_DECODE_TUNING,
) -> int:
    """Enough (request, kv head, split) programs for one per multiprocessor, each split at least
    64 keys long, at most 64 splits (measured on an H100: scripts/gpu/tune_decode_kernels.py and
    scripts/gpu/engine_step.py); other values through `tuning`."""
    return tuning.num_splits(batch, num_kv_heads, max_seq_len, num_sms)


def split_bounds(seq_len: int, num_splits: int, split: int) -> tuple[int, int]:
    """Key range [start, end) of one split, as the decode kernel computes it."""
    split_len = -(-seq_len // num_splits)
    start = split * split_len
    return start, min(start + split_len, seq_len)


@dataclass
class DecodePlan:
    """Every request adds one token. `mid_o`/`mid_lse` are stage 1's per-split results."""

    slots: torch.Tensor  # [B] int32 rows of req_to_token
    seq_lens: torch.Tensor  # [B] int32 context lengths including the new token
    num_splits: int
    mid_o: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    mid_lse: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def ensure_workspace(self, num_heads: int, head_dim: int) -> None:
        batch = self.slots.shape[0]
        if self.mid_o.shape != (batch, num_heads, self.num_splits, head_dim):
            dev = self.slots.device
            self.mid_o = torch.empty(
                batch, num_heads, self.num_splits, head_dim, dtype=torch.float32, device=dev
            )
            self.mid_lse = torch.empty(
                batch, num_heads, self.num_splits, dtype=torch.float32, device=dev
            )


@dataclass(frozen=True)
class NewToken:
    """A decode step's new K/V before RoPE, for `paged_decode` to rotate and write itself: k and
    v [B, Hkv, D] (strided views of the QKV output will do), the rows' positions [B], the RoPE
    tables [max_positions, D/2], and where each row's K/V goes (pages, offsets)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    where: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ExtendPlan:
    """Request r's new tokens are rows q_starts[r]..+extend_lens[r], after prefix_lens[r] cached."""

    slots: torch.Tensor  # [R] int32
    q_starts: torch.Tensor  # [R] int32
    extend_lens: torch.Tensor  # [R] int32
    prefix_lens: torch.Tensor  # [R] int32
    max_extend_len: int

    @property
    def num_requests(self) -> int:
        return int(self.slots.shape[0])


def paged_decode(
    q: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    table: torch.Tensor,
    plan: DecodePlan,
    out: torch.Tensor,
    new_token: NewToken | None = None,
) -> None:
    """Reference of `triton_kernels.paged_decode`: stage 1 per split, then the merge. With
    `new_token`, q and its k are rotated and the K/V written first (`rotary`, `store_kv`)."""
    if new_token is not None:
        nt = new_token
        q, k = rotary_reference(q, nt.k, nt.positions, nt.cos_table, nt.sin_table)
        store_kv(k, nt.v, k_view, v_view, nt.where)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_view.shape[2]
    group = num_heads // num_kv_heads
    scale_log2 = head_dim**-0.5 * LOG2E
    for b in range(batch):
        seq_len, slot = int(plan.seq_lens[b]), int(plan.slots[b])
        qb = q[b].float().view(num_kv_heads, group, head_dim)
        for s in range(plan.num_splits):
            start, end = split_bounds(seq_len, plan.num_splits, s)
            if end <= start:
                plan.mid_o[b, :, s] = 0.0
                plan.mid_lse[b, :, s] = float("-inf")
                continue
            locs = table[slot, start:end]
            k = gather_tokens(k_view, locs).float()  # [n, Hkv, D]
            v = gather_tokens(v_view, locs).float()
            scores = torch.einsum("hgd,nhd->hgn", qb, k) * scale_log2
            m = scores.amax(-1, keepdim=True)
            p = torch.exp2(scores - m)
            denom = p.sum(-1, keepdim=True)
            part = torch.einsum("hgn,nhd->hgd", p, v) / denom
            plan.mid_o[b, :, s] = part.reshape(num_heads, head_dim)
            plan.mid_lse[b, :, s] = (m + torch.log2(denom)).reshape(num_heads)
    weight = torch.exp2(plan.mid_lse - plan.mid_lse.amax(-1, keepdim=True))  # [B, Hq, S]
    merged = (plan.mid_o * weight[..., None]).sum(2) / weight.sum(-1)[..., None]
    out.copy_(merged.to(out.dtype))


def paged_extend(
    q: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    table: torch.Tensor,
    plan: ExtendPlan,
    out: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Reference of `triton_kernels.paged_extend`: causal over prefix + new keys. The kernel reads
    the new keys from `new_kv`; the cache holds the same values (written first), read here."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_view.shape[2]
    group = num_heads // num_kv_heads
    for r in range(plan.num_requests):
        start, ext = int(plan.q_starts[r]), int(plan.extend_lens[r])
        prefix, slot = int(plan.prefix_lens[r]), int(plan.slots[r])
        locs = table[slot, : prefix + ext]
        k = gather_tokens(k_view, locs).float().repeat_interleave(group, dim=1)
        v = gather_tokens(v_view, locs).float().repeat_interleave(group, dim=1)
        qr = q[start : start + ext].float()  # [ext, Hq, D]
        scores = torch.einsum("mhd,nhd->hmn", qr, k) * head_dim**-0.5
        q_pos = torch.arange(prefix, prefix + ext, device=q.device)[:, None]
        visible = torch.arange(prefix + ext, device=q.device)[None, :] <= q_pos
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start : start + ext] = torch.einsum("hmn,nhd->mhd", probs, v).to(out.dtype)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_view: torch.Tensor,
    v_view: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Reference of `triton_kernels.store_kv`: what `PagedKVCache.write` does."""
    k_view[where] = k.to(k_view.dtype)
    v_view[where] = v.to(v_view.dtype)
