"""A generation request as the scheduler sees it.

Token bookkeeping: `all_ids = prompt_ids + output_ids`; `kv_len` of them have KV in the cache.
`pages` cover those tokens: the first `num_prefix_pages` came from the radix cache (CACHED,
locked through `prefix_node`); the rest are this request's own USED pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.memory.radix_cache import RadixNode
from engine.memory.staging import StagingSpan
from engine.sampling import RequestSampler, SamplingParams
from engine.timing import RequestTiming


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"
    PREFILLED = "prefilled"  # prefill node: KV and first token handed to the decode node


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's logprob given the tokens before it, and the top-n tokens there."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class TransferSummary:
    """What a prefill node sent for one request."""

    pages: int
    bytes: int
    descriptors: int
    page_id_writes: int = 0  # of its KV writes, those issued by page ids (write_pages)


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: RequestSampler
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    # With params.prompt_logprobs: entry i for prompt token i (None for the first), set as the
    # chunks that predict them run (idempotent: a retracted request recomputes the same values).
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    num_prefix_pages: int = 0
    prefix_node: RadixNode | None = None
    kv_len: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    finish_reason: FinishReason | None = None
    finish_detail: str = ""
    num_retractions: int = 0
    # Disaggregation: the bootstrap room and the node on the other side ("" when colocated).
    room: int = 0
    peer_node_id: str = ""
    room_ticket: str = ""  # D: the gateway's GenerateRequest.room_ticket, forwarded to bootstrap
    stop_after_prefill: bool = False  # prefill node: hand off after the first token, no decode
    transfer: TransferSummary | None = None
    staging: StagingSpan | None = None  # staging pages its KV transfer holds (memory/staging.py)
    timing: RequestTiming = field(default_factory=RequestTiming)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """`all_ids[start:end]` without copying the whole sequence (a decode step needs one)."""
        split = len(self.prompt_ids)
        if start >= split:
            return self.output_ids[start - split : end - split]
        if end <= split:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - split]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while prompt positions are still to run for their logprobs."""
        return self.params.prompt_logprobs is not None and self.kv_len < len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending_len(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.seq_len - self.kv_len

    @property
    def is_decoding(self) -> bool:
        return bool(self.output_ids) and self.pending_len == 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
