"""In-house GPU attention backend: paged decode and paged extend (with prefix) in Triton.

Needs only torch and Triton. An all-decode batch runs the split-KV decode kernel; any other batch
runs the extend kernel over every request (a single-token request is an extend of length 1).
The new tokens' K/V are written to the cache first, so the kernels read every key, prefix and
new alike, from the pages. On a CPU cache the same plans run through `triton_reference`, the
plain-torch version of the kernels' algorithm: that is how the CPU tests exercise this backend.

Metadata (`TritonMetadata`) is built once per batch; the decode plan's tensors have fixed shapes
per batch size, which is what the CUDA-graph runner relies on when it replays a captured step.
With step preparation in the graph (engine/step_prep.py) the plan is derived inside the graph
from the packed step: nothing of it is built on the host (`graph_step_metadata`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from engine.attention import triton_reference
from engine.attention.base import AttentionBackend
from engine.attention.triton_reference import DecodePlan, ExtendPlan, NewToken, choose_num_splits
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.kv_cache import PagedKVCache, ReqToTokenPool
from engine.models.elementwise import kernels_on as elementwise_kernels_on
from engine.step_prep import DecodeStepInputs

if TYPE_CHECKING:
    from engine.models.layers import RotaryEmbedding


@dataclass
class TritonMetadata:
    write_at: tuple[torch.Tensor, torch.Tensor]  # (pages, offsets) of the new tokens
    decode: DecodePlan | None  # set when every request adds one token
    extend: ExtendPlan | None  # set otherwise


def _kernels(device: torch.device) -> ModuleType:
    if device.type != "cuda":
        return triton_reference
    try:
        from engine.attention import triton_kernels
    except ImportError as exc:
        raise ImportError(
            f"the 'triton' attention backend needs the package 'triton' on GPU: {exc}"
        ) from exc
    return triton_kernels


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, kv_cache: PagedKVCache, req_to_token: ReqToTokenPool) -> None:
        super().__init__(kv_cache, req_to_token)
        device = kv_cache.buffer.device
        self.ops = _kernels(device)
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 4
        )

    def decode_plan(self, slots: list[int], seq_lens: list[int]) -> DecodePlan:
        device = self.kv_cache.buffer.device
        packed = torch.tensor([slots, seq_lens], dtype=torch.int32).to(device, non_blocking=True)
        splits = choose_num_splits(
            len(slots), self.kv_cache.layout.num_kv_heads, max(seq_lens), self.num_sms
        )
        return DecodePlan(packed[0], packed[1], splits)

    def init_metadata(self, batch: ForwardBatch) -> None:
        write_at = self.kv_cache.split(batch.out_cache_loc)
        if batch.mode is ForwardMode.DECODE:
            plan = self.decode_plan(batch.req_slots, batch.seq_lens)
            batch.attn_metadata = TritonMetadata(write_at, plan, None)
            return
        starts, row = [], 0
        for n in batch.extend_lens:
            starts.append(row)
            row += n
        packed = torch.tensor(
            [batch.req_slots, starts, batch.extend_lens, batch.prefix_lens], dtype=torch.int32
        ).to(self.kv_cache.buffer.device, non_blocking=True)
        extend = ExtendPlan(packed[0], packed[1], packed[2], packed[3], max(batch.extend_lens))
        batch.attn_metadata = TritonMetadata(write_at, None, extend)

    # ---- CUDA-graph hooks (engine/cuda_graph.py) ----------------------------------------------
    def init_graph_metadata(self, batch: ForwardBatch, max_context: int) -> None:
        """Metadata of a static decode batch, padding rows only; the split count is sized for
        `max_context` so that no later step needs another."""
        self.init_metadata(batch)
        md: TritonMetadata = batch.attn_metadata
        md.decode = self.decode_plan(batch.req_slots, [max_context] * batch.batch_size)
        md.decode.seq_lens.fill_(1)

    def update_graph_metadata(
        self, static: ForwardBatch, batch: ForwardBatch, pad_slot: int
    ) -> None:
        """Copy `batch`'s decode metadata into the first rows of `static`'s; the rest become
        padding: slot `pad_slot`, one key, K/V written to the scratch location 0."""
        size = batch.batch_size
        dst: TritonMetadata = static.attn_metadata
        src: TritonMetadata = batch.attn_metadata
        assert dst.decode is not None and src.decode is not None
        for into, src_t, pad in (
            (dst.decode.slots, src.decode.slots, pad_slot),
            (dst.decode.seq_lens, src.decode.seq_lens, 1),
            (dst.write_at[0], src.write_at[0], 0),
            (dst.write_at[1], src.write_at[1], 0),
        ):
            into[:size].copy_(src_t)
            into[size:].fill_(pad)

    def graph_step_metadata(self, static: ForwardBatch, inputs: DecodeStepInputs) -> None:
        """Inside a step-prep graph's capture (engine/step_prep.py): the whole decode plan from
        the device-derived step (slots, lengths; the kernel splits by length) and the KV write
        locations; the split count and workspace stay those of `init_graph_metadata`."""
        md: TritonMetadata = static.attn_metadata
        assert md.decode is not None
        md.write_at = self.kv_cache.split(inputs.out_cache_loc)
        md.decode.slots = inputs.slots
        md.decode.seq_lens = inputs.seq_lens

    def plan_graph_step(
        self, static: ForwardBatch, slots: list[int], seq_lens: list[int], pad_slot: int
    ) -> None:
        """Host work before a step-prep replay: none, the graph derives the whole plan."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        md: TritonMetadata = batch.attn_metadata
        k_view, v_view = self.kv_cache.k_view(layer), self.kv_cache.v_view(layer)
        self.ops.store_kv(k, v, k_view, v_view, md.write_at)
        q = q.contiguous()  # the kernels assume head_dim is the innermost, unit-stride axis
        if md.decode is not None:
            return self._decode(q, layer, md.decode)
        assert md.extend is not None
        out = torch.empty_like(q)
        table = self.req_to_token.table
        self.ops.paged_extend(q, k_view, v_view, table, md.extend, out, (k, v))
        return out

    def rotary_forward(
        self,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        layer: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """A decode batch hands q, k and v to the decode kernel unrotated: it rotates them and
        writes the new K/V itself, so the step has no rotary and no KV-store launch. An extend
        batch, whose kernel also reads the new K/V as tensors, rotates and writes in two steps
        (`forward`)."""
        md: TritonMetadata = batch.attn_metadata
        q, k, v = qkv
        fusable = q.dtype == self.kv_cache.layout.dtype and (
            not q.is_cuda or elementwise_kernels_on(q)
        )
        if md.decode is None or not fusable:
            return super().rotary_forward(qkv, positions, rope, layer, batch)
        new = NewToken(k, v, positions, rope.cos_table, rope.sin_table, md.write_at)
        return self._decode(q, layer, md.decode, new)

    def _decode(
        self, q: torch.Tensor, layer: int, plan: DecodePlan, new_token: NewToken | None = None
    ) -> torch.Tensor:
        """Attention of a decode batch: q [B, Hq, D]; its K/V in the cache, or `new_token`."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        plan.ensure_workspace(q.shape[1], q.shape[2])
        k_view, v_view = self.kv_cache.k_view(layer), self.kv_cache.v_view(layer)
        table = self.req_to_token.table
        self.ops.paged_decode(q, k_view, v_view, table, plan, out, new_token=new_token)
        return out
