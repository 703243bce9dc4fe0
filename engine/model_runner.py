"""Owns the model, the KV memory and the attention backend; turns requests into forwards."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention import attention_backend_class
from engine.config import EngineConfig
from engine.cuda_graph import DecodeGraphRunner
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kv_manager import KVManager
from engine.memory import (
    IntegrityError,
    KVLayout,
    PageAllocator,
    PagedKVCache,
    PageState,
    RadixCache,
    ReqToTokenPool,
)
from engine.model_config import ModelConfig
from engine.models.loader import load_model
from engine.request import Req


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.context_length = config.context_length or model_config.max_position_embeddings
        if self.context_length > model_config.max_position_embeddings:
            raise ValueError(
                f"context_length {self.context_length} exceeds the model's "
                f"max_position_embeddings {model_config.max_position_embeddings}; lower it"
            )
        self.model = load_model(model_config, config.load_format, config.torch_dtype, self.device)
        self.kv_layout = KVLayout(
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            page_size=config.page_size,
            dtype=config.torch_dtype,
        )
        self.kv_cache = PagedKVCache(self.kv_layout, config.num_pages, self.device)
        # One spare slot so a retracted request can be re-admitted while the table is full.
        self.req_to_token = ReqToTokenPool(
            config.max_running_requests + 1, self.context_length + config.page_size, self.device
        )
        self.allocator = PageAllocator(config.num_pages)
        radix = RadixCache(self.allocator, config.page_size) if config.enable_prefix_cache else None
        self.kv = KVManager(self.allocator, self.req_to_token, config.page_size, radix)
        backend_cls = attention_backend_class(config.attention_backend)
        self.attn_backend = backend_cls(self.kv_cache, self.req_to_token)
        self.graph_runner: DecodeGraphRunner | None = None
        if self.device.type == "cuda" and hasattr(self.attn_backend, "init_graph_metadata"):
            # Padding rows read one key through slot 0 (reads only) and write to location 0.
            self.graph_runner = DecodeGraphRunner(self.model, self.context_length, pad_slot=0)

    def build_batch(self, reqs: Sequence[Req], extend_lens: Sequence[int]) -> ForwardBatch:
        """Batch running `extend_lens[i]` pending tokens of `reqs[i]` (KV already reserved)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for req, n in zip(reqs, extend_lens, strict=True):
            ids.extend(req.all_ids[req.kv_len : req.kv_len + n])
            positions.extend(range(req.kv_len, req.kv_len + n))
            assert req.slot is not None
            slots.append(req.slot)
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        slot_per_token = torch.repeat_interleave(
            torch.tensor(slots, device=dev), torch.tensor(list(extend_lens), device=dev)
        )
        mode = ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND
        batch = ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=pos_t,
            out_cache_loc=self.req_to_token.table[slot_per_token, pos_t],
            req_slots=slots,
            seq_lens=[r.kv_len + n for r, n in zip(reqs, extend_lens, strict=True)],
            extend_lens=list(extend_lens),
            attn_backend=self.attn_backend,
        )
        self.attn_backend.init_metadata(batch)
        return batch

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch_size, vocab] of each request's last new token."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        logits: torch.Tensor = self.model(batch)
        return logits

    def check_integrity(self, live: Sequence[Req]) -> None:
        """Every page is free, cached, or owned by exactly one live request."""
        self.allocator.check_integrity()
        if self.kv.radix is not None:
            self.kv.radix.check_integrity()
        owned = [p for r in live for p in r.pages[r.num_prefix_pages :]]
        if len(owned) != len(set(owned)) or set(owned) != self.allocator.pages_in(PageState.USED):
            raise IntegrityError(
                f"USED pages {self.allocator.num_used} != pages owned by {len(live)} live requests "
                f"({len(owned)}): a page leaked or is shared"
            )
