"""CUDA graphs for decode steps: one graph per batch-size bucket, captured on first use.

A decode step launches a few hundred small kernels; at small batches the GPU would wait on the
CPU launching them. A captured graph replays them with one launch. Everything a graph reads is a
static buffer of its bucket: the new tokens' ids, positions and KV locations, and the attention
backend's decode plan (request slots, context lengths, split count, workspace), into which each
step copies its values before the replay. A batch smaller than its bucket is padded with
requests that read one key through slot `pad_slot` (a read only, so any slot will do) and write
their K/V to the scratch location 0 (page 0 is never handed out): they change no request's KV.

The backend owns its part: `init_graph_metadata(static_batch, max_context)` builds metadata whose
tensors stay put (split count sized for the longest context), and `update_graph_metadata(static,
batch, pad_slot)` copies a step's values into them and resets the padding rows.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.forward_batch import ForwardBatch, ForwardMode

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


@dataclass
class _StaticDecodeBatch(ForwardBatch):
    """A decode batch whose last-token rows are a fixed device tensor (0..B-1): computing them
    from `extend_lens` would copy from the host inside the capture."""

    last_rows: torch.Tensor | None = field(default=None)

    @property  # type: ignore[override]
    def last_token_index(self) -> torch.Tensor:
        assert self.last_rows is not None
        return self.last_rows


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: _StaticDecodeBatch
    logits: torch.Tensor


class DecodeGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        max_context: int,
        pad_slot: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    ) -> None:
        self.model = model
        self.max_context = max_context
        self.pad_slot = pad_slot
        self.buckets = tuple(sorted(buckets))
        self.graphs: dict[int, _Graph] = {}
        self.pool: Any = None  # one memory pool shared by every bucket's graph

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.DECODE and batch.batch_size <= self.buckets[-1]

    def bucket_of(self, batch_size: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch_size, vocab], as `model(batch)` would return them."""
        size = batch.batch_size
        bucket = self.bucket_of(size)
        entry = self.graphs.get(bucket) or self._capture(batch, bucket)
        static = entry.batch
        static.input_ids[:size].copy_(batch.input_ids)
        static.positions[:size].copy_(batch.positions)
        batch.attn_backend.update_graph_metadata(static, batch, self.pad_slot)  # type: ignore[attr-defined]
        entry.graph.replay()
        return entry.logits[:size]

    def _capture(self, like: ForwardBatch, size: int) -> _Graph:
        backend = like.attn_backend
        device = like.input_ids.device
        zeros = torch.zeros(size, dtype=torch.int64, device=device)
        batch = _StaticDecodeBatch(
            mode=ForwardMode.DECODE,
            input_ids=zeros.clone(),
            positions=zeros.clone(),
            out_cache_loc=zeros.clone(),  # scratch location 0 for padding rows
            req_slots=[self.pad_slot] * size,
            seq_lens=[1] * size,
            extend_lens=[1] * size,
            attn_backend=backend,
            last_rows=torch.arange(size, device=device),
        )
        backend.init_graph_metadata(batch, self.max_context)  # type: ignore[attr-defined]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: compile kernels, allocate the plan's workspace
                self.model(batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(batch)
        self.pool = graph.pool()
        entry = _Graph(graph, batch, logits)
        self.graphs[size] = entry
        return entry
