"""Request bodies of the HTTP API: declared once as pydantic models, parsed into frozen dataclasses.

- `/v1/completions`      body `CompletionBody` -> CompletionRequest (prompt: text, token ids, or a
  list of either)
- `/v1/chat/completions` body `ChatBody` -> ChatRequest (messages with text content)
- `/generate` (native)   body `GenerateBody` -> NativeRequest (`text` or `input_ids`,
  `sampling_params`, `stream`)

The models are the one declaration of the request fields: they validate the bodies (strict
JSON types: no "1" for 1, no true for 1), and `gateway/api/openapi.py` publishes their JSON schema
at `GET /openapi.json`. The sampling fields' ranges and defaults come from the engine's table
(`engine/sampling_fields.py`); a bad field answers 400 naming it (gateway/requests/fields.py). What
a model cannot know is checked after it, at run time: the served model's name, this gateway's
flags (`--max-n`, stop-string limits; the context length in openai_api.py), and rules that
tie two fields together. Unknown fields are ignored, except those in `_UNSUPPORTED`, which
would change the answer.

The bodies and parsing of `response_format`, `tools` / `tool_choice` and /generate's grammars
live in `gateway/requests/structured.py`; they add a grammar (engine/grammar_spec.py) to the
options.

Sampling fields become one `SamplingOptions`; `SamplingOptions.to_proto` makes the node's
`SamplingParams` for one choice (choice i of a seeded request uses seed + i, so the n choices
differ and each is reproducible). Extensions beyond OpenAI's fields, as other servers offer
them: `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import BaseModel, Field, ValidationError

from engine import sampling_fields as table
from engine.grammar_spec import GrammarSpec
from gateway.config import LimitsConfig
from gateway.errors import APIError, bad_request
from gateway.requests.fields import ONE_OF, number, validation_error
from gateway.requests.fields import RequestModel as _Body
from gateway.requests.structured import (
    NamedToolChoice,
    ResponseFormat,
    ToolBody,
    ToolCallBody,
    native_grammar,
    parse_tools,
    response_format_grammar,
)
from gateway.requests.tools import ToolCall, ToolSpec
from proto import node_pb2

# Fields that would change what the client gets, which this server does not implement.
_UNSUPPORTED = ("logit_bias", "functions", "suffix", "audio", "prediction")
# Sent to the node as given (null: the table's default).
_NODE_NUMBERS = (
    table.TEMPERATURE,
    table.TOP_P,
    table.TOP_K,
    table.MIN_P,
    table.FREQUENCY_PENALTY,
    table.PRESENCE_PENALTY,
    table.REPETITION_PENALTY,
)
MAX_INPUT_IDS = 1 << 24

Prompt = str | tuple[int, ...]
TokenId = Annotated[int, Field(ge=0, le=table.INT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


class SamplingFields(_Body):
    """The sampling fields of every generation route."""

    temperature: float | None = number(table.TEMPERATURE)
    top_p: float | None = number(table.TOP_P)
    top_k: int | None = number(table.TOP_K)
    min_p: float | None = number(table.MIN_P)
    frequency_penalty: float | None = number(table.FREQUENCY_PENALTY)
    presence_penalty: float | None = number(table.PRESENCE_PENALTY)
    repetition_penalty: float | None = number(table.REPETITION_PENALTY)
    seed: int | None = number(table.SEED)
    stop: Annotated[NonEmptyStr | list[NonEmptyStr] | None, ONE_OF] = Field(
        default=None, description="a non-empty string or a list of non-empty strings"
    )
    stop_token_ids: list[TokenId] | None = Field(
        default=None,
        max_length=table.MAX_STOP_TOKEN_IDS,
        description=f"a list of at most {table.MAX_STOP_TOKEN_IDS} token ids",
    )
    ignore_eos: bool | None = None


class StreamOptions(_Body):
    include_usage: bool | None = None


class _OpenAIBody(SamplingFields):
    model: str = Field(description="the served model's name (GET /v1/models)")
    n: int | None = Field(default=None, ge=1, description="an integer >= 1 (at most --max-n)")
    best_of: int | None = Field(default=None, ge=1, description="an integer equal to `n`")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    max_tokens: int | None = number(table.MAX_NEW_TOKENS, default=None)


class CompletionBody(_OpenAIBody):
    prompt: Annotated[
        str | TokenIds | Annotated[list[str | TokenIds], Field(min_length=1)], ONE_OF
    ] = Field(
        description="a string, a list of token ids, or a non-empty list of strings or of "
        "token-id lists"
    )
    echo: bool | None = None
    logprobs: int | None = number(table.TOP_LOGPROBS, default=None)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class MessageBody(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only for an assistant message; checked in `_message`
    content: Annotated[str | list[TextPart] | None, ONE_OF] = Field(
        default=None, description="a string or a list of text parts ({type: text, text})"
    )
    tool_calls: list[ToolCallBody] | None = Field(
        default=None, description="an assistant message's calls ({id, type, function})"
    )
    tool_call_id: str | None = Field(default=None, description="a tool message's call id")


class ChatBody(_OpenAIBody):
    messages: list[MessageBody] = Field(
        min_length=1, description="a non-empty list of messages ({role, content})"
    )
    max_completion_tokens: int | None = number(table.MAX_NEW_TOKENS, default=None)
    logprobs: bool | None = None
    top_logprobs: int | None = number(table.TOP_LOGPROBS)
    tools: list[ToolBody] | None = Field(
        default=None, max_length=128, description="functions the model may call"
    )
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None, ONE_OF] = (
        Field(
            default=None,
            description="'none', 'auto', 'required' or {type: function, function: {name}}",
        )
    )
    parallel_tool_calls: bool | None = None


class NativeSamplingFields(SamplingFields):
    # null: the table's default, within the context (native_api.py)
    max_new_tokens: int | None = number(table.MAX_NEW_TOKENS, default=None)
    logprobs: bool | None = None
    top_logprobs: int | None = number(table.TOP_LOGPROBS)
    # Constrained decoding: at most one of these (engine/grammar_spec.py).
    json_schema: Annotated[str | dict[str, Any] | None, ONE_OF] = Field(
        default=None, description="a JSON Schema, as an object or as JSON text"
    )
    regex: NonEmptyStr | None = Field(default=None, description="a regular expression")
    ebnf: NonEmptyStr | None = Field(default=None, description="an EBNF grammar (root rule)")
    # Extension: logprobs of the prompt's tokens after the first, with this many alternatives.
    prompt_logprobs: int | None = number(table.PROMPT_LOGPROBS, default=None)


class GenerateBody(_Body):
    """Exactly one of `text` and `input_ids`."""

    text: str | None = None
    input_ids: list[TokenId] | None = Field(default=None, max_length=MAX_INPUT_IDS)
    rid: str | None = None
    stream: bool | None = None
    sampling_params: NativeSamplingFields | None = None


BODIES = (CompletionBody, ChatBody, GenerateBody)


@dataclass(frozen=True)
class SamplingOptions:
    fields: SamplingFields  # validated; the node applies the table's default for a null
    max_tokens: int | None  # None: the endpoint's default
    stop: tuple[str, ...]
    logprobs: bool
    top_logprobs: int
    grammar: GrammarSpec | None = None  # the output must match it
    grammar_param: str | None = None  # the request field it came from, for the node's refusal
    prompt_logprobs: int | None = None  # top-n of each prompt token (None: not computed)

    def to_proto(self, max_new_tokens: int, choice: int = 0) -> node_pb2.SamplingParams:
        msg = node_pb2.SamplingParams(
            max_new_tokens=max_new_tokens,
            stop=self.stop,
            stop_token_ids=self.fields.stop_token_ids or (),
            ignore_eos=bool(self.fields.ignore_eos),
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
        )
        for spec in _NODE_NUMBERS:
            value = getattr(self.fields, spec.name)
            if value is not None:
                setattr(msg, spec.name, value)
        if self.fields.seed is not None:
            msg.seed = self.fields.seed + choice
        if self.grammar is not None:
            msg.grammar.kind, msg.grammar.spec = self.grammar.kind, self.grammar.spec
        if self.prompt_logprobs is not None:
            msg.prompt_logprobs = self.prompt_logprobs
        return msg


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls
    tool_call_id: str = ""  # a tool message's answer to this call


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[Prompt, ...]
    sampling: SamplingOptions
    n: int
    stream: bool
    include_usage: bool
    echo: bool


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    sampling: SamplingOptions
    n: int
    stream: bool
    include_usage: bool
    tools: ToolSpec | None = None  # None: no tools given


@dataclass(frozen=True)
class NativeRequest:
    prompt: Prompt
    sampling: SamplingOptions
    stream: bool
    rid: str


def parse_completion(
    body: Mapping[str, Any], served: str, limits: LimitsConfig
) -> CompletionRequest:
    req = openai_body(CompletionBody, body, served)
    top = req.logprobs
    if req.echo and top is not None and req.stream:
        raise bad_request(
            "stream", "`echo` with `logprobs` is answered whole: leave `stream` out for it"
        )
    n = _choices(req, limits)
    prompts = _prompts(req.prompt)
    if len(prompts) * n > limits.max_n:
        raise too_many_prompts(len(prompts), n, limits.max_n)
    sampling = sampling_options(req, limits, n, req.max_tokens, top is not None, top or 0)
    sampling = with_grammar(sampling, *response_format_grammar(req.response_format))
    if req.echo and top is not None:  # the prompt's tokens get logprobs too
        sampling = replace(sampling, prompt_logprobs=top)
    stream, include_usage = _stream(req)
    return CompletionRequest(prompts, sampling, n, stream, include_usage, bool(req.echo))


def too_many_prompts(prompts: int, n: int, max_n: int) -> APIError:
    return bad_request("n", f"{prompts} prompts x n={n} choices exceed the limit of {max_n}")


def parse_chat(body: Mapping[str, Any], served: str, limits: LimitsConfig) -> ChatRequest:
    req = openai_body(ChatBody, body, served)
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise bad_request("top_logprobs", "`top_logprobs` needs `logprobs: true`")
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens = req.max_tokens
    n = _choices(req, limits)
    sampling = sampling_options(req, limits, n, max_tokens, bool(req.logprobs), top)
    sampling = with_grammar(sampling, *response_format_grammar(req.response_format))
    tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    sampling = with_tools(sampling, tools, "response_format")
    stream, include_usage = _stream(req)
    messages = tuple(_message(i, m) for i, m in enumerate(req.messages))
    return ChatRequest(messages, sampling, n, stream, include_usage, tools)


def parse_native(body: Mapping[str, Any], limits: LimitsConfig) -> NativeRequest:
    req = _validate(GenerateBody, body)
    if (req.text is None) == (req.input_ids is None):
        raise bad_request("text", "give exactly one of `text` and `input_ids`")
    params = req.sampling_params or NativeSamplingFields()
    top = params.top_logprobs or 0
    logprobs = bool(params.logprobs) or top > 0
    sampling = sampling_options(params, limits, 1, params.max_new_tokens, logprobs, top)
    sampling = with_grammar(
        sampling, *native_grammar(params.json_schema, params.regex, params.ebnf)
    )
    if params.prompt_logprobs is not None:
        sampling = replace(sampling, prompt_logprobs=params.prompt_logprobs)
    prompt: Prompt = req.text if req.text is not None else tuple(req.input_ids or ())
    return NativeRequest(prompt, sampling, bool(req.stream), req.rid or "")


BodyT = TypeVar("BodyT", bound=BaseModel)


def _validate(model: type[BodyT], body: Mapping[str, Any]) -> BodyT:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc, model) from None


def openai_body(model: type[BodyT], body: Mapping[str, Any], served: str) -> BodyT:
    """The model name first (404 for another model, as OpenAI), then the body."""
    name = body.get("model")
    if not isinstance(name, str):
        raise bad_request("model", f"`model` is required: this server serves {served!r}")
    if name != served:
        raise APIError(
            404,
            f"the model {name!r} does not exist here: this server serves {served!r} "
            "(GET /v1/models lists it)",
            param="model",
            code="model_not_found",
        )
    for field in _UNSUPPORTED:
        if body.get(field) not in (None, [], {}, ""):
            raise bad_request(field, f"`{field}` is not supported by this server; leave it out")
    return _validate(model, body)


def sampling_options(
    fields: SamplingFields,
    limits: LimitsConfig,
    n: int,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
) -> SamplingOptions:
    missing = {
        name: value
        for name, value in limits.defaults.generation.values
        if name in type(fields).model_fields
        and (name not in fields.model_fields_set or getattr(fields, name) is None)
    }
    if missing:  # the model's own defaults (generation_config.json) for what was left out
        fields = fields.model_copy(update=missing)
    # choice i samples with seed + i: every one must fit the node API's int64
    if fields.seed is not None and fields.seed + n - 1 > table.INT64_MAX:
        raise bad_request(
            "seed", f"`seed` + n - 1 must fit in int64: at most {table.INT64_MAX - n + 1}"
        )
    return SamplingOptions(fields, max_tokens, _stop(fields.stop, limits), logprobs, top_logprobs)


def _stop(value: str | list[str] | None, limits: LimitsConfig) -> tuple[str, ...]:
    """`stop`: a string or a list of strings, within the gateway's --max-stop* flags."""
    items = [] if value is None else [value] if isinstance(value, str) else value
    if len(items) > limits.max_stop:
        raise bad_request("stop", f"`stop` has {len(items)} strings; at most {limits.max_stop}")
    for text in items:
        if len(text) > limits.max_stop_chars:
            raise bad_request(
                "stop",
                f"a `stop` string has {len(text)} characters; at most {limits.max_stop_chars}",
            )
    return tuple(items)


def _choices(req: _OpenAIBody, limits: LimitsConfig) -> int:
    n = req.n or 1
    if n > limits.max_n:
        raise bad_request("n", f"`n` must be <= {limits.max_n}, got {n}")
    if req.best_of is not None and req.best_of != n:
        raise bad_request("best_of", "`best_of` other than `n` is not supported")
    return n


def _stream(req: _OpenAIBody) -> tuple[bool, bool]:
    stream = bool(req.stream)
    if req.stream_options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options", "`stream_options` needs `stream: true`")
    return stream, bool(req.stream_options.include_usage)


def _prompts(value: str | list[int] | list[str | list[int]]) -> tuple[Prompt, ...]:
    """One prompt (a string or token ids) or a list of them."""
    if isinstance(value, str):
        return (value,)
    if all(isinstance(v, int) for v in value):
        return (tuple(cast(list[int], value)),)
    return tuple(v if isinstance(v, str) else tuple(v) for v in cast(list[str | list[int]], value))


def _message(index: int, message: MessageBody) -> ChatMessage:
    content = message.content
    if content is None and message.role != "assistant":
        where = f"messages[{index}].content"
        raise bad_request(where, f"`{where}` is required: a string or a list of text parts")
    calls = tuple(
        ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()
    )
    if calls and message.role != "assistant":
        where = f"messages[{index}].tool_calls"
        raise bad_request(where, f"`{where}` belongs to assistant messages only")
    text = "".join(part.text for part in content) if isinstance(content, list) else content
    return ChatMessage(message.role, text or "", calls, message.tool_call_id or "")


def with_grammar(
    sampling: SamplingOptions, grammar: GrammarSpec | None, param: str | None
) -> SamplingOptions:
    return sampling if grammar is None else replace(sampling, grammar=grammar, grammar_param=param)


def with_tools(
    sampling: SamplingOptions, tools: ToolSpec | None, format_param: str
) -> SamplingOptions:
    """A forced tool choice's grammar (the call's JSON); 400 beside an output format's own
    grammar (`format_param`)."""
    if tools is None or not tools.forced:
        return sampling
    if sampling.grammar is not None:
        raise bad_request(
            "tool_choice", f"a forced `tool_choice` cannot be combined with `{format_param}`"
        )
    return with_grammar(sampling, tools.grammar(), "tools")
