"""The body of `POST /v1/responses` (OpenAI's Responses API), parsed into a `ResponsesRequest`.

A Responses request is a chat request in another envelope: its `input` items become chat
messages (`ChatMessage`, rendered by the chat template as /v1/chat/completions renders its
`messages`), `instructions` a system message before them, `tools` / `tool_choice` /
`parallel_tool_calls` a `ToolSpec` and `text.format` a grammar (gateway/requests/structured.py),
the sampling fields one `SamplingOptions` (protocol.py).

`input` is a string (one user message) or a list of items:
- messages `{"type"?: "message", "role": "user"|"system"|"developer"|"assistant", "content":
  str | [{"type": "input_text"|"output_text", "text"}]}`;
- `{"type": "function_call", "call_id", "name", "arguments"}`: an assistant's tool call (several
  in a row, or after an assistant message, are one assistant turn);
- `{"type": "function_call_output", "call_id", "output"}`: its result, a `tool` message.
An answer's own output items (`id`, `status`, `annotations` included) may be sent back as
input, as clients do with `response.output`; those three fields mark where an item came from and
do not change the prompt (as at OpenAI).

Every field the server accepts is honoured; the fields of OpenAI's API this server does not
implement answer 400 naming them, with the reason (`REFUSED`), and any other field answers 400
too (`extra="forbid"`). An item holds the fields of one kind: its other kinds' fields answer
400 naming them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from engine import sampling_fields as table
from engine.grammar_spec import GrammarSpec
from gateway.config import LimitsConfig
from gateway.errors import APIError, bad_request
from gateway.requests.fields import ONE_OF, number, validation_error
from gateway.requests.fields import RequestModel as _RequestModel
from gateway.requests.protocol import (
    ChatMessage,
    SamplingFields,
    SamplingOptions,
    openai_body,
    sampling_options,
    with_grammar,
    with_tools,
)
from gateway.requests.structured import schema_grammar, tool_function, tool_spec
from gateway.requests.tools import ToolCall, ToolSpec

# OpenAI's fields that this server does not implement, and why: a value answers 400 naming
# the field (null is their default, so it is accepted as absent).
REFUSED = {
    "background": "responses run while the request waits; there is no background mode",
    "conversation": "this server keeps no conversations: chain responses with "
    "`previous_response_id`, or send the whole conversation as `input` items",
    "include": "this server adds nothing to its answers on request: no logprobs, no "
    "built-in tools' results",
    "reasoning": "the served model does not reason in a separate channel",
    "max_tool_calls": "this server runs no built-in tools",
    "prompt": "this server keeps no prompt templates: send `instructions` and `input`",
    "prompt_cache_key": "the prefix cache needs no key: requests with a common prefix share it",
    "prompt_cache_retention": "the prefix cache keeps what its memory holds, not for a set time",
    "safety_identifier": "this server runs no safety checks per end user",
    "service_tier": "this server has one service tier",
    "stream_options": "streamed events carry no obfuscation padding",
    "top_logprobs": "this server's Responses API returns no logprobs",
    "context_management": "this server does not compact conversations",
}
# Declared, and by their definition without effect on the answer: what a client echoes back
# when it sends an earlier response's output items as input, the one truncation mode, and an
# end-user identifier (echoed in the response object, as OpenAI does).
NO_EFFECT = {
    "user": "identifies the end user; echoed in the response, changes no answer",
    "truncation": "'disabled', the one mode: an input beyond the context answers 400",
    "input[].id": "an earlier answer's item id, sent back with it",
    "input[].status": "an earlier answer's item status, sent back with it",
    "input[].content[].annotations": "an earlier answer's citations (this server's carry none)",
    "text.format.strict": "the output is always held to the schema, which true and false allow",
}
METADATA_PAIRS = 16  # OpenAI's limits on `metadata`
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
ResponseStatus = Literal["in_progress", "completed", "incomplete"]
Metadata = Annotated[
    dict[
        Annotated[str, Field(max_length=METADATA_KEY_CHARS)],
        Annotated[str, Field(max_length=METADATA_VALUE_CHARS)],
    ],
    Field(max_length=METADATA_PAIRS),
]


class _Body(_RequestModel):
    # Unknown fields answer 400 naming them (gateway/requests/fields.py, validation_error).
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class InputTextPart(_Body):
    type: Literal["input_text", "output_text"] = Field(
        description="'input_text' or 'output_text': text only (no images, files or audio)"
    )
    text: str
    annotations: list[dict[str, Any]] | None = Field(
        default=None, description="a list of an answer's citations (this server's carry none)"
    )


class InputItem(_Body):
    """One item of `input`: a message, a function call or a function call's output (the
    fields of the other kinds are refused in `_item_message`)."""

    type: Literal["message", "function_call", "function_call_output"] = Field(
        default="message",
        description="'message' (the default), 'function_call' or 'function_call_output': no "
        "built-in tools' items, reasoning or item references",
    )
    role: Literal["user", "system", "developer", "assistant"] | None = Field(
        default=None, description="a message's role: 'user', 'system', 'developer' or 'assistant'"
    )
    content: Annotated[str | list[InputTextPart] | None, ONE_OF] = Field(
        default=None,
        description="a message's text: a string or a list of text parts "
        "({type: input_text | output_text, text})",
    )
    call_id: str | None = Field(default=None, description="a function call's id")
    name: str | None = Field(default=None, description="the name of the function called")
    arguments: str | None = Field(default=None, description="a call's arguments as JSON text")
    output: str | None = Field(default=None, description="a function call's result, as text")
    id: str | None = Field(default=None, description="the item's id, if it is an answer's")
    status: ResponseStatus | None = None


class InputItems(_Body):
    """`input` as a list alone: its errors name the item and the field (`input[2].role`),
    which `ResponsesBody.input`'s union words as the whole field's."""

    input: list[InputItem] = Field(min_length=1)


class FunctionTool(_Body):
    """A chat tool's function (structured.py's `FunctionBody`) flattened into the tool, as the
    Responses API sends it. Declared apart, `type` first: a built-in tool is refused for its
    type, not for the function fields it lacks."""

    type: Literal["function"] = Field(
        description="'function': this server runs no built-in tools (web search, file search, "
        "computer use, MCP, ...)"
    )
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] = Field(
        description="letters, digits, _ and -, at most 64 characters"
    )
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="a JSON Schema object for the arguments"
    )
    strict: bool | None = Field(
        default=None,
        description="true only with a `tool_choice` that forces a call (required or named), "
        "whose calls are held to the schema",
    )


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="'text', 'json_object' or 'json_schema' (with `name` and `schema`)"
    )
    name: str | None = Field(default=None, description="a json_schema format's name")
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="a json_schema format's JSON Schema object"
    )
    description: str | None = None
    strict: bool | None = Field(
        default=None, description="true or false: the output is always held to the schema"
    )


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesBody(_Body):
    model: str = Field(description="the served model's name (GET /v1/models)")
    input: Annotated[str | Annotated[list[InputItem], Field(min_length=1)], ONE_OF] = Field(
        description="a string (one user message) or a non-empty list of items: messages "
        "{role, content}, {type: function_call, call_id, name, arguments} and "
        "{type: function_call_output, call_id, output}"
    )
    instructions: str | None = Field(
        default=None,
        description="a system message's text, put before the input (not carried over by "
        "`previous_response_id`)",
    )
    max_output_tokens: int | None = number(table.MAX_NEW_TOKENS, default=None)
    temperature: float | None = number(table.TEMPERATURE)
    top_p: float | None = number(table.TOP_P)
    seed: int | None = number(table.SEED)
    tools: list[FunctionTool] | None = Field(
        default=None, max_length=128, description="functions the model may call"
    )
    tool_choice: Annotated[Literal["none", "auto", "required"] | FunctionChoice | None, ONE_OF] = (
        Field(default=None, description="'none', 'auto', 'required' or {type: function, name}")
    )
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = Field(
        default=None,
        description="'disabled': an input longer than the context answers 400 (no 'auto')",
    )
    stream: bool | None = None
    store: bool | None = Field(
        default=None,
        description="true (the default: the response is kept for `previous_response_id`) or false",
    )
    previous_response_id: str | None = Field(
        default=None, description="the id of a kept response, whose conversation this continues"
    )
    metadata: Annotated[Metadata | None, ONE_OF] = Field(
        default=None,
        description=f"at most {METADATA_PAIRS} string pairs (keys of at most "
        f"{METADATA_KEY_CHARS} characters, values of at most {METADATA_VALUE_CHARS}), "
        "echoed in the response",
    )
    user: str | None = Field(
        default=None, description="a string naming the end user, echoed in the response"
    )


@dataclass(frozen=True)
class ResponsesRequest:
    body: ResponsesBody  # validated: the response object echoes its fields
    input: tuple[ChatMessage, ...]  # this turn's items as chat messages
    sampling: SamplingOptions
    tools: ToolSpec | None  # None: no tools given

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)

    @property
    def instructions(self) -> tuple[ChatMessage, ...]:
        text = self.body.instructions
        return () if text is None else (ChatMessage("system", text),)


def parse_responses(body: Mapping[str, Any], served: str, limits: LimitsConfig) -> ResponsesRequest:
    req = _validated(body, served)
    # only the fields given: sampling_options fills in the model's defaults for the others
    given = {"temperature", "top_p", "seed"} & req.model_fields_set
    fields = SamplingFields(**{name: getattr(req, name) for name in given})
    sampling = sampling_options(fields, limits, 1, req.max_output_tokens, False, 0)
    sampling = with_grammar(sampling, *text_format_grammar(req.text))
    tools = _tools(req)
    sampling = with_tools(sampling, tools, "text.format")
    items = (req.input,) if isinstance(req.input, str) else tuple(req.input)
    return ResponsesRequest(req, input_messages(items), sampling, tools)


def _validated(body: Mapping[str, Any], served: str) -> ResponsesBody:
    try:
        return openai_body(ResponsesBody, body, served, REFUSED)
    except APIError as exc:
        if exc.param == "input" and isinstance(body.get("input"), list):
            try:  # the item's own error, if any
                InputItems.model_validate({"input": body["input"]})
            except ValidationError as items_exc:
                raise validation_error(items_exc, InputItems) from None
        raise


def _tools(req: ResponsesBody) -> ToolSpec | None:
    functions = [
        tool_function(t.name, t.description, t.parameters, f"tools[{i}].parameters")
        for i, t in enumerate(req.tools or ())
    ]
    strict = [f"tools[{i}].strict" for i, t in enumerate(req.tools or ()) if t.strict]
    strict_param = strict[0] if strict else None
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        named = "tool_choice.name"
        return tool_spec(functions, choice.name, req.parallel_tool_calls, named, strict_param)
    return tool_spec(functions, choice, req.parallel_tool_calls, strict_param=strict_param)


def text_format_grammar(text: TextConfig | None) -> tuple[GrammarSpec | None, str | None]:
    """`text.format` as a grammar (and the field a bad schema is reported on)."""
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        _only_type(fmt)
        return None, None
    if fmt.type == "json_object":
        _only_type(fmt)
        return GrammarSpec("json_object"), "text.format"
    for name, value in (("name", fmt.name), ("schema", fmt.schema_)):
        if value is None:
            where = f"text.format.{name}"
            raise bad_request(where, f"`{where}` is required with type 'json_schema'")
    if fmt.description:
        where = "text.format.description"
        raise bad_request(
            where,
            f"`{where}` is not shown to the model here (the schema is enforced, its "
            "description is not read): leave it out",
        )
    assert fmt.schema_ is not None
    return schema_grammar(fmt.schema_, "text.format.schema"), "text.format.schema"


def _only_type(fmt: TextFormat | None) -> None:
    """400 for a json_schema format's field in another format."""
    for name in sorted(fmt.model_fields_set - {"type"} if fmt is not None else ()):
        where = f"text.format.{name.rstrip('_')}"  # `schema_` is sent as `schema`
        raise bad_request(where, f"`{where}` belongs to the 'json_schema' format only")


# -- input items -> chat messages -------------------------------------------------------------

_ITEM_FIELDS = {  # what each kind of item holds, beside `type`, `id` and `status`
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
}


def input_messages(items: Sequence[str | InputItem]) -> tuple[ChatMessage, ...]:
    """`input` as chat messages: function calls join the assistant turn before them."""
    messages: list[ChatMessage] = []
    for index, item in enumerate(items):
        message = ChatMessage("user", item) if isinstance(item, str) else _item_message(index, item)
        last = messages[-1] if messages else None
        if message.tool_calls and not message.content and last and last.role == "assistant":
            calls = (*last.tool_calls, *message.tool_calls)
            messages[-1] = ChatMessage("assistant", last.content, calls)
        else:
            messages.append(message)
    return tuple(messages)


def _item_message(index: int, item: InputItem) -> ChatMessage:
    fields = _ITEM_FIELDS[item.type]
    for name in sorted(item.model_fields_set - {"type", "id", "status", *fields}):
        where = f"input[{index}].{name}"
        raise bad_request(where, f"`{where}` is not a field of a {item.type} item")
    for name in fields:
        if getattr(item, name) is None:
            where = f"input[{index}].{name}"
            raise bad_request(where, f"`{where}` is required in a {item.type} item")
    if item.type == "function_call":
        assert item.call_id is not None and item.name is not None and item.arguments is not None
        return ChatMessage("assistant", "", (ToolCall(item.call_id, item.name, item.arguments),))
    if item.type == "function_call_output":
        assert item.call_id is not None and item.output is not None
        return ChatMessage("tool", item.output, tool_call_id=item.call_id)
    assert item.role is not None and item.content is not None
    content = item.content
    text = content if isinstance(content, str) else "".join(part.text for part in content)
    return ChatMessage(item.role, text)


def check_call_outputs(conversation: Sequence[ChatMessage]) -> None:
    """400 for a function call's output whose call is not in the conversation before it."""
    calls: set[str] = set()
    for message in conversation:
        calls.update(call.id for call in message.tool_calls)
        if message.tool_call_id and message.tool_call_id not in calls:
            raise bad_request(
                "input",
                f"`input` has a function_call_output for call_id {message.tool_call_id!r}, but "
                "no function_call with that call_id comes before it (in `input` or in the "
                "conversation of `previous_response_id`)",
            )
