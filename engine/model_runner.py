"""Owns the model, the KV memory and the attention backend; turns requests into forwards.

With tensor parallelism (`tp_size > 1`) every rank of a node has a runner over its shard of the
model and of the KV pool (its KV heads, the same page ids on every rank). Only rank 0 has a
scheduler and allocates pages; its `forward` first sends the step to the other ranks
(engine/tp/messages.py), which run `forward_step` in lockstep (engine/tp/workers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.attention import attention_backend_class
from engine.config import EngineConfig
from engine.cuda_graph import DecodeGraphRunner
from engine.eplb.recorder import ExpertLoadCounter
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kv_manager import KVManager
from engine.layer_groups import LayerGroupSignal, LayerStream
from engine.memory import (
    IntegrityError,
    KVLayout,
    PageAllocator,
    PagedKVCache,
    PageStager,
    PageState,
    RadixCache,
    ReqToTokenPool,
)
from engine.model_config import ModelConfig
from engine.models.loader import load_model
from engine.request import Req
from engine.step_prep import PackedDecodeStep
from engine.tp import messages
from engine.tp.group import TPGroup
from engine.tp.partition import plan_tp


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, group: TPGroup | None = None
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.group = group or TPGroup.single()
        shards = plan_tp(model_config, config.tp_size, config.ep_size, config.expert_placement)
        self.shard = shards[self.group.rank]
        self.device = torch.device(config.device)
        self.bind_thread()
        self.context_length = config.context_length or model_config.max_position_embeddings
        if self.context_length > model_config.max_position_embeddings:
            raise ValueError(
                f"context_length {self.context_length} exceeds the model's "
                f"max_position_embeddings {model_config.max_position_embeddings}; lower it"
            )
        self.model = load_model(
            model_config,
            config.load_format,
            config.torch_dtype,
            self.device,
            self.shard,
            self.group,
            config.linear_kernel,
        )
        # Tokens routed per MoE layer and expert (engine/eplb/recorder.py), counted on rank 0:
        # every TP rank routes the same tokens the same way. None for a dense model.
        self.expert_load = ExpertLoadCounter.attach(self.model) if self.group.rank == 0 else None
        self.kv_layout = KVLayout(
            num_layers=model_config.num_layers,
            num_kv_heads=self.shard.num_kv_heads,
            head_dim=model_config.head_dim,
            page_size=config.page_size,
            dtype=config.torch_dtype,
        )
        self.kv_cache = PagedKVCache(
            self.kv_layout, config.num_pages, self.device, config.kv_staging_pages
        )
        # Scattered pages gathered into / scattered out of staging spans for KV transfers.
        self.stager = (
            PageStager(self.kv_cache, config.kv_staging_min_runs)
            if config.kv_staging_pages
            else None
        )
        # One spare slot so a retracted request can be re-admitted while the table is full.
        self.req_to_token = ReqToTokenPool(
            config.max_running_requests + 1, self.context_length + config.page_size, self.device
        )
        self.allocator = PageAllocator(config.num_pages)
        medium = "GPU" if self.device.type == "cuda" else "CPU"
        radix = (
            RadixCache(self.allocator, config.page_size, medium)
            if config.enable_prefix_cache
            else None
        )
        self.kv = KVManager(self.allocator, self.req_to_token, config.page_size, radix)
        backend_cls = attention_backend_class(config.attention_backend)
        self.attn_backend = backend_cls(self.kv_cache, self.req_to_token)
        self.graph_runner: DecodeGraphRunner | None = None
        self.on_shutdown: Callable[[], None] | None = None  # stops the other TP ranks
        # Work that must not wait for a long forward to end (a prefill node reporting finished
        # KV writes): called between decoder layers of the batches `build_batch` makes. On GPU
        # the layers only launch kernels, so it runs before the step's sync, not during it;
        # CUDA-graph decode does not call it, and TP nodes do not set it (engine_loop.py).
        self.interlude: Callable[[], None] | None = None
        # A prefill node streaming KV by layer group (engine/layer_groups.py): asked for a
        # callback for every extend batch; decode batches and graphs never see it.
        self.layer_stream: LayerStream | None = None
        graphs_ok = (
            self.device.type == "cuda"
            and self.group.size == 1  # no TP collectives
            and getattr(self.model, "supports_cuda_graphs", True)  # MoE: engine/models/moe.py
        )
        if graphs_ok and hasattr(self.attn_backend, "init_graph_metadata"):
            # Padding rows read one key through slot 0 (reads only) and write to location 0.
            self.graph_runner = DecodeGraphRunner(
                self.model, self.context_length, pad_slot=0, step_prep=config.graph_step_prep
            )

    def bind_thread(self) -> None:
        """Make this runner's GPU the calling thread's current device. Streams, events, CUDA
        graphs and Triton launches use the current device, which CUDA keeps per thread: a node
        on `--device cuda:1` calls this where it is built and in its engine loop's thread."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def build_batch(
        self,
        reqs: Sequence[Req],
        extend_lens: Sequence[int],
        future_tokens: torch.Tensor | None = None,
    ) -> ForwardBatch | PackedDecodeStep:
        """Batch running `extend_lens[i]` pending tokens of `reqs[i]` (KV already reserved).

        `future_tokens`: the overlap scheduler's tokens still on the device (engine/overlap.py);
        an input id `-1 - j` is a placeholder for `future_tokens[j]`, substituted on the device.
        A decode step for a step-prep CUDA graph stays host lists (`PackedDecodeStep`).
        """
        if self._takes_step_prep(reqs, extend_lens, future_tokens):
            return self._packed_step(reqs, future_tokens)
        self.kv.flush_table()
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        slot_per_token: list[int] = []
        for req, n in zip(reqs, extend_lens, strict=True):
            ids.extend(req.token_ids(req.kv_len, req.kv_len + n))
            positions.extend(range(req.kv_len, req.kv_len + n))
            assert req.slot is not None
            slots.append(req.slot)
            slot_per_token.extend([req.slot] * n)
        dev = self.device
        pos_t = _to_device(positions, dev)
        input_ids = _to_device(ids, dev)
        if future_tokens is not None:
            last = future_tokens.shape[0] - 1
            substitute = future_tokens[(-1 - input_ids).clamp_(0, last)]
            input_ids = torch.where(input_ids < 0, substitute, input_ids)
        mode = ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND
        after_layer = None
        if self.layer_stream is not None and mode is ForwardMode.EXTEND:
            on_group = self.layer_stream.begin(reqs, extend_lens)
            if on_group is not None:
                after_layer = LayerGroupSignal(self.layer_stream.groups, on_group, dev)
        batch = ForwardBatch(
            mode=mode,
            input_ids=input_ids,
            positions=pos_t,
            out_cache_loc=self.req_to_token.table[_to_device(slot_per_token, dev), pos_t],
            req_slots=slots,
            seq_lens=[r.kv_len + n for r, n in zip(reqs, extend_lens, strict=True)],
            extend_lens=list(extend_lens),
            attn_backend=self.attn_backend,
            interlude=self.interlude,
            after_layer=after_layer,
            all_logits_of=tuple(i for i, r in enumerate(reqs) if r.wants_prompt_logprobs),
        )
        self.attn_backend.init_metadata(batch)
        return batch

    def _takes_step_prep(
        self, reqs: Sequence[Req], extend_lens: Sequence[int], future: torch.Tensor | None
    ) -> bool:
        graphs = self.graph_runner
        return (
            graphs is not None
            and graphs.can_run_step(len(reqs), future)
            and all(n == 1 for n in extend_lens)
            and not any(r.wants_prompt_logprobs for r in reqs)
        )

    def _packed_step(self, reqs: Sequence[Req], future: torch.Tensor | None) -> PackedDecodeStep:
        # The graph writes the step's table entries, unless the backend's host-side plan reads
        # them before the replay (FlashInfer's page table): then they are flushed as usual.
        take = not self.attn_backend.plan_reads_table
        locs = self.kv.decode_locations(list(reqs), take)
        self.kv.flush_table()  # the entries left in the queue, if any
        ids, slots, seq_lens = [], [], []
        for req in reqs:
            assert req.slot is not None
            ids.extend(req.token_ids(req.kv_len, req.kv_len + 1))
            slots.append(req.slot)
            seq_lens.append(req.kv_len + 1)
        return PackedDecodeStep(ids, slots, seq_lens, locs, future)

    @torch.inference_mode()
    def forward_tokens(self, step: PackedDecodeStep) -> torch.Tensor:
        """The argmax token of each request's logits [batch_size] on the device, computed
        inside the step's CUDA graph: what `sample_tokens` returns for samplers that pass
        `is_plain_argmax`. Valid until the next forward."""
        assert self.graph_runner is not None
        return self.graph_runner.replay_step(step, self.attn_backend)[1]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch | PackedDecodeStep) -> torch.Tensor:
        """Logits [batch_size, vocab] of each request's last new token."""
        if isinstance(batch, PackedDecodeStep):
            assert self.graph_runner is not None
            return self.graph_runner.replay_step(batch, self.attn_backend)[0]
        if self.group.size > 1:
            messages.send(self.group, messages.MessageKind.FORWARD, self._step(batch).to_arrays())
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        logits: torch.Tensor = self.model(batch)
        return logits

    def shutdown(self) -> None:
        """Stop the node's other tensor-parallel ranks (no-op with TP=1); idempotent."""
        stop, self.on_shutdown = self.on_shutdown, None
        if stop is not None:
            stop()

    def _step(self, batch: ForwardBatch) -> messages.ForwardStep:
        table = self.req_to_token.table
        lens = zip(batch.req_slots, batch.seq_lens, strict=True)
        rows = [table[slot, :seq] for slot, seq in lens]
        return messages.ForwardStep(
            batch.mode,
            batch.input_ids.cpu(),
            batch.positions.cpu(),
            batch.out_cache_loc.cpu(),
            batch.req_slots,
            batch.seq_lens,
            batch.extend_lens,
            torch.cat(rows).cpu(),
        )

    @torch.inference_mode()
    def forward_step(self, step: messages.ForwardStep) -> None:
        """A non-leader rank runs rank 0's step on its shard (its logits are rank 0's too)."""
        dev, table = self.device, self.req_to_token.table
        rows = step.table_rows.to(dev).split(step.seq_lens)
        for slot, row in zip(step.req_slots, rows, strict=True):
            table[slot, : row.numel()] = row
        batch = ForwardBatch(
            mode=step.mode,
            input_ids=step.input_ids.to(dev),
            positions=step.positions.to(dev),
            out_cache_loc=step.out_cache_loc.to(dev),
            req_slots=step.req_slots,
            seq_lens=step.seq_lens,
            extend_lens=step.extend_lens,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.init_metadata(batch)
        self.model(batch)

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
        if self.stager is not None:
            self.stager.area.check_integrity()
            spans = [r.staging for r in live if r.staging is not None]
            if len(spans) != len(set(spans)) or set(spans) != self.stager.area.held:
                raise IntegrityError(
                    f"held staging spans {sorted(self.stager.area.held, key=lambda s: s.start)} "
                    f"!= spans owned by live requests {spans}: a span leaked or is shared"
                )


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor on `device`. Non-blocking: on a GPU a blocking host-to-device copy waits
    for the whole stream, i.e. for the step in flight (engine/overlap.py)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
