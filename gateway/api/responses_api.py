"""`POST /v1/responses`: OpenAI's Responses API, run as the chat request it is in effect.

The body (gateway/requests/responses.py) becomes chat messages, sampling options and tools. The
handler puts the kept conversation of `previous_response_id` before the input (the response
store, gateway/api/response_store.py) and `instructions` before both, encodes them with the chat
template, runs one `ChoiceJob` (choices.py) and splits its text into output items: a `message`
and a `function_call` per tool call parsed out of it (gateway/requests/tools.py, as chat does).
Unless `store: false`, the conversation it ended is kept for the next request to continue.

Streamed (`stream: true`), the answer is OpenAI's event sequence (gateway/api/response_items.py):
response.created, response.in_progress, per output item output_item.added, its content
(content_part.added, an output_text.delta per chunk, output_text.done, content_part.done; or
function_call_arguments.delta and .done) and output_item.done, then response.completed (or
response.incomplete at `max_output_tokens`). A text answer streams as its tokens come; one that
may hold tool calls is held until it ends (as chat's tool stream). An error after the stream
started ends it with `error` and `response.failed`; one before (no node, a bad schema) is an
HTTP error, as for chat.

The store is this process's memory: with `--workers N > 1` it would be one per worker, and a
chained request would find its predecessor only when it reached the same worker. So there no
response is kept: `previous_response_id` and `store: true` answer 400 saying why and what to do
(`store_refusal`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from gateway.api.choices import ChoiceEnd, ChoiceJob, choice_events, collect
from gateway.api.openai_api import (
    WHOLE_CHOICE,
    APIHandlers,
    Payload,
    PrimedEvents,
    grammar_refusal,
    primed,
    token_budget,
)
from gateway.api.response_items import (
    Answer,
    ResponseEvents,
    ResponseHead,
    new_id,
    request_fields,
)
from gateway.api.response_store import Conversation, ResponseStore
from gateway.config import GatewayConfig, LimitsConfig, ModelInfo
from gateway.dispatch.dispatcher import Dispatcher
from gateway.errors import APIError, bad_request
from gateway.requests.responses import check_call_outputs, parse_responses
from gateway.requests.text import TextCodec
from gateway.requests.tokenize import PromptEncoder
from gateway.requests.tools import ToolSpec, split_calls


def store_refusal(config: GatewayConfig) -> str | None:
    """Why this gateway keeps no responses; None when it keeps them."""
    if config.workers > 1:
        return (
            f"this gateway runs --workers {config.workers} processes, each with its own memory, "
            "so a response kept by one would be unknown to the others and none is kept: send "
            "the whole conversation as `input` items (with `store: false`), or run the gateway "
            "with --workers 1"
        )
    if config.response_store.size == 0:
        return (
            "this gateway keeps no responses (--response-store-size 0): send the whole "
            "conversation as `input` items (with `store: false`)"
        )
    return None


def response_store(config: GatewayConfig) -> ResponseStore | None:
    if store_refusal(config) is not None:
        return None
    return ResponseStore(config.response_store.size, config.response_store.ttl_s)


@dataclass(frozen=True)
class Turn:
    """One request's place in its conversation, and where its answer goes."""

    head: ResponseHead
    conversation: Conversation  # the earlier turns and this input (instructions are not kept)
    tools: ToolSpec | None
    keep: bool  # into the store


class ResponsesHandler(APIHandlers):
    def __init__(
        self,
        codec: TextCodec,
        dispatcher: Dispatcher,
        model: ModelInfo,
        limits: LimitsConfig,
        stream_interval: int = 1,
        encoder: PromptEncoder | None = None,
        *,
        store: ResponseStore | None,
        store_off: str | None,
    ) -> None:
        """`store`: the kept responses, None when `store_off` says why none are kept."""
        super().__init__(codec, dispatcher, model, limits, stream_interval, encoder)
        self.store = store
        self.store_off = store_off or ""

    async def create(self, body: dict[str, Any]) -> Payload:
        self.encoder.bounds.responses_body(body)
        req = parse_responses(body, self.model.served_name, self.limits)
        keep = self._keeps(req.body.store)
        conversation = (*self._earlier(req.body.previous_response_id), *req.input)
        check_call_outputs(conversation)
        ids = await self.encoder.chat((*req.instructions, *conversation), req.tools, "input")
        default = self.limits.defaults.chat_max_tokens
        requested = req.sampling.max_tokens
        budget = token_budget(
            self.model, len(ids), requested, default, "input", "max_output_tokens"
        )
        fields = request_fields(req, self.model.served_name, keep)
        turn = Turn(ResponseHead(new_id("resp"), int(time.time()), fields), conversation,
                    req.tools, keep)  # fmt: skip
        live = req.stream and (req.tools is None or not req.tools.parses_calls)
        interval = self.stream_interval if live else WHOLE_CHOICE
        job = ChoiceJob(0, ids, req.sampling.to_proto(budget))
        events = choice_events(job, self.codec, self.dispatcher, turn.head.id, interval)
        with grammar_refusal(req.sampling):
            if req.stream:
                return self._stream(await primed(events), turn, live)
            [result] = await collect([events])
        assert result.end is not None
        return turn.head.answered(self._finish(turn, result.text, result.end, new_id("msg")))

    def _keeps(self, store: bool | None) -> bool:
        """Whether the response is kept (`store`, default true, where responses are kept)."""
        if self.store is not None:
            return store is not False
        if store:
            raise bad_request("store", f"`store: true` cannot be honoured: {self.store_off}")
        return False

    def _earlier(self, previous_id: str | None) -> Conversation:
        """The kept conversation that `previous_response_id` continues."""
        if previous_id is None:
            return ()
        if self.store is None:
            raise bad_request(
                "previous_response_id", f"`previous_response_id` cannot be used: {self.store_off}"
            )
        conversation = self.store.get(previous_id)
        if conversation is None:
            raise APIError(
                404,
                f"Previous response with id {previous_id!r} not found: it was not kept (`store: "
                f"false`), it expired (--response-store-ttl {self.store.ttl_s:g} s) or newer "
                f"ones took its place (--response-store-size {self.store.size})",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return conversation

    def _finish(self, turn: Turn, text: str, end: ChoiceEnd, message_id: str) -> Answer:
        """The answer as output items, kept with its conversation when the request asked."""
        content, calls = split_calls(text, turn.tools, self.codec.tool_family)
        answer = Answer.of(content, calls, end, message_id)
        if turn.keep and self.store is not None:
            self.store.put(turn.head.id, (*turn.conversation, answer.turn))
        return answer

    async def _stream(
        self, events: PrimedEvents, turn: Turn, live: bool
    ) -> AsyncGenerator[bytes, None]:
        """The event sequence; `live`: the text streams as it comes (no tool calls to parse)."""
        frames = ResponseEvents()
        opening = turn.head.body("in_progress")
        yield frames.state("response.created", opening)
        yield frames.state("response.in_progress", opening)
        message_id = new_id("msg")
        if live:
            for frame in frames.message_opening(0, message_id):
                yield frame
        text, end = "", None
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    text += event.text
                    if live and event.text:
                        yield frames.text_delta(0, message_id, event.text)
                    end = event.end or end
        except APIError as exc:
            for frame in frames.failure(turn.head, exc):
                yield frame
            return
        assert end is not None
        answer = self._finish(turn, text, end, message_id)  # kept before the client hears of it
        for index, item in enumerate(answer.items):
            for frame in frames.item(index, item, opened=live):
                yield frame
        yield frames.state(answer.final_event, turn.head.answered(answer))
