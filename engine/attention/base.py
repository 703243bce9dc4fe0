"""The attention-backend interface.

A backend owns the metadata it needs for one forward (built once per batch in `init_metadata`
and stored on the batch, then reused by every layer) and performs both the KV-cache write of the
new tokens and the attention over the cached context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from engine.forward_batch import ForwardBatch
from engine.memory.kv_cache import PagedKVCache, ReqToTokenPool

if TYPE_CHECKING:
    from engine.models.layers import RotaryEmbedding


class AttentionBackend(ABC):
    name: str = ""
    # True when a step-prep CUDA graph's host-side plan (`plan_graph_step`) reads req_to_token,
    # so the step's new table entries must be written before it (engine/step_prep.py).
    plan_reads_table: bool = False

    def __init__(self, kv_cache: PagedKVCache, req_to_token: ReqToTokenPool) -> None:
        self.kv_cache = kv_cache
        self.req_to_token = req_to_token

    @abstractmethod
    def init_metadata(self, batch: ForwardBatch) -> None:
        """Build per-batch metadata and attach it as `batch.attn_metadata`."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [N, Hq, D], k/v: [N, Hkv, D] for the batch's new tokens -> [N, Hq, D]."""

    def rotary_forward(
        self,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        layer: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """`forward` of q and k rotated by `rope` at `positions`. A backend may override it to
        rotate k straight into its cache (one kernel for the rotation and the KV write)."""
        q, k, v = qkv
        q, k = rope(positions, q, k)
        return self.forward(q, k, v, layer, batch)
