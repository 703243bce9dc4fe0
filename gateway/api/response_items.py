"""What `POST /v1/responses` answers: the response object, its output items, its stream's events.

- `ResponseHead`: what every state of one response object shares (id, creation time, the
  request's own fields echoed as OpenAI echoes them); `body(status, ...)` is the object in that
  state: `in_progress` (a stream's opening events), `completed`, `incomplete`
  (`incomplete_details.reason: max_output_tokens`) or `failed` (with `error`).
- `Answer`: a finished answer as output items: a `message` holding the text (absent when the
  answer is tool calls only) and a `function_call` item per call, in OpenAI's shapes.
- `ResponseEvents`: the SSE events of one stream (`event: <type>` and `data: <json>` lines),
  numbered by `sequence_number` from 0.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine import sampling_fields as table
from gateway.api.choices import ChoiceEnd
from gateway.api.sse import sse_event
from gateway.errors import APIError
from gateway.requests.protocol import ChatMessage
from gateway.requests.responses import FunctionChoice, ResponsesRequest
from gateway.requests.tools import ToolCall

Item = dict[str, Any]


def new_id(prefix: str) -> str:
    """An object's id in OpenAI's form: `resp_...`, `msg_...`, `fc_...`."""
    return f"{prefix}_{secrets.token_hex(24)}"


def request_fields(req: ResponsesRequest, model: str, store: bool) -> dict[str, Any]:
    """The request's side of the response object: what it asked for, the defaults it got."""
    body, sampling = req.body, req.sampling.fields
    fmt = body.text.format if body.text is not None else None
    choice = body.tool_choice
    return {
        "model": model,
        "instructions": body.instructions,
        "tools": [tool.model_dump() for tool in body.tools or ()],
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice)
        else choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                 else {"type": "text"}},
        # null in the sampling fields: the engine's default applied
        "temperature": _or_default(sampling.temperature, table.TEMPERATURE),
        "top_p": _or_default(sampling.top_p, table.TOP_P),
        "max_output_tokens": body.max_output_tokens,
        "truncation": "disabled",
        "previous_response_id": body.previous_response_id,
        "store": store,
        "metadata": body.metadata or {},
        "user": body.user,
    }  # fmt: skip


def _or_default(value: float | None, spec: table.NumberField[float]) -> float:
    return spec.default if value is None else value


@dataclass(frozen=True)
class ResponseHead:
    id: str
    created_at: int
    fields: dict[str, Any]  # request_fields

    def body(
        self,
        status: str,
        output: Sequence[Item] = (),
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "output": list(output),
            "usage": usage,
            **self.fields,
        }

    def answered(self, answer: Answer) -> dict[str, Any]:
        return self.body(answer.status, answer.items, answer.usage)


def output_text(text: str) -> Item:
    return {"type": "output_text", "text": text, "annotations": []}


def message_item(item_id: str, status: str, parts: Sequence[Item]) -> Item:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": list(parts),
    }


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> Item:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


@dataclass(frozen=True)
class Answer:
    text: str  # the message's text, tool calls parsed out
    calls: tuple[ToolCall, ...]
    end: ChoiceEnd
    message_id: str
    call_item_ids: tuple[str, ...]

    @classmethod
    def of(cls, text: str, calls: Sequence[ToolCall], end: ChoiceEnd, message_id: str) -> Answer:
        return cls(text, tuple(calls), end, message_id, tuple(new_id("fc") for _ in calls))

    @property
    def status(self) -> str:
        return "incomplete" if self.end.reason == "length" else "completed"

    @property
    def final_event(self) -> str:
        return f"response.{self.status}"

    @property
    def items(self) -> list[Item]:
        items = []
        if self.text or not self.calls:
            items.append(message_item(self.message_id, self.status, [output_text(self.text)]))
        items += [
            call_item(i, call) for i, call in zip(self.call_item_ids, self.calls, strict=True)
        ]
        return items

    @property
    def turn(self) -> ChatMessage:
        """The answer as the conversation's next message."""
        return ChatMessage("assistant", self.text, self.calls)

    @property
    def usage(self) -> dict[str, Any]:
        prompt, output = self.end.prompt_tokens, self.end.completion_tokens
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": self.end.cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output,
        }


class ResponseEvents:
    """The events of one streamed response, numbered in the order they are made."""

    def __init__(self) -> None:
        self._next = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        frame = sse_event(kind, {"type": kind, **fields, "sequence_number": self._next})
        self._next += 1
        return frame

    def state(self, kind: str, response: dict[str, Any]) -> bytes:
        """`response.created`, `.in_progress`, `.completed`, `.incomplete` or `.failed`."""
        return self.event(kind, response=response)

    def message_opening(self, index: int, item_id: str) -> list[bytes]:
        place = {"item_id": item_id, "output_index": index, "content_index": 0}
        item = message_item(item_id, "in_progress", [])
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event("response.content_part.added", **place, part=output_text("")),
        ]

    def text_delta(self, index: int, item_id: str, text: str) -> bytes:
        place = {"item_id": item_id, "output_index": index, "content_index": 0}
        return self.event("response.output_text.delta", **place, delta=text, logprobs=[])

    def item(self, index: int, item: Item, opened: bool = False) -> list[bytes]:
        """The events of a finished output item; `opened`: a message whose opening and text
        deltas were sent already."""
        if item["type"] == "function_call":
            return self._call(index, item)
        frames = [] if opened else self.message_opening(index, item["id"])
        part = item["content"][0]
        if part["text"] and not opened:
            frames.append(self.text_delta(index, item["id"], part["text"]))
        place = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            *frames,
            self.event("response.output_text.done", **place, text=part["text"], logprobs=[]),
            self.event("response.content_part.done", **place, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, index: int, item: Item) -> list[bytes]:
        place = {"item_id": item["id"], "output_index": index}
        opening = {**item, "arguments": "", "status": "in_progress"}
        return [
            self.event("response.output_item.added", output_index=index, item=opening),
            self.event("response.function_call_arguments.delta", **place, delta=item["arguments"]),
            self.event("response.function_call_arguments.done", **place,
                       arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    def failure(self, head: ResponseHead, exc: APIError) -> list[bytes]:
        """An error after the stream started: `error`, then the failed response."""
        error = {"code": exc.code or "server_error", "message": exc.message}
        return [
            self.event("error", code=exc.code, message=exc.message, param=exc.param),
            self.state("response.failed", head.body("failed", error=error)),
        ]
