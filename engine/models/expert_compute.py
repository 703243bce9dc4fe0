"""The routed experts' compute on a rank, with no loop over tokens.

The (token, expert) pairs are sorted by expert; each expert that received tokens runs one
gate_up GEMM, SiLU-and-mul and one down GEMM over its rows (`expert_gemms`); the outputs,
weighted in fp32, go back to (token, k) order and are summed per token in HF's top-k order
(`combine_pairs`: deterministic on CUDA too, where index_add_ would use atomics). The tokens per
expert are read on the host (one sync), so a model with MoE layers runs its decode steps without
CUDA graphs on GPU; a fused MoE kernel is the GPU path still to come. Expert parallelism runs the
same two steps with an all-to-all between them (engine/models/moe_dispatch.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.elementwise import silu_and_mul


def grouped_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t: one Python iteration
    per expert, none per token."""
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # pair rows grouped by expert, in token order within one
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # the host sync
    out = expert_gemms(x[order // ids.shape[1]], counts, w13, w2)
    return combine_pairs(out, order, weights)


def expert_gemms(
    rows: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Expert e of `w13`/`w2` over the next `counts[e]` of `rows` (grouped by expert), for
    every e: one gate_up GEMM, SiLU-and-mul and one down GEMM per expert that has rows."""
    out = torch.empty(rows.shape[0], w2.shape[1], dtype=rows.dtype, device=rows.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            span = slice(start, start + count)
            gate_up = F.linear(rows[span], w13[expert])
            out[span] = F.linear(silu_and_mul(gate_up), w2[expert])
            start += count
    return out


def combine_pairs(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's sum of its top-k expert outputs, weighted in fp32 and added in top-k order
    (HF's): `out[i]` is the output of (token, k) pair `order[i]` of the flattened [N, k]."""
    tokens, top_k = weights.shape
    weighted = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    weighted[order] = out.float() * weights.flatten()[order].unsqueeze(-1)
    return weighted.view(tokens, top_k, out.shape[1]).sum(dim=1).to(out.dtype)
