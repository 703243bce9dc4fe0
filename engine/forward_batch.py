"""One model forward: the tokens to run, where their KV goes, and the attention backend's metadata.

A batch mixes requests freely: a request contributes `extend_len` new tokens on top of
`seq_len - extend_len` tokens already in the KV cache. DECODE is the special case where every
request contributes exactly one token (the backend may then use its batched/graph path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend


class ForwardMode(Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    out_cache_loc: torch.Tensor  # [num_tokens] KV location of each new token
    req_slots: list[int]  # row of each request in req_to_token
    seq_lens: list[int]  # KV length of each request after this forward
    extend_lens: list[int]  # new tokens of each request in this forward
    attn_backend: AttentionBackend
    attn_metadata: Any = field(default=None)
    # Called between decoder layers on the engine thread (see ModelRunner.interlude).
    interlude: Callable[[], None] | None = None
    # Called with the layer's index after each decoder layer, on the engine thread: an extend
    # batch's layer-group signal (engine/layer_groups.py) when its KV is streamed; else None.
    after_layer: Callable[[int], None] | None = None
    # Requests (batch rows) whose every new token's logits the model also returns, in
    # `token_logits` (prompt logprobs; TP 1 and eager forwards only).
    all_logits_of: tuple[int, ...] = ()
    token_logits: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens, strict=True)]

    def token_rows(self, row: int) -> range:
        """Rows of request `row`'s new tokens in the packed token dimension."""
        start = sum(self.extend_lens[:row])
        return range(start, start + self.extend_lens[row])

    @property
    def last_token_index(self) -> torch.Tensor:
        """Row of each request's last new token in the packed token dimension."""
        ends = torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0) - 1
        # Non-blocking: a blocking host-to-GPU copy waits for the stream, i.e. for the step in
        # flight, which would undo the overlap scheduler's point (engine/overlap.py).
        return ends.to(self.input_ids.device, non_blocking=True)
