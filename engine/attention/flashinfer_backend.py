"""FlashInfer attention backend (the `gpu` extra: `pip install pdserve[gpu]`).

FlashInfer's paged wrappers read the engine's own KV pool in place, without a copy: a layer's K
(or V) is the strided view `buffer[:, :, layer, 0]`, shape [pages, kv_heads, page_size, head_dim]
(its "HND" layout), with the page and head strides of the whole pool; FlashInfer takes any page,
head and token strides as long as K and V share them and head_dim is unit-stride, which holds
here. A request's context is given as its list of page ids (CSR: `indptr`, `indices`) and the
fill of its last page.

An all-decode batch runs the decode wrapper (tensor-core kernels when a KV head serves >= 4 query
heads); any other batch runs the prefill wrapper with a causal mask, whose new tokens attend to
their cached prefix and to each other. The new tokens' K/V are written to the pages first, by the
Triton `store_kv` kernel, so every key is read from the cache.

A wrapper holds one plan at a time (FlashInfer's split-KV schedule, made on the host), so the
metadata on the batch keeps the page table and the wrapper that runs it, and `forward` plans
when the wrapper's current plan is another batch's: once per batch, at its first layer.

CUDA graphs (engine/cuda_graph.py): each batch-size bucket gets its own decode wrapper over fixed
page-table buffers (FlashInfer's `use_cuda_graph` mode); `update_graph_metadata` re-plans it with
each step's page table before the replay, and padding rows read the scratch page 0. With step
preparation in the graph (engine/step_prep.py) the graph derives the KV write locations; the page
table (one gather through req_to_token) and FlashInfer's plan stay host work before the replay.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.kv_cache import PagedKVCache, ReqToTokenPool
from engine.step_prep import DecodeStepInputs

INSTALL_HINT = "pip install pdserve[gpu]  (installs flashinfer-python)"
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-KV workspace
TENSOR_CORE_DECODE_MIN_GROUP = 4  # query heads per KV head from which tensor-core decode pays


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError(
            f"the 'flashinfer' attention backend needs the package flashinfer-python: "
            f"{INSTALL_HINT}; or choose --attention-backend triton ({exc})"
        ) from exc
    return flashinfer


@dataclass
class PageTable:
    """Each request's pages in FlashInfer's CSR form."""

    indptr: torch.Tensor  # [B + 1] int32, host
    indices: torch.Tensor  # [indptr[-1]] int32 page ids, device
    last_page_len: torch.Tensor  # [B] int32, host: tokens in each request's last page


@dataclass
class FlashInferMetadata:
    write_at: tuple[torch.Tensor, torch.Tensor]  # (pages, offsets) of the new tokens
    pages: PageTable
    qo_indptr: torch.Tensor | None  # [B + 1] int32 host rows of each request; None: decode
    wrapper: Any  # the FlashInfer wrapper that runs this batch; decode: bound at first forward
    graph_buffers: dict[str, Any] | None = None  # a graph bucket's fixed page-table buffers


def page_table(
    table: torch.Tensor, page_size: int, slots: list[int], seq_lens: list[int]
) -> PageTable:
    """Page ids of each request's first `seq_len` tokens, gathered from req_to_token `table` on
    its device (one host-to-device copy of the (slot, first token of the page) pairs)."""
    num_pages = [-(-s // page_size) for s in seq_lens]
    indptr = torch.tensor([0, *itertools.accumulate(num_pages)], dtype=torch.int32)
    last = [s - (n - 1) * page_size for s, n in zip(seq_lens, num_pages, strict=True)]
    counts = torch.tensor(num_pages)
    rows = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int64), counts)
    ordinal = torch.arange(int(indptr[-1])) - torch.repeat_interleave(indptr[:-1].long(), counts)
    pairs = torch.stack([rows, ordinal * page_size]).to(table.device, non_blocking=True)
    indices = (table[pairs[0], pairs[1]] // page_size).to(torch.int32)
    return PageTable(indptr, indices, torch.tensor(last, dtype=torch.int32))


def pad_page_table(pages: PageTable, pad: int) -> PageTable:
    """`pages` plus `pad` rows of one token each on the scratch page 0 (CUDA-graph padding)."""
    tail = pages.indptr[-1] + torch.arange(1, pad + 1, dtype=torch.int32)
    return PageTable(
        torch.cat([pages.indptr, tail]),
        torch.cat([pages.indices, pages.indices.new_zeros(pad)]),
        torch.cat([pages.last_page_len, torch.ones(pad, dtype=torch.int32)]),
    )


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    plan_reads_table = True  # plan_graph_step gathers the page ids from req_to_token
    tensor_core_min_group = TENSOR_CORE_DECODE_MIN_GROUP  # scripts/gpu/check_flashinfer times both

    def __init__(self, kv_cache: PagedKVCache, req_to_token: ReqToTokenPool) -> None:
        super().__init__(kv_cache, req_to_token)
        self.fi = import_flashinfer()
        device = kv_cache.buffer.device
        layout = kv_cache.layout
        if layout.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"the 'flashinfer' attention backend needs a bfloat16 or float16 KV cache, "
                f"got {layout.dtype}; run with --dtype bfloat16 (or choose 'triton')"
            )
        if device.type != "cuda":
            raise ValueError(
                "the 'flashinfer' attention backend runs on CUDA devices only; "
                "choose 'torch_native' or 'triton' on the CPU"
            )
        from engine.attention import triton_kernels  # store_kv: one launch for K and V

        self.store_kv = triton_kernels.store_kv
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "HND")
        self.decode_wrapper: Any = None  # made on first use: the group size comes with q
        self.num_qo_heads = 0
        self._planned: dict[int, FlashInferMetadata] = {}  # id(wrapper) -> batch it holds
        buf = kv_cache.buffer
        self.layer_views = [(buf[:, :, i, 0], buf[:, :, i, 1]) for i in range(layout.num_layers)]

    # ---- metadata -----------------------------------------------------------------------------
    def init_metadata(self, batch: ForwardBatch) -> None:
        write_at = self.kv_cache.split(batch.out_cache_loc)
        pages = page_table(self.req_to_token.table, self.kv_cache.page_size, batch.req_slots,
                           batch.seq_lens)  # fmt: skip
        if batch.mode is ForwardMode.DECODE:
            batch.attn_metadata = FlashInferMetadata(write_at, pages, None, None)
            return
        qo = torch.tensor([0, *itertools.accumulate(batch.extend_lens)], dtype=torch.int32)
        batch.attn_metadata = FlashInferMetadata(write_at, pages, qo, self.prefill_wrapper)

    def _decode_wrapper(self, num_qo_heads: int, graph_buffers: dict[str, Any] | None) -> Any:
        group = num_qo_heads // self.kv_cache.layout.num_kv_heads
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "HND",
            use_tensor_cores=group >= self.tensor_core_min_group,
            **(graph_buffers or {}),
        )

    def _plan(self, md: FlashInferMetadata, num_qo_heads: int) -> None:
        layout = self.kv_cache.layout
        common = dict(
            num_qo_heads=num_qo_heads,
            num_kv_heads=layout.num_kv_heads,
            page_size=layout.page_size,
            q_data_type=layout.dtype,
            kv_data_type=layout.dtype,
        )
        p = md.pages
        if md.qo_indptr is None:
            md.wrapper.plan(
                p.indptr, p.indices, p.last_page_len, head_dim=layout.head_dim, **common
            )
        else:
            md.wrapper.plan(
                md.qo_indptr, p.indptr, p.indices, p.last_page_len,
                head_dim_qk=layout.head_dim, causal=True, **common,
            )  # fmt: skip
        self._planned[id(md.wrapper)] = md

    # ---- CUDA-graph hooks (engine/cuda_graph.py) ----------------------------------------------
    def init_graph_metadata(self, batch: ForwardBatch, max_context: int) -> None:
        """A decode wrapper of this bucket over fixed page-table buffers sized for
        `max_context` tokens per row; planned now for the padding rows (one key each)."""
        self.init_metadata(batch)
        md: FlashInferMetadata = batch.attn_metadata
        size, device = batch.batch_size, self.workspace.device
        max_pages = -(-max_context // self.kv_cache.page_size)
        buffers = {
            "use_cuda_graph": True,
            "paged_kv_indptr_buffer": torch.zeros(size + 1, dtype=torch.int32, device=device),
            "paged_kv_indices_buffer": torch.zeros(
                size * max_pages, dtype=torch.int32, device=device
            ),
            "paged_kv_last_page_len_buffer": torch.zeros(size, dtype=torch.int32, device=device),
        }
        md.graph_buffers = buffers  # its wrapper is made at the first forward (needs Hq)

    def update_graph_metadata(
        self, static: ForwardBatch, batch: ForwardBatch, pad_slot: int
    ) -> None:
        """Plan `static`'s wrapper with `batch`'s page table in its first rows; the rest become
        padding rows reading one key of the scratch page 0, writing their K/V to location 0."""
        size, bucket = batch.batch_size, static.batch_size
        dst: FlashInferMetadata = static.attn_metadata
        src: FlashInferMetadata = batch.attn_metadata
        dst.pages = pad_page_table(src.pages, bucket - size)
        for into, src_t in zip(dst.write_at, src.write_at, strict=True):
            into[:size].copy_(src_t)
            into[size:].fill_(0)
        self._plan(dst, self.num_qo_heads)

    def graph_step_metadata(self, static: ForwardBatch, inputs: DecodeStepInputs) -> None:
        """Inside a step-prep graph's capture (engine/step_prep.py): the KV write locations
        from the device-derived step. The page table and split-KV plan stay on the host
        (`plan_graph_step`): FlashInfer's `plan` is a host function."""
        md: FlashInferMetadata = static.attn_metadata
        md.write_at = self.kv_cache.split(inputs.out_cache_loc)

    def plan_graph_step(
        self, static: ForwardBatch, slots: list[int], seq_lens: list[int], pad_slot: int
    ) -> None:
        """Before a step-prep replay: plan `static`'s wrapper with the step's page table in its
        first rows, padding rows reading one key of the scratch page 0 (as
        `update_graph_metadata`, without the KV locations, which the graph derives)."""
        md: FlashInferMetadata = static.attn_metadata
        pages = page_table(self.req_to_token.table, self.kv_cache.page_size, slots, seq_lens)
        md.pages = pad_page_table(pages, static.batch_size - len(slots))
        self._plan(md, self.num_qo_heads)

    # ---- forward ------------------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        md: FlashInferMetadata = batch.attn_metadata
        self.store_kv(k, v, self.kv_cache.k_view(layer), self.kv_cache.v_view(layer), md.write_at)
        if md.wrapper is None:
            self._bind_decode_wrapper(md, q.shape[1])
        if self._planned.get(id(md.wrapper)) is not md:
            self._plan(md, q.shape[1])
        out = torch.empty_like(q)
        md.wrapper.run(q.contiguous(), self.layer_views[layer], out=out)
        return out

    def _bind_decode_wrapper(self, md: FlashInferMetadata, num_qo_heads: int) -> None:
        """The decode wrapper needs the query head count, known at the first forward."""
        self.num_qo_heads = num_qo_heads
        if md.graph_buffers is not None:  # a graph bucket's own wrapper
            md.wrapper = self._decode_wrapper(num_qo_heads, md.graph_buffers)
            return
        if self.decode_wrapper is None:
            self.decode_wrapper = self._decode_wrapper(num_qo_heads, None)
        md.wrapper = self.decode_wrapper
