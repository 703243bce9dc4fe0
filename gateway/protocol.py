"""Request bodies of the HTTP API, parsed into frozen dataclasses (400 on the first bad field).

- `/v1/completions`   -> CompletionRequest (prompt: text, token ids, or a list of either)
- `/v1/chat/completions` -> ChatRequest (messages with text content)
- `/generate` (native) -> NativeRequest (`text` or `input_ids`, `sampling_params`, `stream`)

Sampling fields become one `SamplingOptions`; `SamplingOptions.to_proto` makes the node's
`SamplingParams` for one choice (choice i of a seeded request uses seed + i, so the n choices
differ and each is reproducible). Extensions beyond OpenAI's fields, as other servers offer
them: `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config import LimitsConfig
from gateway.errors import APIError, bad_request
from gateway.fields import INT32_MAX, INT64_MAX, BodyReader
from proto import node_pb2

MAX_TOP_LOGPROBS = 20  # the engine's limit (engine/sampling.py)
MAX_STOP_TOKEN_IDS = 64
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields that would change what the client gets, which this server does not implement.
_UNSUPPORTED = ("logit_bias", "tools", "functions", "suffix", "audio", "prediction")

Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int | None  # None: the endpoint's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def to_proto(self, max_new_tokens: int, choice: int = 0) -> node_pb2.SamplingParams:
        msg = node_pb2.SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
        )
        if self.seed is not None:
            msg.seed = self.seed + choice
        return msg


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


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


@dataclass(frozen=True)
class NativeRequest:
    prompt: Prompt
    sampling: SamplingOptions
    stream: bool
    rid: str


def parse_completion(
    body: Mapping[str, Any], served: str, limits: LimitsConfig
) -> CompletionRequest:
    reader = _openai_reader(body, served)
    top = reader.integer("logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    sampling = _sampling(
        reader,
        limits,
        max_tokens=reader.integer("max_tokens", minimum=1),
        logprobs=top is not None,
        top_logprobs=top or 0,
    )
    echo = bool(reader.boolean("echo"))
    if echo and top is not None:
        raise bad_request(
            "echo", "`echo` with `logprobs` is not supported (prompt logprobs are not computed)"
        )
    n = _choices(reader, limits)
    prompts = _prompts(body.get("prompt"))
    if len(prompts) * n > limits.max_n:
        raise bad_request(
            "n", f"{len(prompts)} prompts x n={n} choices exceed the limit of {limits.max_n}"
        )
    stream, include_usage = _stream(reader)
    return CompletionRequest(prompts, sampling, n, stream, include_usage, echo)


def parse_chat(body: Mapping[str, Any], served: str, limits: LimitsConfig) -> ChatRequest:
    reader = _openai_reader(body, served)
    logprobs = bool(reader.boolean("logprobs"))
    top = reader.integer("top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise bad_request("top_logprobs", "`top_logprobs` needs `logprobs: true`")
    max_tokens = reader.integer("max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = reader.integer("max_tokens", minimum=1)
    sampling = _sampling(reader, limits, max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top)
    n = _choices(reader, limits)
    stream, include_usage = _stream(reader)
    return ChatRequest(_messages(body.get("messages")), sampling, n, stream, include_usage)


def parse_native(body: Mapping[str, Any], limits: LimitsConfig) -> NativeRequest:
    reader = BodyReader(body)
    text = reader.string("text")
    ids = reader.int_list("input_ids", max_items=1 << 24) if "input_ids" in body else None
    if (text is None) == (ids is None):
        raise bad_request("text", "give exactly one of `text` and `input_ids`")
    params = BodyReader(reader.mapping("sampling_params") or {})
    logprobs = bool(params.boolean("logprobs"))
    top = params.integer("top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS) or 0
    sampling = _sampling(
        params,
        limits,
        max_tokens=params.integer("max_new_tokens", minimum=1),
        logprobs=logprobs or top > 0,
        top_logprobs=top,
    )
    prompt: Prompt = text if text is not None else tuple(ids or ())
    return NativeRequest(
        prompt, sampling, bool(reader.boolean("stream")), reader.string("rid") or ""
    )


def _openai_reader(body: Mapping[str, Any], served: str) -> BodyReader:
    reader = BodyReader(body)
    model = reader.string("model")
    if model is None:
        raise bad_request("model", f"`model` is required: this server serves {served!r}")
    if model != served:
        raise APIError(
            404,
            f"the model {model!r} does not exist here: this server serves {served!r} "
            "(GET /v1/models lists it)",
            param="model",
            code="model_not_found",
        )
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, [], {}, ""):
            raise bad_request(name, f"`{name}` is not supported by this server; leave it out")
    response_format = reader.mapping("response_format")
    if response_format is not None and response_format.get("type", "text") != "text":
        raise bad_request("response_format", "only `response_format: {type: text}` is supported")
    return reader


def _sampling(
    reader: BodyReader,
    limits: LimitsConfig,
    *,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
) -> SamplingOptions:
    top_k = reader.integer("top_k", minimum=-1, maximum=INT32_MAX)
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=_float(reader.number("temperature", minimum=0.0, maximum=2.0), 1.0),
        top_p=_float(reader.number("top_p", minimum=0.0, maximum=1.0, exclusive_minimum=True), 1.0),
        top_k=-1 if top_k is None else top_k,
        min_p=_float(reader.number("min_p", minimum=0.0, maximum=1.0), 0.0),
        frequency_penalty=_float(reader.number("frequency_penalty", minimum=-2, maximum=2), 0.0),
        presence_penalty=_float(reader.number("presence_penalty", minimum=-2, maximum=2), 0.0),
        repetition_penalty=_float(
            reader.number("repetition_penalty", minimum=0.0, exclusive_minimum=True), 1.0
        ),
        # choice i samples with seed + i: every one must fit the node API's int64
        seed=reader.integer("seed", minimum=-INT64_MAX - 1, maximum=INT64_MAX - limits.max_n),
        stop=reader.stop_strings(
            "stop", max_items=limits.max_stop, max_chars=limits.max_stop_chars
        ),
        stop_token_ids=reader.int_list("stop_token_ids", max_items=MAX_STOP_TOKEN_IDS),
        ignore_eos=bool(reader.boolean("ignore_eos")),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def _float(value: float | None, default: float) -> float:
    return default if value is None else value


def _choices(reader: BodyReader, limits: LimitsConfig) -> int:
    n = reader.integer("n", minimum=1, maximum=limits.max_n)
    best_of = reader.integer("best_of", minimum=1)
    if best_of is not None and best_of != (n or 1):
        raise bad_request("best_of", "`best_of` other than `n` is not supported")
    return n or 1


def _stream(reader: BodyReader) -> tuple[bool, bool]:
    stream = bool(reader.boolean("stream"))
    options = reader.mapping("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options", "`stream_options` needs `stream: true`")
    usage = BodyReader(options).boolean("include_usage")
    return stream, bool(usage)


def _prompts(value: object) -> tuple[Prompt, ...]:
    """A string, a list of token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return (tuple(value),)
        prompts: list[Prompt] = []
        for item in value:
            if isinstance(item, str):
                prompts.append(item)
            elif isinstance(item, list) and item and all(isinstance(v, int) for v in item):
                prompts.append(tuple(item))
            else:
                break
        else:
            return tuple(prompts)
    raise bad_request(
        "prompt",
        "`prompt` is required: a string, a list of token ids, or a list of strings or of "
        "token-id lists",
    )


def _messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages", "`messages` is required: a non-empty list of messages")
    return tuple(_message(i, m) for i, m in enumerate(value))


def _message(index: int, value: object) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(value, Mapping):
        raise bad_request(where, f"`{where}` must be an object with `role` and `content`")
    role = value.get("role")
    if role not in _CHAT_ROLES:
        raise bad_request(f"{where}.role", f"`{where}.role` must be one of {list(_CHAT_ROLES)}")
    content = value.get("content")
    if content is None and role == "assistant":
        return ChatMessage(role, "")
    if isinstance(content, str):
        return ChatMessage(role, content)
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise bad_request(
                    f"{where}.content", "only text content parts (`type: text`) are supported"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}.content", "a text content part needs a `text` string")
            parts.append(text)
        return ChatMessage(role, "".join(parts))
    raise bad_request(f"{where}.content", f"`{where}.content` must be a string or text parts")
