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

Step preparation in the graph (`step_prep=True`, `EngineConfig.graph_step_prep`): the step
arrives as host lists (`PackedDecodeStep`, engine/step_prep.py), packed into one pinned int64
tensor [4, bucket] (input ids or future-token placeholders, slots, seq lens, new KV locations;
padding rows: slot `pad_slot`, seq len 0, location 0) and copied to the device in ONE copy
before the replay. The graph itself derives positions, writes the step's req_to_token entries,
substitutes the future tokens, builds the attention metadata (`backend.graph_step_metadata`,
captured), runs the model, and ends with the
argmax of every row's logits written to the runner's `future` buffer: a batch whose every row is
a plain argmax (`sampling.is_plain_argmax`) takes its tokens from there, bit-identical to
`sample_tokens`; any other batch reads the logits and samples outside, as before. The same
buffer is where the graph reads the placeholders' tokens, so an overlapped step after a graph
step copies nothing; after an eager step its tokens are copied into it first (one device copy).
What the backend cannot derive on the device stays a host step before the replay
(`backend.plan_graph_step`: FlashInfer's plan, which its API makes on the host; Triton: none).
The padding invariant holds the same way: padding rows read one key through `pad_slot`, write
their K/V to location 0 and their table entry to the table's last column, which no request
reaches (tests/test_step_prep.py). A step-prep runner replays only packed steps: a decode batch
built on the host (a step the packed path does not take) runs eagerly.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.step_prep import (
    PACKED_ROWS,
    ROW_SLOTS,
    PackedDecodeStep,
    derive_decode_step,
    greedy_tokens,
    pack_decode_step,
)

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
    packed: torch.Tensor | None = None  # step prep: the [PACKED_ROWS, bucket] device input


class DecodeGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        max_context: int,
        pad_slot: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        step_prep: bool = False,
    ) -> None:
        self.model = model
        self.max_context = max_context
        self.pad_slot = pad_slot
        self.buckets = tuple(sorted(buckets))
        self.step_prep = step_prep
        self.graphs: dict[int, _Graph] = {}
        self.pool: Any = None  # one memory pool shared by every bucket's graph
        # Step prep: the placeholders' tokens, and where each graph writes its rows' argmax.
        self.future: torch.Tensor | None = None

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether `replay` takes this batch. Never with step prep: its graphs read the packed
        rows, not a batch's tensors, so a decode batch built on the host runs eagerly."""
        decode = batch.mode is ForwardMode.DECODE and batch.batch_size <= self.buckets[-1]
        return decode and not self.step_prep

    def bucket_of(self, batch_size: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    def can_run_step(self, batch_size: int, future_tokens: torch.Tensor | None) -> bool:
        """Whether a decode step of `batch_size` requests can take the step-prep path: a bucket
        fits it and the future tokens fit the `future` buffer."""
        fits = future_tokens is None or future_tokens.shape[0] <= self.buckets[-1]
        return self.step_prep and 0 < batch_size <= self.buckets[-1] and fits

    @torch.inference_mode()
    def replay_step(
        self, step: PackedDecodeStep, backend: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [batch_size, vocab] and their rows' argmax [batch_size] (int64), both on the
        device, of a decode step given as host lists; one host-to-device copy, one replay. The
        tokens are a view of `future`: valid until the next replay."""
        size = step.batch_size
        bucket = self.bucket_of(size)
        entry = self.graphs.get(bucket) or self._capture_step(backend, bucket)
        assert entry.packed is not None and self.future is not None
        host = torch.empty(entry.packed.shape, dtype=torch.int64, pin_memory=entry.packed.is_cuda)
        pack_decode_step(step, bucket, self.pad_slot, host)
        # Pinned and non-blocking: the host does not wait for the step in flight; torch's host
        # allocator keeps `host` from reuse until the copy has run.
        entry.packed.copy_(host, non_blocking=True)
        future = step.future_tokens
        if future is not None and future.numel() and future.data_ptr() != self.future.data_ptr():
            self.future[: future.shape[0]].copy_(future)  # an eager step's tokens
        backend.plan_graph_step(entry.batch, step.slots, step.seq_lens, self.pad_slot)
        entry.graph.replay()
        return entry.logits[:size], self.future[:size]

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
        batch = self._static_batch(like.attn_backend, like.input_ids.device, size)
        entry = self._record(batch, lambda: self.model(batch))
        self.graphs[size] = entry
        return entry

    def _capture_step(self, backend: Any, size: int) -> _Graph:
        """A bucket's graph from the packed rows to the logits and their argmax."""
        table = backend.req_to_token.table
        device = table.device
        if self.future is None:
            self.future = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        future = self.future
        packed = torch.zeros(PACKED_ROWS, size, dtype=torch.int64, device=device)
        packed[ROW_SLOTS].fill_(self.pad_slot)  # every row padding until the first step
        batch = self._static_batch(backend, device, size)

        def step() -> torch.Tensor:
            inputs = derive_decode_step(packed, table, future)
            batch.input_ids = inputs.input_ids
            batch.positions = inputs.positions
            batch.out_cache_loc = inputs.out_cache_loc
            backend.graph_step_metadata(batch, inputs)
            logits: torch.Tensor = self.model(batch)
            greedy_tokens(logits, out=future[:size])
            return logits

        # Warm-up runs write their argmax into `future`, which still holds the tokens this
        # very step's placeholders stand for: keep them.
        held = future.clone()
        entry = self._record(batch, step)
        future.copy_(held)
        entry.packed = packed
        self.graphs[size] = entry
        return entry

    def _static_batch(self, backend: Any, device: torch.device, size: int) -> _StaticDecodeBatch:
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
        backend.init_graph_metadata(batch, self.max_context)
        return batch

    def _record(self, batch: _StaticDecodeBatch, run: Callable[[], torch.Tensor]) -> _Graph:
        """Warm `run` up on a side stream, then capture it; it returns the logits."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: compile kernels, allocate the plan's workspace
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = run()
        self.pool = graph.pool()
        return _Graph(graph, batch, logits)
