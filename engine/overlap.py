"""Overlap scheduling: the host schedules and builds step N+1 while the GPU runs step N.

Without it a decode step is serial: schedule, build the batch, launch the forward, then wait in
the sampler's `.tolist()` for the tokens, check finishes, stream; the GPU idles through all the
host's work (8.59 ms engine step against 7.06 ms of graph replay at batch 64 on an H200,
benchmarks/gpu-2026-11-23-h200.md). `OverlapScheduler.step()` instead:

    1. schedules step N+1 while step N's tokens are still unknown on the host: a request sampled
       at N carries the placeholder `-1 - j` as its last output id (row j of step N's token
       tensor), so it looks like any decoding request (one pending token);
    2. builds and launches N+1's forward and sampling with no host sync: its input ids take the
       placeholders' tokens from step N's tensor on the device (`ModelRunner.build_batch`), and
       N+1's tokens stay on the device, copied to pinned host memory behind an event (with
       `EngineConfig.graph_step_prep` a greedy decode step's tokens are its CUDA graph's own
       argmax buffer, which the next graph step reads in place: engine/step_prep.py);
    3. only then reads step N's tokens (the GPU has moved on to N+1), puts them in place of the
       placeholders, checks finishes and returns N's outputs: streaming is one step late.

N+1's bookkeeping is done at launch (`kv_len` grows by the extend length, each sampled request
gets its placeholder), so scheduling N+2 sees what the normal mode would see.

A request that finishes at step N (EOS, stop token or string, max tokens, context length) was
already scheduled into N+1: its N+1 token is dropped (placeholder removed, `kv_len` back to the
normal mode's value, so the prefix cache gets the same pages), its pages are freed once with the
rest (N+1's KV write into a freed page lands before any later step can reuse the page: one
stream orders them) and its row of N+1 is skipped when N+1 resolves. An abort between steps drops
the request's unresolved placeholder the same way; its in-flight token is never emitted.

Falls back to the normal step (`Scheduler.step`, after resolving the step in flight):
- while a running or waiting request needs its host values at every step: logprobs, penalties
  (their state is updated from the host token), a grammar (its next mask depends on the token),
  prompt logprobs (read from the prefill's logits) or `stop_after_prefill` (a prefill node's
  KV writes and hand-off read the step's results right after it). Stop strings need no
  fall-back: they are checked on the host when the step resolves, like EOS.
Before a decode step whose KV cannot all be reserved, the step in flight is resolved first (its
finishes free pages, as they would have in the normal mode) and only then is anything retracted.

Greedy outputs equal the normal mode's token for token (tests/test_overlap_schedule.py). The
mechanism runs on CPU tensors too (no copy, no event), where it gains nothing: auto mode turns it
on for CUDA only (`EngineConfig.use_overlap_schedule`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.grammar import GrammarCompiler
from engine.model_runner import ModelRunner
from engine.request import FinishReason, Req
from engine.sampling import sample_tokens
from engine.scheduler import (
    Scheduler,
    StepOutput,
    StopChecker,
    graph_samples,
    sampling_rows,
)
from engine.step_prep import PackedDecodeStep


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; tokens not yet read."""

    sampled: list[tuple[Req, int]]  # row j: (request, index of its placeholder in output_ids)
    tokens: torch.Tensor  # [len(sampled)] on the device: what placeholders `-1 - j` stand for
    host_tokens: torch.Tensor  # pinned host copy of `tokens`, valid once `ready` has passed
    ready: torch.cuda.Event | None  # None on CPU, where the tensors are the same
    extend_of: dict[Req, int] = field(default_factory=dict)  # tokens each request ran here

    def read_tokens(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        tokens: list[int] = self.host_tokens.tolist()
        return tokens


def placeholder(row: int) -> int:
    return -1 - row


def needs_host_values(req: Req) -> bool:
    """True for a request whose every step must be read on the host before the next runs."""
    sampler = req.sampler
    return (
        req.stop_after_prefill
        or req.params.logprobs
        or sampler.has_penalties
        or sampler.grammar is not None
        or req.params.prompt_logprobs is not None
    )


class OverlapScheduler(Scheduler):
    """`Scheduler` whose `step()` returns the outputs of the step launched by the call before."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        stop_checker: StopChecker | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        super().__init__(config, runner, stop_checker, grammars)
        self._inflight: LaunchedStep | None = None
        self._early: list[StepOutput] = []  # outputs of a step resolved while scheduling

    def step(self) -> list[StepOutput]:
        if self._needs_sync_step():
            prev, self._inflight = self._inflight, None
            return self._resolve(prev) + super().step()
        start = time.perf_counter()
        self._early = []
        reqs, lens = self._schedule()
        outputs = self._early + [StepOutput(r, [], True) for r in self._dropped]
        self._dropped.clear()
        prev = self._inflight  # None if `_schedule` had to resolve it
        if not reqs:
            self._inflight = None
            return outputs + self._resolve(prev)
        composition = self._composition(reqs, lens)
        t0 = time.perf_counter()
        self._inflight = self._launch(reqs, lens, prev)
        forward_s = time.perf_counter() - t0  # the launch only: the GPU runs on
        outputs += self._resolve(prev)
        self._record_stats(composition, forward_s, start)
        return outputs

    def _needs_sync_step(self) -> bool:
        return any(needs_host_values(r) for r in itertools.chain(self.running, self.waiting))

    def _launch(self, reqs: list[Req], lens: list[int], prev: LaunchedStep | None) -> LaunchedStep:
        future = prev.tokens if prev is not None and prev.sampled else None
        batch = self.runner.build_batch(reqs, lens, future)
        rows = sampling_rows(reqs, lens)
        if graph_samples(batch, reqs, rows):
            assert isinstance(batch, PackedDecodeStep)
            tokens = self.runner.forward_tokens(batch)
        else:
            tokens = self._sample(self.runner.forward(batch), reqs, rows)
        extend_of = {}
        for req, n in zip(reqs, lens, strict=True):
            req.kv_len += n
            extend_of[req] = n
        device = tokens.device
        sampled = []
        for j, i in enumerate(rows):
            req = reqs[i]
            req.output_ids.append(placeholder(j))
            req.output_logprobs.append(None)
            req.output_top_logprobs.append(None)
            sampled.append((req, len(req.output_ids) - 1))
        host_tokens, ready = tokens, None
        if isinstance(batch, PackedDecodeStep) and device.type != "cuda":
            host_tokens = tokens.clone()  # the graph's buffer: the next replay overwrites it
        if device.type == "cuda":
            host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host_tokens.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedStep(sampled, tokens, host_tokens, ready, extend_of)

    @staticmethod
    def _sample(logits: torch.Tensor, reqs: list[Req], rows: list[int]) -> torch.Tensor:
        """Tokens of batch rows `rows` (requests that sample at this step), on the device."""
        device = logits.device
        if not rows:
            return torch.empty(0, dtype=torch.int64, device=device)
        if len(rows) < len(reqs):
            logits = logits[torch.tensor(rows).to(device, non_blocking=True)]
        return sample_tokens(logits, [reqs[i].sampler for i in rows])

    def _resolve(self, step: LaunchedStep | None) -> list[StepOutput]:
        """Put `step`'s tokens in place of its placeholders; finish and report its requests.

        `self._inflight` is the step after `step` (or None): what a finish here drops."""
        if step is None:
            return []
        outputs = []
        for row, ((req, index), token) in enumerate(
            zip(step.sampled, step.read_tokens(), strict=True)
        ):
            if req.finished:  # aborted, or finished when the step before resolved
                continue
            assert req.output_ids[index] == placeholder(row), "placeholder moved"
            later = req.output_ids[index + 1 :]  # placeholders of the step in flight
            _truncate(req, index + 1)
            req.output_ids[index] = token
            req.sampler.observe(token)
            self.check_finish(req, token)  # sees the request as the normal mode would
            outputs.append(StepOutput(req, [token], req.finished))
            if not req.finished:
                req.output_ids.extend(later)
                req.output_logprobs.extend([None] * len(later))
                req.output_top_logprobs.extend([None] * len(later))
        return outputs

    def _reserve_decodes(self) -> list[Req]:
        # Each decoding request needs at most one new page: count only when free pages are few.
        if self._inflight is not None and self.kv.allocator.num_free < len(self.running):
            need = sum(self.kv.pages_for(r, 1) for r in self.running if r.is_decoding)
            if need > self.kv.available_pages:  # resolve first: its finishes free pages
                prev, self._inflight = self._inflight, None
                self._early.extend(self._resolve(prev))
        return super()._reserve_decodes()

    def abort(self, rid: str) -> Req | None:
        req = super().abort(rid)
        if req is not None:  # a waiting request too: retracted while its token was in flight
            self._drop_unresolved(req)
        return req

    def _finish(self, req: Req, reason: FinishReason, cache: bool = True, detail: str = "") -> None:
        self._drop_unresolved(req)
        if req in self.waiting:  # retracted while its last token was in flight
            self.waiting.remove(req)
        super()._finish(req, reason, cache, detail)

    def _drop_unresolved(self, req: Req) -> None:
        """Forget what the step in flight computed for a request that ends now: its placeholder
        and its KV (the pages are freed next; the step's write into them precedes any reuse)."""
        if self._inflight is not None:
            req.kv_len -= self._inflight.extend_of.pop(req, 0)
        unresolved = sum(1 for _ in itertools.takewhile(lambda t: t < 0, reversed(req.output_ids)))
        _truncate(req, len(req.output_ids) - unresolved)


def _truncate(req: Req, length: int) -> None:
    del req.output_ids[length:]
    del req.output_logprobs[length:]
    del req.output_top_logprobs[length:]
