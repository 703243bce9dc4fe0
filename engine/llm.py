"""Offline API for scripts and tests: `LLM(...).generate(prompts, params)`.

All prompts go into one scheduler and are batched continuously (chunked prefill, prefix cache,
retraction), exactly as a server would run them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.model_fetch import resolve_model
from engine.request import PromptLogprob, Req
from engine.sampling import SamplingParams
from engine.tokenizer import trim_at_stop

Prompt = str | Sequence[int]


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    finish_detail: str
    cached_tokens: int
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first.
    prompt_logprobs: list[PromptLogprob | None] | None = None


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.config = EngineConfig(model_path=resolve_model(model), **engine_kwargs)
        engine = build_engine(self.config)
        self.model_config = engine.model_config
        self.tokenizer = engine.tokenizer
        self.scheduler = engine.scheduler
        self.runner = engine.scheduler.runner
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[GenerationOutput]:
        plist = _broadcast_params(params, len(prompts))
        reqs = [self._make_req(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        for req in reqs:
            self.scheduler.add_request(req)
        bar = tqdm(total=len(reqs), disable=not progress, desc="generate")
        pending = {r.rid for r in reqs}
        while pending:
            for out in self.scheduler.step():
                if out.finished and out.req.rid in pending:
                    pending.discard(out.req.rid)
                    bar.update(1)
        bar.close()
        return [self._output(r) for r in reqs]

    def chat(
        self,
        messages_list: Sequence[Sequence[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        prompts = [
            list(
                self.tokenizer.apply_chat_template(
                    list(m), add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for m in messages_list
        ]
        return self.generate(prompts, params)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks this LLM spawned (nothing to do with TP=1)."""
        self.runner.shutdown()

    def _make_req(self, prompt: Prompt, params: SamplingParams) -> Req:
        ids = self.encode(prompt)
        sampler = self.scheduler.new_sampler(params, ids)
        return Req(rid=f"offline-{next(self._ids)}", prompt_ids=ids, params=params, sampler=sampler)

    def _output(self, req: Req) -> GenerationOutput:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
            text = trim_at_stop(text, req.params.stop)
        return GenerationOutput(
            prompt_token_ids=req.prompt_ids,
            token_ids=list(req.output_ids),
            text=text,
            finish_reason=req.finish_reason.value if req.finish_reason else "abort",
            finish_detail=req.finish_detail,
            cached_tokens=req.cached_tokens,
            logprobs=req.output_logprobs,
            top_logprobs=req.output_top_logprobs,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
        )


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
