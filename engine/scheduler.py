"""The scheduler core: which requests run in the next forward, and what happens after it.

Queues and states of a request on one node:

    waiting  --admit-->  running (prefilling: pending_len > 1 or no output yet)
                         running (decoding: one pending token per step)  --finish-->  done
    running  --retract (KV pool exhausted)-->  front of waiting, nothing lost
    any      --abort-->  done (pages freed at once)
    running  --first token of a `stop_after_prefill` request-->  parked (pages kept)

Parked requests belong to the node role on top (prefill / decode node, see prefill_node/ and
decode_node/): they keep their pages while a KV transfer is in flight, run in no batch, and
count as live in the integrity check. The role moves them only through the hand-off methods:
`take_prefilled` (P: the requests that just got their first token), `park` (P: a failed room's
request leaves the queues; D: `hold_prompt` parks a request whose KV is to come), `resume` (D:
the KV arrived, the request joins the batch) and `release` (the room is over: pages freed or
cached).

One `step()` is one forward. It carries every decoding request (one token each) plus prefill
chunks under the `chunked_prefill_size` token budget: continuing partially prefilled requests
first, then newly admitted ones. So new requests join without draining the batch and a long
prompt is split across steps while others keep decoding.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from engine.config import EngineConfig
from engine.grammar import GrammarCompiler
from engine.model_runner import ModelRunner
from engine.request import FinishReason, PromptLogprob, Req
from engine.sampling import (
    RequestSampler,
    SampleOutput,
    SamplingParams,
    is_plain_argmax,
    sample_batch,
)
from engine.step_prep import PackedDecodeStep

logger = logging.getLogger(__name__)

# Returns the stop string that `req`'s output now ends with, if any.
StopChecker = Callable[[Req], "str | None"]


@dataclass
class StepOutput:
    req: Req
    new_token_ids: list[int]
    finished: bool
    # Index of the first new token in the request's output lists, fixed when the output is
    # made: it may be emitted after a later step appended more (a decode node's first token).
    start: int = field(init=False)

    def __post_init__(self) -> None:
        self.start = len(self.req.output_ids) - len(self.new_token_ids)


@dataclass
class StepStats:
    num_prefill_reqs: int = 0
    num_prefill_tokens: int = 0
    num_decode_reqs: int = 0
    decode_context: int = 0  # KV tokens the decoding requests attend over, summed
    prefill_chunks: tuple[tuple[int, int], ...] = ()  # (tokens, tokens already in the KV) each
    cached_tokens: int = 0
    forward_s: float = 0.0
    step_s: float = 0.0

    @classmethod
    def of_batch(
        cls, reqs: list[Req], lens: list[int], num_decoding: int, cached: int
    ) -> StepStats:
        """What a step computes, taken before the forward moves each `kv_len` on. The decoding
        requests come first in the batch (a 1-token prefill chunk is no decode)."""
        prefills = zip(reqs[num_decoding:], lens[num_decoding:], strict=True)
        return cls(
            num_prefill_reqs=len(lens) - num_decoding,
            num_prefill_tokens=sum(lens[num_decoding:]),
            num_decode_reqs=num_decoding,
            decode_context=sum(r.kv_len + 1 for r in reqs[:num_decoding]),
            prefill_chunks=tuple((n, r.kv_len) for r, n in prefills),
            cached_tokens=cached,
        )


def record_prompt_logprobs(req: Req, token_logits: torch.Tensor) -> None:
    """Prompt logprobs from the logits of `req`'s chunk about to be added to its KV: row j (at
    position kv_len + j) predicts prompt token kv_len + j + 1."""
    prompt = req.prompt_ids
    if not req.prompt_logprobs:
        req.prompt_logprobs = [None] * len(prompt)
    start = req.kv_len
    count = min(token_logits.shape[0], len(prompt) - 1 - start)
    if count <= 0:
        return
    log_probs = token_logits[:count].float().log_softmax(dim=-1)
    targets = torch.tensor(prompt[start + 1 : start + 1 + count], device=log_probs.device)
    chosen = log_probs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    num_top = req.params.prompt_logprobs or 0
    top_ids: list[list[int]] = [[] for _ in range(count)]
    top_values: list[list[float]] = [[] for _ in range(count)]
    if num_top:
        top = log_probs.topk(num_top, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    for j in range(count):
        top_pairs = list(zip(top_ids[j], top_values[j], strict=True))
        req.prompt_logprobs[start + 1 + j] = PromptLogprob(chosen[j], top_pairs)


def sampling_rows(reqs: list[Req], lens: list[int]) -> list[int]:
    """The batch rows that sample a token at this step: the requests whose `lens[i]` tokens are
    all they have pending (a chunk that leaves part of the prompt for later samples nothing)."""
    return [i for i, (req, n) in enumerate(zip(reqs, lens, strict=True)) if req.pending_len == n]


def graph_samples(batch: object, reqs: list[Req], rows: list[int]) -> bool:
    """True when a step's CUDA graph picks its tokens (engine/cuda_graph.py): a step-prep
    decode step whose every request samples, greedily, with no penalty, grammar or logprobs
    (the argmax that `sample_tokens` would take)."""
    return (
        isinstance(batch, PackedDecodeStep)
        and len(rows) == len(reqs) > 0
        and not any(r.params.logprobs for r in reqs)
        and is_plain_argmax([r.sampler for r in reqs])
    )


def check_prompt_fits(prompt_ids: list[int], context_length: int) -> None:
    if not prompt_ids:
        raise ValueError("prompt is empty: give at least one token")
    if len(prompt_ids) >= context_length:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens, the context length is {context_length}: "
            f"shorten it to at most {context_length - 1} tokens"
        )


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        stop_checker: StopChecker | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.kv = runner.kv
        self.stop_checker = stop_checker
        # Compiles requests' grammars for whoever builds their samplers (None: no tokenizer).
        self.grammars = grammars
        self.eos_ids = frozenset(runner.model_config.eos_token_ids)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._parked: dict[int, Req] = {}  # by id(): requests the node role holds pages for
        self._prefilled: list[Req] = []  # parked since the last take_prefilled()
        self.num_retractions = 0
        self.last_stats = StepStats()
        self._admitted_cached = 0  # prefix-cache hits of the requests admitted this step
        self._num_decoding = 0  # the first this many requests of this step's batch decode
        self._dropped: list[Req] = []  # aborted by the scheduler itself, reported by step()

    # ---- requests in and out -------------------------------------------------------------
    def validate_prompt(self, prompt_ids: list[int]) -> None:
        """Raise ValueError if the prompt can never run here (thread-safe: reads config only)."""
        check_prompt_fits(prompt_ids, self.runner.context_length)

    def new_sampler(self, params: SamplingParams, prompt_ids: list[int]) -> RequestSampler:
        """The sampler of a new request, with its grammar compiled (thread-safe); ValueError
        (GrammarError: the compiler's reason) if the params cannot run on this model."""
        vocab = self.runner.model_config.vocab_size
        if params.prompt_logprobs is not None and self.config.tp_size > 1:
            raise ValueError("prompt_logprobs needs a node with tp_size 1; leave it out here")
        grammar = None
        if params.grammar is not None:
            if self.grammars is None:
                raise ValueError("this model has no tokenizer, so no grammar can be compiled")
            grammar = self.grammars.request_grammar(params.grammar)
            if len(params.grammar_generated_ids) >= len(prompt_ids):
                raise ValueError("grammar generated_ids must be a strict suffix of input_ids")
            if list(prompt_ids[len(prompt_ids) - len(params.grammar_generated_ids) :]) != list(
                params.grammar_generated_ids
            ):
                raise ValueError("grammar generated_ids must equal the end of input_ids")
            for token_id in params.grammar_generated_ids:
                grammar.accept(token_id)  # GrammarViolation (a ValueError) names the token
        return RequestSampler(
            params, prompt_ids, vocab, self.runner.device, grammar, tuple(self.eos_ids)
        )

    def add_request(self, req: Req) -> None:
        self.validate_prompt(req.prompt_ids)
        self.waiting.append(req)

    def flush_cache(self) -> int:
        """Drop every unlocked page of the prefix cache; returns the pages freed."""
        return self.kv.radix.evict(self.kv.allocator.total) if self.kv.radix else 0

    def abort(self, rid: str) -> Req | None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = FinishReason.ABORT
                return req
        for req in self.running:
            if req.rid == rid:
                self._finish(req, FinishReason.ABORT, cache=False)
                return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live_requests(self) -> list[Req]:
        return self.running + list(self._parked.values())

    def check_integrity(self) -> None:
        self.runner.check_integrity(self.live_requests())

    # ---- hand-offs with the node role ----------------------------------------------------
    def park(self, req: Req) -> None:
        """Take `req` out of the queues (wherever it is) and hold it, pages kept, for the role."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._parked[id(req)] = req

    def hold_prompt(self, req: Req) -> bool:
        """Decode node: a slot and pages for `req`'s prompt beyond its cached prefix, parked
        while the prompt's KV comes from a prefill node; False (nothing held) if short."""
        req.slot = self.kv.req_to_token.alloc_slot()
        self.kv.attach_prefix(req)
        if not self.kv.reserve(req, len(req.prompt_ids) - req.kv_len):
            self.kv.release(req, cache=False)
            return False
        self.park(req)
        return True

    def resume(self, req: Req) -> None:
        """Decode node: a parked request whose prompt KV and first token arrived joins the batch."""
        del self._parked[id(req)]
        self.running.append(req)

    def release(self, req: Req, cache: bool) -> None:
        """The role is done with `req`: its pages go back (full pages into the prefix cache with
        `cache`)."""
        self._parked.pop(id(req), None)
        self.kv.release(req, cache=cache)

    def take_prefilled(self) -> list[Req]:
        """The `stop_after_prefill` requests that got their first token since the last call
        (parked already, pages kept)."""
        taken, self._prefilled = self._prefilled, []
        return taken

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        reqs, lens = self._schedule()
        dropped = [StepOutput(r, [], True) for r in self._dropped]
        self._dropped.clear()
        if not reqs:
            return dropped
        composition = self._composition(reqs, lens)
        batch = self.runner.build_batch(reqs, lens)
        rows = sampling_rows(reqs, lens)
        t0 = time.perf_counter()
        if graph_samples(batch, reqs, rows):
            assert isinstance(batch, PackedDecodeStep)
            tokens = self.runner.forward_tokens(batch)
            forward_s = time.perf_counter() - t0  # the launch, as for `forward` below
            outputs = dropped + self._process(reqs, lens, rows, None, tokens.tolist())
        else:
            logits = self.runner.forward(batch)
            forward_s = time.perf_counter() - t0
            for row, token_logits in batch.token_logits.items():
                record_prompt_logprobs(reqs[row], token_logits)
            outputs = dropped + self._process(reqs, lens, rows, logits)
        self._record_stats(composition, forward_s, start)
        return outputs

    def _composition(self, reqs: list[Req], lens: list[int]) -> StepStats:
        return StepStats.of_batch(reqs, lens, self._num_decoding, self._admitted_cached)

    def _record_stats(self, composition: StepStats, forward_s: float, start: float) -> None:
        """`last_stats` of the step of `composition` that began at `start`."""
        step_s = time.perf_counter() - start
        self.last_stats = replace(composition, forward_s=forward_s, step_s=step_s)

    def _schedule(self) -> tuple[list[Req], list[int]]:
        self._admitted_cached = 0
        decoding = self._reserve_decodes()
        self._num_decoding = len(decoding)
        batch: list[Req] = list(decoding)
        lens = [1] * len(decoding)
        budget = self.config.chunked_prefill_size
        decoding_ids = {id(r) for r in decoding}
        for req in [r for r in self.running if id(r) not in decoding_ids]:
            if budget <= 0:
                break
            chunk = min(req.pending_len, budget)
            if not self.kv.reserve(req, chunk):
                break
            batch.append(req)
            lens.append(chunk)
            budget -= chunk
        while budget > 0 and self.waiting and self._can_admit(len(decoding)):
            req = self._pop_waiting()
            self._admitted_cached += req.kv_len
            chunk = min(req.pending_len, budget)
            if not self.kv.reserve(req, chunk):
                self.kv.release(req, cache=False)
                self.waiting.appendleft(req)
                break
            self.running.append(req)
            batch.append(req)
            lens.append(chunk)
            budget -= chunk
        return batch, lens

    def _can_admit(self, num_decoding: int) -> bool:
        # Parked requests (a prefill node's while their KV writes settle, a decode node's
        # while their prompt's KV arrives) hold a slot of the table too.
        if len(self.running) + len(self._parked) >= self.config.max_running_requests:
            return False
        # Keep a page per decoding request for its next step, so admission does not
        # immediately force a retraction.
        return self.kv.available_pages > num_decoding

    def _pop_waiting(self) -> Req:
        if self.config.schedule_policy == "lpm" and self.kv.radix is not None:
            radix = self.kv.radix
            best = max(self.waiting, key=lambda r: radix.match_prefix(r.all_ids[:-1]).num_pages)
            self.waiting.remove(best)
            req = best
        else:
            req = self.waiting.popleft()
        req.slot = self.kv.req_to_token.alloc_slot()
        assert req.slot is not None, "a slot is always free below max_running_requests"
        self.kv.attach_prefix(req)
        if not req.output_ids:
            req.cached_tokens = req.kv_len
        req.timing.mark("scheduled")
        return req

    def _reserve_decodes(self) -> list[Req]:
        """Reserve one KV slot per decoding request, retracting requests while memory is short."""
        decoding = [r for r in self.running if r.is_decoding]
        if self.kv.reserve_decodes(decoding):  # all at once: the common case
            return decoding
        for req in list(decoding):
            while req in self.running and not self.kv.reserve(req, 1):
                victim = self._retract_one()
                if victim is None:
                    break
                if victim in decoding:
                    decoding.remove(victim)
        return [r for r in decoding if r in self.running]

    def _retract_one(self) -> Req | None:
        """Send the most recently admitted request back to the waiting queue."""
        if len(self.running) <= 1:
            if self.running:
                req = self.running[0]
                detail = "the KV pool is too small for this request alone"
                self._finish(req, FinishReason.ABORT, cache=False, detail=detail)
                self._dropped.append(req)
            return None
        victim = self.running.pop()
        self.kv.release(victim, cache=True)
        victim.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(victim)
        logger.info(
            "retracted request %s (KV pool exhausted)", victim.rid, extra={"room": victim.room}
        )
        return victim

    # ---- after the forward ---------------------------------------------------------------
    def _process(  # type: ignore[no-untyped-def]
        self,
        reqs: list[Req],
        lens: list[int],
        sample_rows: list[int],
        logits,
        tokens: list[int] | None = None,
    ) -> list[StepOutput]:
        """Sample rows `sample_rows` (`sampling_rows`) from `logits`, or take `tokens` (every
        request's, picked by the CUDA graph), and move each request on."""
        for req, n in zip(reqs, lens, strict=True):
            req.kv_len += n
        if not sample_rows:
            return []
        samplers = [reqs[i].sampler for i in sample_rows]
        if tokens is not None:
            sampled = SampleOutput.observed(tokens, samplers)
        else:
            rows = logits if len(sample_rows) == len(reqs) else logits[sample_rows]
            sampled = sample_batch(rows, samplers)
        outputs = []
        for j, i in enumerate(sample_rows):
            req = reqs[i]
            token = sampled.token_ids[j]
            req.output_ids.append(token)
            req.output_logprobs.append(sampled.logprobs[j])
            req.output_top_logprobs.append(sampled.top_logprobs[j])
            if req.stop_after_prefill:  # the decode node judges the first token, not us
                self.park(req)
                self._prefilled.append(req)
            else:
                self.check_finish(req, token)
            outputs.append(StepOutput(req, [token], req.finished))
        return outputs

    def check_finish(self, req: Req, token: int) -> None:
        params = req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_ids):
            self._finish(req, FinishReason.STOP, detail=f"token {token}")
        elif req.sampler.grammar_done:
            self._finish(req, FinishReason.STOP, detail="grammar complete")
        elif len(req.output_ids) >= params.max_new_tokens:
            self._finish(req, FinishReason.LENGTH)
        elif req.seq_len >= self.runner.context_length:
            self._finish(req, FinishReason.LENGTH, detail="context length reached")
        elif (
            params.stop
            and self.stop_checker is not None
            and len(req.sampler.output_token_ids) >= params.min_tokens
        ):
            matched = self.stop_checker(req)
            if matched is not None:
                self._finish(req, FinishReason.STOP, detail=matched)

    def _finish(self, req: Req, reason: FinishReason, cache: bool = True, detail: str = "") -> None:
        req.finish_reason = reason
        req.finish_detail = detail
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req, cache=cache)
