"""The OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

A handler parses the body (protocol.py), tokenises (text.py), checks the token budget against
the context length, makes one `ChoiceJob` per (prompt, choice) and runs them (choices.py). It
returns either the response object or, for `stream: true`, the SSE byte stream. A streaming
handler waits for the first event before returning, so that a request no node can take still
gets a proper HTTP error instead of a 200 stream that fails.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from typing import Any

from gateway.api.choices import (
    ChoiceEvent,
    ChoiceJob,
    ChoiceResult,
    choice_events,
    collect,
    lane_takes,
    merge,
    usage,
)
from gateway.api.sse import DONE, ChunkFrames, TextFrames, sse
from gateway.config import LimitsConfig, ModelInfo
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.lane import LaneFrames, TokenLane
from gateway.errors import APIError, bad_request
from gateway.requests.protocol import (
    SamplingOptions,
    model_not_found,
    parse_chat,
    parse_completion,
)
from gateway.requests.text import TextCodec
from gateway.requests.tokenize import PromptEncoder, prompt_too_long
from gateway.requests.tools import ToolSpec, split_calls
from proto import node_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A non-streamed choice is decoded in one go at its end (unless it has stop strings).
WHOLE_CHOICE = 1 << 62

Payload = dict[str, Any] | AsyncGenerator[bytes, None] | LaneFrames


def token_budget(
    model: ModelInfo,
    prompt_len: int,
    requested: int | None,
    default: int | None,
    param: str,
    max_param: str = "max_tokens",
) -> int:
    """max_new_tokens for a prompt (`param`): the request's (`max_param`), else the default,
    within the context."""
    room = model.context_length - prompt_len
    if room < 1:
        raise prompt_too_long(param, prompt_len, model.context_length)
    if requested is not None and requested > room:
        raise bad_request(
            max_param,
            f"{max_param}={requested} plus the prompt's {prompt_len} tokens exceed the context "
            f"length of {model.context_length}: ask for at most {room}",
            code="context_length_exceeded",
        )
    return min(requested or default or room, room)


@contextlib.contextmanager
def grammar_refusal(sampling: SamplingOptions) -> Iterator[None]:
    """A node's refusal of the request's grammar (the compiler's reason) as a 400 naming the
    field the grammar came from (`response_format.json_schema.schema`, ...)."""
    try:
        yield
    except APIError as exc:
        grammar, param = sampling.grammar, sampling.grammar_param
        if grammar is None or exc.status != 400 or exc.param is not None:
            raise
        marker = f"invalid {grammar.kind}: "
        if marker not in exc.message:
            raise
        reason = exc.message.split(marker, 1)[1]
        raise bad_request(param, f"`{param}` is not a valid {grammar.kind}: {reason}") from None


def _completion_text(index: int, text: str) -> dict[str, Any]:
    """A completion chunk's choice that carries only text."""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": None}


def _chat_text(index: int, text: str) -> dict[str, Any]:
    """A chat chunk's choice that carries only content."""
    return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}


class PrimedEvents:
    """A choice event stream whose first event was pulled already (see `primed`).

    `__anext__` hands out the underlying generator's own awaitable: no generator frame of its
    own per event, which a streamed token would otherwise pay on top of the others.
    """

    def __init__(self, first: ChoiceEvent, events: AsyncGenerator[ChoiceEvent, None]) -> None:
        self._first: ChoiceEvent | None = first
        self._events = events

    def __aiter__(self) -> PrimedEvents:
        return self

    def __anext__(self) -> Awaitable[ChoiceEvent]:
        first, self._first = self._first, None
        return _ready(first) if first is not None else self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()


async def _ready(event: ChoiceEvent) -> ChoiceEvent:
    return event


async def primed(events: AsyncGenerator[ChoiceEvent, None]) -> PrimedEvents:
    """Pull the first event now (errors raise here); the stream yields it and the rest lazily."""
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    return PrimedEvents(first, events)


class APIHandlers:
    """What the handlers of every API serve with."""

    def __init__(
        self,
        codec: TextCodec,
        dispatcher: Dispatcher,
        model: ModelInfo,
        limits: LimitsConfig,
        stream_interval: int = 1,
        encoder: PromptEncoder | None = None,
    ) -> None:
        self.codec = codec
        self.encoder = encoder or PromptEncoder(codec, model.context_length, 1, limits.max_n)
        self.dispatcher = dispatcher
        self.model = model
        self.limits = limits
        self.stream_interval = stream_interval  # tokens per streamed chunk (--stream-interval)


class OpenAIHandlers(APIHandlers):
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card()]}

    def model_card(self, model_id: str) -> dict[str, Any]:
        """`GET /v1/models/{id}`: the served model's card; 404 for any other id."""
        if model_id != self.model.served_name:
            raise model_not_found(model_id, self.model.served_name, param=None)
        return self._card()

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.model.served_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": self.model.context_length,
            # what a request gets for the sampling fields it leaves out (--generation-config)
            "generation_defaults": self.limits.defaults.generation.as_dict(),
            "default_max_tokens": {
                "chat": self.limits.defaults.chat_max_tokens,
                "completions": COMPLETIONS_DEFAULT_MAX_TOKENS,
            },
        }

    async def completions(self, body: dict[str, Any]) -> Payload:
        self.encoder.bounds.completion_body(body)
        req = parse_completion(body, self.model.served_name, self.limits)
        req.sampling.check_vocab(self.codec.vocab_size)
        # scoring a prompt draws one token (its forward gives the prompt's logprobs), unanswered
        requested = 1 if req.score_only else req.sampling.max_tokens
        jobs: list[ChoiceJob] = []
        prompt_tokens = 0
        for p_index, prompt in enumerate(req.prompts):
            ids = await self.encoder.prompt(prompt)
            prompt_tokens += len(ids)
            budget = token_budget(
                self.model, len(ids), requested, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt"
            )
            echo = (
                (prompt if isinstance(prompt, str) else self.codec.decode(ids)) if req.echo else ""
            )
            for c in range(req.n):
                sampling = req.sampling.to_proto(budget, c)
                jobs.append(ChoiceJob(p_index * req.n + c, ids, sampling, echo, req.score_only))
        rid = "cmpl-" + secrets.token_hex(12)
        lane = self._lane(jobs, req.stream)
        streams = self._run(jobs, rid, req.stream, lane)
        with grammar_refusal(req.sampling):
            if req.stream:
                events = await primed(merge(streams))
                frames = self._completion_stream(
                    events, rid, req.include_usage, prompt_tokens, lane
                )
                return frames if lane is None else LaneFrames(frames, lane)
            results = await collect(streams)
        return {
            **self._header(rid, "text_completion"),
            "choices": [
                {
                    "index": r.index,
                    "text": r.text,
                    "logprobs": self._completion_logprobs(
                        r, req.sampling, jobs[r.index].prompt_ids
                    ),
                    "finish_reason": r.end.reason if r.end else None,
                }
                for r in results
            ],
            "usage": usage([r.end for r in results if r.end], prompt_tokens),
        }

    async def chat(self, body: dict[str, Any]) -> Payload:
        self.encoder.bounds.chat_body(body)
        req = parse_chat(body, self.model.served_name, self.limits)
        req.sampling.check_vocab(self.codec.vocab_size)
        ids = await self.encoder.chat(req.messages, req.tools)
        default = self.limits.defaults.chat_max_tokens
        budget = token_budget(self.model, len(ids), req.sampling.max_tokens, default, "messages")
        jobs = [ChoiceJob(c, ids, req.sampling.to_proto(budget, c)) for c in range(req.n)]
        rid = "chatcmpl-" + secrets.token_hex(12)
        tool_calls = req.tools is not None and req.tools.parses_calls  # text held to its end
        lane = None if tool_calls else self._lane(jobs, req.stream)
        streams = self._run(jobs, rid, req.stream, lane)
        with grammar_refusal(req.sampling):
            if req.stream:
                events = await primed(merge(streams))
                if tool_calls:
                    assert req.tools is not None
                    return self._tool_stream(
                        events, rid, req.tools, req.include_usage, len(ids), req.functions
                    )
                frames = self._chat_stream(events, rid, req.n, req.include_usage, len(ids), lane)
                return frames if lane is None else LaneFrames(frames, lane)
            results = await collect(streams)
        return {
            **self._header(rid, "chat.completion"),
            "choices": [
                {
                    "index": r.index,
                    **self._chat_answer(
                        r.text, r.end.reason if r.end else None, req.tools, req.functions
                    ),
                    "logprobs": self._chat_logprobs(r.token_ids, r.logprobs, req.sampling),
                }
                for r in results
            ],
            "usage": usage([r.end for r in results if r.end], len(ids)),
        }

    def _run(
        self, jobs: Sequence[ChoiceJob], rid: str, stream: bool, lane: TokenLane | None = None
    ) -> list[AsyncGenerator[ChoiceEvent, None]]:
        interval = self.stream_interval if stream else WHOLE_CHOICE
        return [
            choice_events(job, self.codec, self.dispatcher, rid, interval, lane) for job in jobs
        ]

    @staticmethod
    def _lane(jobs: Sequence[ChoiceJob], stream: bool) -> TokenLane | None:
        """A fast lane (gateway/dispatch/lane.py) for a stream of one text-only choice."""
        return TokenLane() if stream and len(jobs) == 1 and lane_takes(jobs[0].sampling) else None

    def _header(self, rid: str, kind: str) -> dict[str, Any]:
        return {
            "id": rid,
            "object": kind,
            "created": int(time.time()),
            "model": self.model.served_name,
        }

    def _completion_stream(
        self,
        events: PrimedEvents,
        rid: str,
        include_usage: bool,
        prompt_tokens: int,
        lane: TokenLane | None = None,
    ) -> AsyncGenerator[bytes, None]:
        offsets: dict[int, int] = {}  # per choice: characters streamed (logprobs' text_offset)

        def choice(event: ChoiceEvent) -> dict[str, Any]:
            logprobs = None
            if event.logprobs:
                offset = offsets.get(event.index, 0)
                logprobs = self._completion_logprob_lists(event.token_ids, event.logprobs, offset)
                offsets[event.index] = offset + sum(len(t) for t in logprobs["tokens"])
            return {
                "index": event.index,
                "text": event.text,
                "logprobs": logprobs,
                "finish_reason": event.end.reason if event.end else None,
            }

        header = self._header(rid, "text_completion")
        return self._stream(
            events, header, _completion_text, choice, include_usage, prompt_tokens, lane
        )

    def _chat_stream(
        self,
        events: PrimedEvents,
        rid: str,
        n: int,
        include_usage: bool,
        prompt_tokens: int,
        lane: TokenLane | None = None,
    ) -> AsyncGenerator[bytes, None]:
        def choice(event: ChoiceEvent) -> dict[str, Any]:
            logprobs = None
            if event.logprobs:
                logprobs = {"content": self._chat_entries(event.token_ids, event.logprobs)}
            return {
                "index": event.index,
                "delta": {"content": event.text} if event.text else {},
                "logprobs": logprobs,
                "finish_reason": event.end.reason if event.end else None,
            }

        header = self._header(rid, "chat.completion.chunk")
        if include_usage:
            header["usage"] = None
        roles = [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}
            for index in range(n)
        ]  # fmt: skip
        return self._stream(
            events, header, _chat_text, choice, include_usage, prompt_tokens, lane, roles
        )

    async def _stream(
        self,
        events: PrimedEvents,
        header: dict[str, Any],
        text_choice: Callable[[int, str], dict[str, Any]],
        choice: Callable[[ChoiceEvent], dict[str, Any]],
        include_usage: bool,
        prompt_tokens: int,
        lane: TokenLane | None,
        opening: Sequence[dict[str, Any]] = (),
    ) -> AsyncGenerator[bytes, None]:
        """A streamed answer: the `opening` choices, then a chunk per event (`text_choice` for
        text only, which the fast lane may frame too; `choice` for the rest), the usage chunk if
        asked for and `[DONE]`. An error after the first chunk ends the stream with its body."""
        frames = ChunkFrames.for_header(header)
        texts = TextFrames(frames, text_choice)
        if lane is not None:
            lane.frame = texts.event_frame
        ends = []
        for first in opening:
            yield frames.choice(first)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if event.end is not None:
                        ends.append(event.end)
                    elif not event.logprobs:
                        if event.text:
                            yield texts.frame(event.index, event.text)
                        continue
                    yield frames.choice(choice(event))
        except APIError as exc:
            yield sse(exc.body())
            return
        if include_usage:
            yield sse({**header, "choices": [], "usage": usage(ends, prompt_tokens)})
        yield DONE

    # -- tool calls -------------------------------------------------------------------------

    def _chat_answer(
        self, text: str, finish: str | None, tools: ToolSpec | None, functions: bool = False
    ) -> dict[str, Any]:
        """`message` and `finish_reason` of a chat choice: its tool calls parsed out, if any
        (for the deprecated `functions`: its one call as `function_call`)."""
        content, calls = split_calls(text, tools, self.codec.tool_family)
        if not calls:
            return {"message": {"role": "assistant", "content": text}, "finish_reason": finish}
        assert tools is not None
        message: dict[str, Any]
        if functions:
            call = {"name": calls[0].name, "arguments": calls[0].arguments}
            message = {"role": "assistant", "content": content or None, "function_call": call}
            return {"message": message, "finish_reason": "function_call"}
        message = {
            "role": "assistant",
            "content": content or None,
            "tool_calls": [c.as_openai() for c in calls],
        }
        return {"message": message, "finish_reason": "stop" if tools.named else "tool_calls"}

    async def _tool_stream(
        self,
        events: PrimedEvents,
        rid: str,
        tools: ToolSpec,
        include_usage: bool,
        prompt_tokens: int,
        functions: bool = False,
    ) -> AsyncGenerator[bytes, None]:
        """A chat stream whose choices may be tool calls: each choice's text is held until it
        ends, then sent as its content or as `tool_calls` (`function_call`) deltas (OpenAI's
        chunk shape)."""
        header = self._header(rid, "chat.completion.chunk")
        if include_usage:
            header["usage"] = None
        frames = ChunkFrames.for_header(header)
        texts: dict[int, str] = {}
        ends = []
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    texts[event.index] = texts.get(event.index, "") + event.text
                    if event.end is None:
                        continue
                    ends.append(event.end)
                    text = texts[event.index]
                    answer = self._chat_answer(text, event.end.reason, tools, functions)
                    message = answer["message"]
                    delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
                    if "function_call" in message:
                        delta["function_call"] = message["function_call"]
                    if "tool_calls" in message:
                        delta["tool_calls"] = [
                            {"index": i, **call} for i, call in enumerate(message["tool_calls"])
                        ]
                    for chunk in (
                        {"delta": delta, "finish_reason": None},
                        {"delta": {}, "finish_reason": answer["finish_reason"]},
                    ):
                        yield frames.choice({"index": event.index, "logprobs": None, **chunk})
        except APIError as exc:
            yield sse(exc.body())
            return
        if include_usage:
            yield sse({**header, "choices": [], "usage": usage(ends, prompt_tokens)})
        yield DONE

    # -- logprobs ---------------------------------------------------------------------------

    def _chat_logprobs(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[node_pb2.TokenLogprobs],
        sampling: SamplingOptions,
    ) -> dict[str, Any] | None:
        if not sampling.logprobs:
            return None
        return {"content": self._chat_entries(token_ids, logprobs)}

    def _chat_entries(
        self, token_ids: Sequence[int], logprobs: Sequence[node_pb2.TokenLogprobs]
    ) -> list[dict[str, Any]]:
        entries = []
        for token_id, lp in zip(token_ids, logprobs, strict=False):
            entries.append({**self._token_entry(token_id, lp.logprob), "top_logprobs": [
                self._token_entry(top.token_id, top.logprob) for top in lp.top
            ]})  # fmt: skip
        return entries

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.codec.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _completion_logprobs(
        self, result: ChoiceResult, sampling: SamplingOptions, prompt_ids: Sequence[int]
    ) -> dict[str, Any] | None:
        if not sampling.logprobs:
            return None
        if sampling.prompt_logprobs is None or result.end is None:
            return self._completion_logprob_lists(result.token_ids, result.logprobs, 0)
        # `echo`: the prompt's tokens first, the first of them without a logprob (OpenAI's shape)
        first = self.codec.token_text(prompt_ids[0])
        lists: dict[str, list[Any]] = {
            "tokens": [first],
            "token_logprobs": [None],
            "top_logprobs": [None],
            "text_offset": [0],
        }
        prompt = self._completion_logprob_lists(
            prompt_ids[1:], result.end.prompt_logprobs, len(first)
        )
        offset = len(first) + sum(len(t) for t in prompt["tokens"])
        completion = self._completion_logprob_lists(result.token_ids, result.logprobs, offset)
        for key, values in lists.items():
            values.extend(prompt[key])
            values.extend(completion[key])
        return lists

    def _completion_logprob_lists(
        self, token_ids: Sequence[int], logprobs: Sequence[node_pb2.TokenLogprobs], offset: int
    ) -> dict[str, Any]:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, logprobs, strict=False):
            text = self.codec.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            tops.append({self.codec.token_text(t.token_id): t.logprob for t in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
