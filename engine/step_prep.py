"""A decode step's inputs as one packed host tensor, and what the CUDA graph derives from it.

Without this, every graph replay copied several host lists to the device (the new req_to_token
entries, input ids, positions, the attention plan's slots and lengths) and ran a few small
kernels to write the table, index it and substitute the overlap scheduler's future tokens, all
on the host's side of the step. With `EngineConfig.graph_step_prep` the host fills one int64
tensor of `PACKED_ROWS` rows by the graph's bucket (`pack_decode_step`), the runner copies it to
the device in one copy, and everything else is computed inside the captured graph from that
tensor by `derive_decode_step`:

    positions     = seq_len - 1
    out_cache_loc = the new token's KV location (reserved on the host: the packed row)
    req_to_token[slot, position] = out_cache_loc  (the step's table entry, queued by
                    `KVManager.reserve_decodes`, is written here instead of by `flush_table`,
                    unless the backend's host-side plan reads the table before the replay:
                    FlashInfer's page table; then both write the same value)
    input id      = future_tokens[-1 - id] where id < 0 (the overlap scheduler's placeholder)
    attention     = (slot, seq_len) per row, int32; the backend derives the rest (split bounds)

Padding rows (a batch smaller than its bucket) are packed with slot `pad_slot`, input id 0,
seq_len 0 and location 0: `derive_decode_step` gives them position 0, one key to read (seq_len 1
for attention, through `pad_slot`: a read only), the scratch KV location 0 to write, and their
table write lands in the table's last column, which no request reaches (a request ends at the
context length; the table is a page wider), so they change no request's KV or table row (the
invariant of engine/cuda_graph.py). A real row always has seq_len >= 1.

Everything here is plain torch and device-agnostic: the CPU tests compare it with the batch
`ModelRunner.build_batch` builds on the host (tests/test_step_prep.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Rows of the packed tensor.
ROW_INPUT_IDS = 0  # token id, or the placeholder -1 - j for the future token j
ROW_SLOTS = 1  # request slot (row of req_to_token)
ROW_SEQ_LENS = 2  # KV length after this step (the new token included); 0: a padding row
ROW_OUT_LOCS = 3  # KV location of the new token (position seq_len - 1)
PACKED_ROWS = 4


@dataclass
class PackedDecodeStep:
    """A decode step bound for a captured graph: one token per request, host lists only.

    `future_tokens` are the overlap scheduler's tokens still on the device (engine/overlap.py),
    which the placeholders `-1 - j` in `input_ids` stand for."""

    input_ids: list[int]
    slots: list[int]
    seq_lens: list[int]
    out_cache_locs: list[int]
    future_tokens: torch.Tensor | None = None
    # Always empty: prompt logprobs never take this path (a ForwardBatch's field, kept so the
    # scheduler reads both kinds of batch alike).
    token_logits: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)


def pack_decode_step(step: PackedDecodeStep, bucket: int, pad_slot: int, out: torch.Tensor) -> None:
    """Fill the host tensor `out` ([PACKED_ROWS, bucket] int64) with `step`'s rows, then
    padding rows (slot `pad_slot`, input id 0, seq_len 0, location 0) up to `bucket`."""
    size = step.batch_size
    if size > bucket:
        raise ValueError(f"a decode step of {size} requests does not fit the bucket {bucket}")
    pad = bucket - size
    rows = [
        step.input_ids + [0] * pad,
        step.slots + [pad_slot] * pad,
        step.seq_lens + [0] * pad,
        step.out_cache_locs + [0] * pad,
    ]
    out.copy_(torch.tensor(rows, dtype=torch.int64))


@dataclass
class DecodeStepInputs:
    """What a decode forward reads, derived on the device from the packed rows."""

    input_ids: torch.Tensor  # [bucket] int64, future tokens substituted
    positions: torch.Tensor  # [bucket] int64
    out_cache_loc: torch.Tensor  # [bucket] int64; 0 (scratch) for padding rows
    slots: torch.Tensor  # [bucket] int32, the attention plan's rows of req_to_token
    seq_lens: torch.Tensor  # [bucket] int32, the attention plan's lengths (padding: 1)


def derive_decode_step(
    packed: torch.Tensor, table: torch.Tensor, future_tokens: torch.Tensor
) -> DecodeStepInputs:
    """The step's inputs from `packed` ([PACKED_ROWS, bucket] on `table`'s device), with no
    host sync (it runs inside a CUDA-graph capture); writes the new tokens' entries of `table`
    (req_to_token). `future_tokens` is a device buffer holding the placeholders' tokens (any
    content where none is used)."""
    ids = packed[ROW_INPUT_IDS]
    slots = packed[ROW_SLOTS]
    seq_lens = packed[ROW_SEQ_LENS]
    locs = packed[ROW_OUT_LOCS]
    positions = (seq_lens - 1).clamp_(min=0)
    scratch_column = torch.full_like(positions, table.shape[1] - 1)
    table[slots, torch.where(seq_lens > 0, positions, scratch_column)] = locs
    last = future_tokens.shape[0] - 1
    substitute = future_tokens[(-1 - ids).clamp_(0, last)]
    input_ids = torch.where(ids < 0, substitute, ids)
    return DecodeStepInputs(
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=locs,
        slots=slots.to(torch.int32),
        seq_lens=seq_lens.clamp(min=1).to(torch.int32),
    )


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] -> [B] int64 (into `out` if given): `sample_tokens`' argmax fast path, the same
    op (first of ties), so that a CUDA graph can compute it."""
    if out is None:
        return logits.argmax(dim=-1)
    return torch.argmax(logits, dim=-1, out=out)
