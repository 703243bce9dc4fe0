"""The native endpoint, `POST /generate`: text or token ids in, text and token ids out.

Body (`GenerateBody` in protocol.py): `{"text": "..."}` or `{"input_ids": [...]}`, optional
`sampling_params` (the node's names: max_new_tokens, temperature, top_p, top_k, min_p, seed,
stop, stop_token_ids, ignore_eos, logprobs, top_logprobs, penalties; defaults and ranges in
engine/sampling_fields.py; at most one of `json_schema` (an object or JSON text), `regex`
and `ebnf`, which the output must match; `prompt_logprobs: N` for the logprob of every prompt
token after the first and its top N, answered in `meta_info.input_token_logprobs` and
`input_top_logprobs` when not streamed), `stream`, `rid`. Answer:
`{"text", "output_ids", "meta_info": {"id", "finish_reason", "matched", "prompt_tokens",
"completion_tokens", "cached_tokens", "cache_node", "timing", "output_token_logprobs"?}}`;
`cache_node` is the node whose prefix cache served `cached_tokens`; `timing` is the
request's breakdown in seconds (gateway/dispatch/timeline.py). Streaming sends the same
objects with the text and ids of each piece (deltas), `meta_info.finish_reason` on the last,
then `[DONE]`.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from engine.sampling_fields import MAX_NEW_TOKENS
from gateway.api.choices import ChoiceJob, choice_events, collect
from gateway.api.openai_api import (
    WHOLE_CHOICE,
    APIHandlers,
    Payload,
    PrimedEvents,
    grammar_refusal,
    primed,
    token_budget,
)
from gateway.api.sse import DONE, sse
from gateway.errors import APIError
from gateway.requests.protocol import parse_native
from proto import node_pb2


class NativeHandler(APIHandlers):
    async def generate(self, body: dict[str, Any]) -> Payload:
        self.encoder.bounds.native_body(body)
        req = parse_native(body, self.limits)
        req.sampling.check_vocab(self.codec.vocab_size)
        param = "text" if isinstance(req.prompt, str) else "input_ids"
        ids = await self.encoder.prompt(req.prompt, param)
        budget = token_budget(
            self.model, len(ids), req.sampling.max_tokens, MAX_NEW_TOKENS.default, param
        )
        job = ChoiceJob(0, ids, req.sampling.to_proto(budget))
        rid = req.rid or "gen-" + secrets.token_hex(12)
        with grammar_refusal(req.sampling):
            if req.stream:
                interval = self.stream_interval
                events = await primed(
                    choice_events(job, self.codec, self.dispatcher, rid, interval)
                )
                return self._stream(events, rid)
            whole = choice_events(job, self.codec, self.dispatcher, rid, WHOLE_CHOICE)
            [result] = await collect([whole])
        reply = self._object(rid, result.text, result.token_ids, result.logprobs, result.end)
        if req.sampling.prompt_logprobs is not None and result.end is not None:
            reply["meta_info"].update(_prompt_logprobs(ids, result.end.prompt_logprobs))
        return reply

    def _object(
        self,
        rid: str,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[node_pb2.TokenLogprobs],
        end: Any,
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": rid, "finish_reason": None}
        if logprobs:
            meta["output_token_logprobs"] = [
                [lp.logprob, t] for t, lp in zip(token_ids, logprobs, strict=False)
            ]
        if end is not None:
            meta.update(
                finish_reason=end.reason,
                matched=end.matched,
                prompt_tokens=end.prompt_tokens,
                completion_tokens=end.completion_tokens,
                cached_tokens=end.cached_tokens,
                cache_node=end.cache_node,
            )
            if end.timeline is not None:
                meta["timing"] = end.timeline.as_dict()
        return {"text": text, "output_ids": list(token_ids), "meta_info": meta}

    async def _stream(self, events: PrimedEvents, rid: str) -> AsyncGenerator[bytes, None]:
        try:
            async with contextlib.aclosing(events):
                async for e in events:
                    yield sse(self._object(rid, e.text, e.token_ids, e.logprobs, e.end))
        except APIError as exc:
            yield sse(exc.body())
            return
        yield DONE


def _prompt_logprobs(
    ids: Sequence[int], logprobs: Sequence[node_pb2.TokenLogprobs]
) -> dict[str, Any]:
    """`input_token_logprobs` ([logprob, token id] per prompt token, null for the first) and
    `input_top_logprobs` (per token, its top [logprob, token id] pairs)."""
    entries: list[node_pb2.TokenLogprobs | None] = [None, *logprobs]
    return {
        "input_token_logprobs": [
            [lp.logprob if lp is not None else None, t] for t, lp in zip(ids, entries, strict=False)
        ],
        "input_top_logprobs": [
            [[top.logprob, top.token_id] for top in lp.top] if lp is not None else None
            for lp in entries
        ],
    }
