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
tie two fields together.

Nothing is accepted and ignored: a field no model declares answers 400 naming it, and the
OpenAI fields this server does not implement (`REFUSED`) answer 400 with the reason. Other
servers' names for the same things are taken as aliases: vLLM's `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar` (the structured-output path), NVIDIA's
`nvext.ignore_eos`, and the deprecated `functions` / `function_call` (tools, answered as
`function_call` the way those clients read it). `tests/test_request_fields.py` walks every
declared field and shows that it changes the parsed request, or is one of `NO_EFFECT`'s.

The bodies and parsing of `response_format`, `tools` / `tool_choice` and /generate's grammars
live in `gateway/requests/structured.py`; they add a grammar (engine/grammar_spec.py) to the
options.

Sampling fields become one `SamplingOptions`; `SamplingOptions.to_proto` makes the node's
`SamplingParams` for one choice (choice i of a seeded request uses seed + i, so the n choices
differ and each is reproducible). Extensions beyond OpenAI's fields, as other servers offer
them: `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, `min_tokens`.
"""

from __future__ import annotations

import re
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
    FunctionBody,
    FunctionCallBody,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolBody,
    ToolCallBody,
    choice_grammar,
    grammar_field,
    json_schema_field,
    native_grammar,
    parse_tools,
    response_format_grammar,
)
from gateway.requests.tools import ToolCall, ToolSpec
from proto import node_pb2

# OpenAI fields this server does not implement; a non-empty value answers 400 with the reason.
REFUSED = {
    "suffix": "text after the completion (insertion) is not supported",
    "audio": "audio output is not supported: this server answers in text",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "the served model has no reasoning setting",
    "web_search_options": "web search is not supported",
    "verbosity": "the served model has no verbosity setting",
    "metadata": "chat completions are not stored here, so there is nothing to attach it to",
    "prompt_cache_key": "prefixes are cached and routed to without a key here",
    "guided_decoding_backend": "the grammar backend is the node's (xgrammar)",
    "guided_whitespace_pattern": "JSON whitespace follows the grammar backend's default",
}
# Declared, and by their definition without effect on any answer: an end-user identifier that
# OpenAI uses for abuse monitoring, and the one service tier this server has.
NO_EFFECT = {
    "user": "identifies the end user for the provider's monitoring; changes no answer",
    "safety_identifier": "identifies the end user for the provider's monitoring",
    "service_tier": "'auto' and 'default' are the one tier this server has",
    "store": "false: chat completions are never stored here",
    "modalities": "['text']: the one output this server has",
    "response_format.json_schema.strict": "the output is always held to the schema, which "
    "true and false both allow",
}
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
# A token id as a JSON object key ("31").
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")]
Bias = Annotated[
    float,
    Field(ge=table.LOGIT_BIAS.minimum, le=table.LOGIT_BIAS.maximum, allow_inf_nan=False),
]


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
    min_tokens: int | None = number(table.MIN_TOKENS, default=None)
    logit_bias: (
        Annotated[
            dict[TokenIdKey, Bias],
            Field(max_length=table.MAX_LOGIT_BIAS),
        ]
        | None
    ) = Field(
        default=None,
        description=f"an object of at most {table.MAX_LOGIT_BIAS} token ids (as strings) to a "
        "bias in [-100, 100], added to their logits before every draw",
    )


class StreamOptions(_Body):
    include_usage: bool | None = None


class NvExt(_Body):
    """NVIDIA's extension object (sent by its load generators)."""

    ignore_eos: bool | None = None


class _OpenAIBody(SamplingFields):
    model: str = Field(description="the served model's name (GET /v1/models)")
    n: int | None = Field(default=None, ge=1, description="an integer >= 1 (at most --max-n)")
    best_of: int | None = Field(default=None, ge=1, description="an integer equal to `n`")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    max_tokens: int | None = number(table.MAX_NEW_TOKENS, default=None)
    user: str | None = Field(default=None, description=NO_EFFECT["user"])
    safety_identifier: str | None = Field(default=None, description=NO_EFFECT["safety_identifier"])
    service_tier: Literal["auto", "default"] | None = Field(
        default=None, description="'auto' or 'default' (this server's one tier)"
    )
    store: Literal[False] | None = Field(
        default=None, description="false (chat completions are not stored here)"
    )
    # vLLM's names for structured output: at most one of them, and not with `response_format`
    guided_json: Annotated[str | dict[str, Any] | None, ONE_OF] = Field(
        default=None, description="a JSON Schema, as an object or as JSON text"
    )
    guided_regex: NonEmptyStr | None = Field(default=None, description="a regular expression")
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = Field(
        default=None, description="a non-empty list of non-empty strings: the answer is one"
    )
    guided_grammar: NonEmptyStr | None = Field(
        default=None, description="an EBNF grammar (root rule)"
    )
    nvext: NvExt | None = None


class CompletionBody(_OpenAIBody):
    prompt: Annotated[
        str | TokenIds | Annotated[list[str | TokenIds], Field(min_length=1)], ONE_OF
    ] = Field(
        description="a string, a list of token ids, or a non-empty list of strings or of "
        "token-id lists"
    )
    echo: bool | None = None
    logprobs: int | None = number(table.TOP_LOGPROBS, default=None)
    max_tokens: int | None = Field(
        default=None, ge=0, description="an integer >= 0 (0 only with `echo`: the prompt scored)"
    )


class TextPart(_Body):
    type: Literal["text"]
    text: str


class MessageBody(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # null only for an assistant message; checked in `_message`
    content: Annotated[str | list[TextPart] | None, ONE_OF] = Field(
        default=None, description="a string or a list of text parts ({type: text, text})"
    )
    tool_calls: list[ToolCallBody] | None = Field(
        default=None, description="an assistant message's calls ({id, type, function})"
    )
    tool_call_id: str | None = Field(default=None, description="a tool message's call id")
    # the deprecated function-calling form: an assistant's call, a function message's name
    function_call: FunctionCallBody | None = None
    name: str | None = Field(default=None, description="a function message's function name")


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
    # deprecated: `tools` and `tool_choice` before they existed, answered in their shape
    functions: list[FunctionBody] | None = Field(
        default=None, min_length=1, max_length=128, description="functions the model may call"
    )
    function_call: Annotated[Literal["none", "auto"] | NamedFunction | None, ONE_OF] = Field(
        default=None, description="'none', 'auto' or {name}"
    )
    modalities: list[Literal["text"]] | None = Field(
        default=None, description="['text'] (this server's one output)"
    )


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


class TokenizeBody(_Body):
    """vLLM's `POST /tokenize`: exactly one of `prompt` and `messages`."""

    model: str | None = Field(default=None, description="the served model's name, if given")
    prompt: str | None = Field(default=None, description="text, tokenized as /v1/completions")
    messages: list[MessageBody] | None = Field(
        default=None, min_length=1, description="messages, rendered as /v1/chat/completions"
    )
    tools: list[ToolBody] | None = Field(
        default=None, max_length=128, description="with `messages`: the tools the prompt shows"
    )
    add_special_tokens: bool | None = Field(
        default=None, description="with `prompt`: add BOS as the model does (default true)"
    )
    return_token_strs: bool | None = Field(
        default=None, description="also answer each token's text (`token_strs`)"
    )


class DetokenizeBody(_Body):
    """vLLM's `POST /detokenize`."""

    model: str | None = Field(default=None, description="the served model's name, if given")
    tokens: list[TokenId] = Field(max_length=MAX_INPUT_IDS, description="token ids")


BODIES = (CompletionBody, ChatBody, GenerateBody, TokenizeBody, DetokenizeBody)


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

    def check_vocab(self, vocab_size: int) -> None:
        """400 naming a `logit_bias` key that is no token of the vocabulary."""
        for key in self.fields.logit_bias or {}:
            if int(key) >= vocab_size:
                raise bad_request(
                    f"logit_bias.{key}",
                    f"`logit_bias` names token {key}; the vocabulary has {vocab_size} tokens",
                )

    def to_proto(self, max_new_tokens: int, choice: int = 0) -> node_pb2.SamplingParams:
        msg = node_pb2.SamplingParams(
            max_new_tokens=max_new_tokens,
            stop=self.stop,
            stop_token_ids=self.fields.stop_token_ids or (),
            ignore_eos=bool(self.fields.ignore_eos),
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
        )
        min_tokens = self.fields.min_tokens or 0
        if min_tokens > max_new_tokens:
            raise bad_request(
                "min_tokens",
                f"`min_tokens` ({min_tokens}) must be <= the tokens this request may generate "
                f"({max_new_tokens})",
            )
        if min_tokens:
            msg.min_tokens = min_tokens
        if self.fields.logit_bias:
            msg.logit_bias.update({int(k): v for k, v in self.fields.logit_bias.items()})
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

    @property
    def score_only(self) -> bool:
        """`max_tokens: 0` with `echo`: the prompt, scored, and nothing generated."""
        return self.sampling.max_tokens == 0


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    sampling: SamplingOptions
    n: int
    stream: bool
    include_usage: bool
    tools: ToolSpec | None = None  # None: no tools given
    functions: bool = False  # given as the deprecated `functions`: answered as `function_call`


@dataclass(frozen=True)
class NativeRequest:
    prompt: Prompt
    sampling: SamplingOptions
    stream: bool
    rid: str


@dataclass(frozen=True)
class TokenizeRequest:
    prompt: str | tuple[ChatMessage, ...]  # text, or messages for the chat template
    tools: ToolSpec | None
    add_special_tokens: bool
    return_token_strs: bool


def parse_tokenize(body: Mapping[str, Any], served: str) -> TokenizeRequest:
    req = _validate(TokenizeBody, _served_model(body, served, required=False))
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt", "give exactly one of `prompt` and `messages`")
    if req.messages is None:
        if req.tools is not None:
            raise bad_request("tools", "`tools` are shown with `messages` only")
        assert req.prompt is not None
        add_special = req.add_special_tokens is not False
        return TokenizeRequest(req.prompt, None, add_special, bool(req.return_token_strs))
    if req.add_special_tokens is not None:
        raise bad_request(
            "add_special_tokens",
            "`add_special_tokens` is for `prompt`: the chat template writes them for `messages`",
        )
    messages = tuple(_message(i, m) for i, m in enumerate(req.messages))
    tools = parse_tools(req.tools, None, None)
    return TokenizeRequest(messages, tools, False, bool(req.return_token_strs))


def parse_detokenize(body: Mapping[str, Any], served: str) -> tuple[int, ...]:
    req = _validate(DetokenizeBody, _served_model(body, served, required=False))
    return tuple(req.tokens)


def parse_completion(
    body: Mapping[str, Any], served: str, limits: LimitsConfig
) -> CompletionRequest:
    req = openai_body(CompletionBody, body, served)
    top = req.logprobs
    if req.echo and top is not None and req.stream:
        raise bad_request(
            "stream", "`echo` with `logprobs` is answered whole: leave `stream` out for it"
        )
    if req.max_tokens == 0 and not req.echo:
        raise bad_request(
            "max_tokens", "`max_tokens: 0` generates nothing: it needs `echo` (to score the prompt)"
        )
    n = _choices(req, limits)
    prompts = _prompts(req.prompt)
    if len(prompts) * n > limits.max_n:
        raise too_many_prompts(len(prompts), n, limits.max_n)
    sampling = sampling_options(req, limits, n, req.max_tokens, top is not None, top or 0)
    sampling = with_grammar(sampling, *_output_grammar(req))
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
    sampling = with_grammar(sampling, *_output_grammar(req))
    tools = _chat_tools(req)
    sampling = with_tools(sampling, tools, sampling.grammar_param or "response_format")
    stream, include_usage = _stream(req)
    messages = tuple(_message(i, m) for i, m in enumerate(req.messages))
    return ChatRequest(
        messages, sampling, n, stream, include_usage, tools, req.functions is not None
    )


def _chat_tools(req: ChatBody) -> ToolSpec | None:
    """`tools` / `tool_choice`, or the deprecated `functions` / `function_call` (one call)."""
    if req.functions is None:
        if req.function_call is not None:
            raise bad_request("function_call", "`function_call` needs `functions`")
        return parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    for name in ("tools", "tool_choice"):
        if getattr(req, name) is not None:
            raise bad_request(
                name,
                f"give `tools` and `tool_choice`, or the deprecated `functions` and "
                f"`function_call`, not both (`{name}` with `functions`)",
            )
    tools = [ToolBody(type="function", function=f) for f in req.functions]
    call = req.function_call
    choice: Literal["none", "auto"] | NamedToolChoice | None = (
        NamedToolChoice(type="function", function=call) if isinstance(call, NamedFunction)
        else call
    )  # fmt: skip
    try:
        return parse_tools(tools, choice, parallel_tool_calls=False)
    except APIError as exc:  # worded for `tools`: name the fields the client sent
        param, message = _legacy_names(exc.param or "functions"), _legacy_names(exc.message)
        raise bad_request(param, message) from None


def _legacy_names(text: str) -> str:
    """`tools[0].function.parameters` -> `functions[0].parameters`, `tool_choice` ->
    `function_call`: an error about the tools in the deprecated fields' names."""
    text = re.sub(r"\btools(\[\d+\])\.function\.", r"functions\1.", text)
    text = re.sub(r"\btool_choice(\.function)?\b", "function_call", text)
    return re.sub(r"\btools\b", "functions", text)


def _output_grammar(req: _OpenAIBody) -> tuple[GrammarSpec | None, str | None]:
    """`response_format`, or one of vLLM's `guided_*` fields: at most one of them."""
    given = [
        name
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        if getattr(req, name) is not None
    ]
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        given.insert(0, "response_format")
    if len(given) > 1:
        raise bad_request(given[1], f"give at most one way to constrain the output, got {given}")
    if not given or given[0] == "response_format":
        return response_format_grammar(fmt)
    name = given[0]
    if name == "guided_json":
        return json_schema_field(req.guided_json, name), name
    if name == "guided_choice":
        return choice_grammar(req.guided_choice or []), name
    kind = "regex" if name == "guided_regex" else "ebnf"
    return grammar_field(kind, getattr(req, name), name), name


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


def openai_body(
    model: type[BodyT],
    body: Mapping[str, Any],
    served: str,
    refused: Mapping[str, str] = REFUSED,
) -> BodyT:
    """The model name first (404 for another model, as OpenAI), then the route's `refused`
    fields, then the body."""
    return _validate(model, without_refused(_served_model(body, served), refused))


def _served_model(body: Mapping[str, Any], served: str, required: bool = True) -> Mapping[str, Any]:
    name = body.get("model")
    if name is None and not required:
        return body
    if not isinstance(name, str):
        raise bad_request("model", f"`model` is required: this server serves {served!r}")
    if name != served:
        raise model_not_found(name, served)
    return body


def model_not_found(name: str, served: str, param: str | None = "model") -> APIError:
    return APIError(
        404,
        f"the model {name!r} does not exist here: this server serves {served!r} "
        "(GET /v1/models lists it)",
        param=param,
        code="model_not_found",
    )


def without_refused(
    body: Mapping[str, Any], refused: Mapping[str, str] = REFUSED
) -> Mapping[str, Any]:
    """400 for a field of `refused` with a value (with the reason); the body without the
    empty ones."""
    present = [name for name in refused if name in body]
    for name in present:
        if body[name] not in (None, [], {}, ""):
            raise bad_request(name, f"`{name}` is not supported: {refused[name]}; leave it out")
    return {k: v for k, v in body.items() if k not in present} if present else body


def sampling_options(
    fields: SamplingFields,
    limits: LimitsConfig,
    n: int,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
) -> SamplingOptions:
    nvext = getattr(fields, "nvext", None)
    if nvext is not None and nvext.ignore_eos is not None:
        if fields.ignore_eos is not None and fields.ignore_eos != nvext.ignore_eos:
            raise bad_request(
                "nvext.ignore_eos", "`nvext.ignore_eos` and `ignore_eos` disagree: give one"
            )
        fields = fields.model_copy(update={"ignore_eos": nvext.ignore_eos})
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
    call = message.function_call
    for where, given in (("tool_calls", calls), ("function_call", call)):
        if given and message.role != "assistant":
            where = f"messages[{index}].{where}"
            raise bad_request(where, f"`{where}` belongs to assistant messages only")
    if call is not None:  # the deprecated form: one call, named by its function
        calls += (ToolCall(f"call_{call.name}", call.name, call.arguments),)
    text = "".join(part.text for part in content) if isinstance(content, list) else content
    if message.role == "function":  # a function's result: a tool message answering its call
        if not message.name:
            where = f"messages[{index}].name"
            raise bad_request(where, f"`{where}` is required: the function that answered")
        return ChatMessage("tool", text or "", (), f"call_{message.name}")
    if message.name is not None:
        where = f"messages[{index}].name"
        raise bad_request(
            where,
            f"`{where}` belongs to function messages only (participant names are not "
            "shown to the model here)",
        )
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
