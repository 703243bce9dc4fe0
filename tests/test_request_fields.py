"""Nothing accepted and ignored: every field the request models declare changes what the gateway
sends on (the node's sampling message, the prompt's messages, the tools, the answer's shape), or
is one of `NO_EFFECT`'s, which by their definition change no answer; every other field answers
400 naming it. No processes: the parsers alone."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import BaseModel

from gateway.errors import APIError
from gateway.requests import protocol
from gateway.requests.fields import _model_in
from gateway.requests.protocol import (
    BODIES,
    NO_EFFECT,
    REFUSED,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_native,
    parse_tokenize,
)
from gateway.requests.responses import NO_EFFECT as RESPONSES_NO_EFFECT_REASONS
from gateway.requests.responses import REFUSED as RESPONSES_REFUSED
from gateway.requests.responses import ResponsesBody, ResponsesRequest, parse_responses
from tests.test_gateway_units import LIMITS

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
NATIVE = {"text": "hi"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
ASSISTANT_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
SAMPLING = {  # a value other than the default, for the sampling fields of every route
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 5,
    "min_p": 0.1,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "repetition_penalty": 1.5,
    "seed": 7,
    "stop": "x",
    "stop_token_ids": [3],
    "ignore_eos": True,
    "min_tokens": 2,
    "logit_bias": {"5": 1.0},
}


def _chat(**fields: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    return "chat", CHAT, {**CHAT, **fields}


def _message(base: dict[str, Any], changed: dict[str, Any]) -> tuple[str, dict, dict]:
    return "chat", {**CHAT, "messages": [base]}, {**CHAT, "messages": [changed]}


def _tools(base: dict[str, Any], changed: dict[str, Any]) -> tuple[str, dict, dict]:
    return "chat", {**CHAT, **base}, {**CHAT, **changed}


def _format(changed: dict[str, Any]) -> tuple[str, dict, dict]:
    json_schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    return "chat", {**CHAT, "response_format": json_schema}, {**CHAT, "response_format": changed}


# "Model.field" -> (route, a body, the same body with that field given or changed)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    **{
        f"SamplingFields.{name}": ("completions", COMPLETION, {**COMPLETION, name: value})
        for name, value in SAMPLING.items()
    },
    **{
        f"NativeSamplingFields.{name}": (
            "generate",
            NATIVE,
            {**NATIVE, "sampling_params": {name: value}},
        )
        for name, value in SAMPLING.items()
    },
    "_OpenAIBody.model": ("completions", COMPLETION, {**COMPLETION, "model": "other"}),
    "_OpenAIBody.n": ("completions", COMPLETION, {**COMPLETION, "n": 2}),
    "_OpenAIBody.best_of": ("completions", COMPLETION, {**COMPLETION, "best_of": 2}),
    "_OpenAIBody.stream": ("completions", COMPLETION, {**COMPLETION, "stream": True}),
    "_OpenAIBody.stream_options": (
        "completions",
        {**COMPLETION, "stream": True},
        {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "StreamOptions.include_usage": (
        "completions",
        {**COMPLETION, "stream": True, "stream_options": {}},
        {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "_OpenAIBody.response_format": _chat(response_format={"type": "json_object"}),
    "ResponseFormat.type": _format({"type": "json_object"}),
    "ResponseFormat.json_schema": _format({"type": "json_schema", "json_schema": {"name": "n"}}),
    "JSONSchemaFormat.name": _format({"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
    "JSONSchemaFormat.description": _format(
        {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "description": "d"}}
    ),
    "JSONSchemaFormat.schema_": _format({"type": "json_schema", "json_schema": {"name": "n"}}),
    "_OpenAIBody.max_tokens": ("completions", COMPLETION, {**COMPLETION, "max_tokens": 3}),
    "_OpenAIBody.guided_json": _chat(guided_json=SCHEMA),
    "_OpenAIBody.guided_regex": _chat(guided_regex="[ab]+"),
    "_OpenAIBody.guided_choice": _chat(guided_choice=["yes", "no"]),
    "_OpenAIBody.guided_grammar": _chat(guided_grammar='root ::= "a"'),
    "_OpenAIBody.nvext": _chat(nvext={"ignore_eos": True}),
    "NvExt.ignore_eos": ("chat", {**CHAT, "nvext": {}}, {**CHAT, "nvext": {"ignore_eos": True}}),
    "CompletionBody.prompt": ("completions", COMPLETION, {**COMPLETION, "prompt": "other"}),
    "CompletionBody.echo": ("completions", COMPLETION, {**COMPLETION, "echo": True}),
    "CompletionBody.logprobs": ("completions", COMPLETION, {**COMPLETION, "logprobs": 2}),
    "CompletionBody.max_tokens": ("completions", COMPLETION, {**COMPLETION, "max_tokens": 3}),
    "ChatBody.messages": _chat(messages=[{"role": "user", "content": "other"}]),
    "ChatBody.max_completion_tokens": _chat(max_completion_tokens=3),
    "ChatBody.logprobs": _chat(logprobs=True),
    "ChatBody.top_logprobs": (
        "chat",
        {**CHAT, "logprobs": True},
        {**CHAT, "logprobs": True, "top_logprobs": 2},
    ),
    "ChatBody.tools": _chat(tools=[TOOL]),
    "ChatBody.tool_choice": _tools({"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "none"}),
    "ChatBody.parallel_tool_calls": _tools(
        {"tools": [TOOL]}, {"tools": [TOOL], "parallel_tool_calls": False}
    ),
    "ChatBody.functions": _chat(functions=[TOOL["function"]]),
    "ChatBody.function_call": _tools(
        {"functions": [TOOL["function"]]},
        {"functions": [TOOL["function"]], "function_call": {"name": "f"}},
    ),
    "NamedFunction.name": _tools(
        {"functions": [TOOL["function"], {"name": "g"}], "function_call": {"name": "f"}},
        {"functions": [TOOL["function"], {"name": "g"}], "function_call": {"name": "g"}},
    ),
    "ToolBody.type": _tools({}, {"tools": [TOOL]}),
    "ToolBody.function": _tools(
        {"tools": [TOOL]}, {"tools": [{**TOOL, "function": {"name": "g"}}]}
    ),
    "FunctionBody.name": _tools(
        {"tools": [TOOL]}, {"tools": [{**TOOL, "function": {"name": "g"}}]}
    ),
    "FunctionBody.description": _tools(
        {"tools": [TOOL]},
        {"tools": [{**TOOL, "function": {**TOOL["function"], "description": "d"}}]},
    ),
    "FunctionBody.parameters": _tools(
        {"tools": [TOOL]}, {"tools": [{**TOOL, "function": {"name": "f"}}]}
    ),
    "FunctionBody.strict": _tools(
        {"tools": [TOOL]}, {"tools": [{**TOOL, "function": {**TOOL["function"], "strict": True}}]}
    ),
    "JSONSchemaFormat.strict": _format(
        {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": False}}
    ),
    "NamedToolChoice.type": _tools(
        {"tools": [TOOL]},
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
    ),
    "NamedToolChoice.function": _tools(
        {"tools": [TOOL]},
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
    ),
    "MessageBody.role": _message(
        {"role": "user", "content": "x"}, {"role": "system", "content": "x"}
    ),
    "MessageBody.content": _message(
        {"role": "user", "content": "x"}, {"role": "user", "content": "y"}
    ),
    "TextPart.type": _message(
        {"role": "user", "content": "x"},
        {"role": "user", "content": [{"type": "text", "text": "y"}]},
    ),
    "TextPart.text": _message(
        {"role": "user", "content": [{"type": "text", "text": "x"}]},
        {"role": "user", "content": [{"type": "text", "text": "y"}]},
    ),
    "MessageBody.tool_calls": _message({"role": "assistant", "content": None}, ASSISTANT_CALL),
    "ToolCallBody.id": _message(
        ASSISTANT_CALL,
        {**ASSISTANT_CALL, "tool_calls": [{**ASSISTANT_CALL["tool_calls"][0], "id": "c2"}]},
    ),
    "ToolCallBody.type": _message({"role": "assistant", "content": None}, ASSISTANT_CALL),
    "ToolCallBody.function": _message({"role": "assistant", "content": None}, ASSISTANT_CALL),
    "FunctionCallBody.name": _message(
        {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "assistant", "function_call": {"name": "g", "arguments": "{}"}},
    ),
    "FunctionCallBody.arguments": _message(
        {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "assistant", "function_call": {"name": "f", "arguments": '{"a": 1}'}},
    ),
    "MessageBody.function_call": _message(
        {"role": "assistant", "content": "x"},
        {"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
    ),
    "MessageBody.tool_call_id": _message(
        {"role": "tool", "content": "x"}, {"role": "tool", "content": "x", "tool_call_id": "c1"}
    ),
    "MessageBody.name": _message(
        {"role": "function", "content": "x", "name": "f"},
        {"role": "function", "content": "x", "name": "g"},
    ),
    "GenerateBody.text": ("generate", NATIVE, {"text": "other"}),
    "GenerateBody.input_ids": ("generate", NATIVE, {"input_ids": [1, 2]}),
    "GenerateBody.rid": ("generate", NATIVE, {**NATIVE, "rid": "r1"}),
    "GenerateBody.stream": ("generate", NATIVE, {**NATIVE, "stream": True}),
    "GenerateBody.sampling_params": (
        "generate",
        NATIVE,
        {**NATIVE, "sampling_params": {"top_k": 2}},
    ),
    **{
        f"NativeSamplingFields.{name}": (
            "generate",
            NATIVE,
            {**NATIVE, "sampling_params": {name: value}},
        )
        for name, value in {
            "max_new_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "json_schema": SCHEMA,
            "regex": "[ab]+",
            "ebnf": 'root ::= "a"',
            "prompt_logprobs": 1,
        }.items()
    },
}
NESTED_NO_EFFECT = {"JSONSchemaFormat.strict": "response_format.json_schema.strict"}
RESPONSES = {"model": "m", "input": "hi"}
R_SCHEMA = {"type": "json_schema", "name": "n", "schema": SCHEMA}
R_TOOL = {"type": "function", "name": "f", "parameters": SCHEMA}
R_CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
R_MESSAGE = {"role": "user", "content": "x"}


def _responses(**fields: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    return "responses", RESPONSES, {**RESPONSES, **fields}


def _items(base: list[dict[str, Any]], changed: list[dict[str, Any]]) -> tuple[str, dict, dict]:
    return "responses", {**RESPONSES, "input": base}, {**RESPONSES, "input": changed}


CASES.update({
    "ResponsesBody.model": _responses(model="other"),
    "ResponsesBody.input": _responses(input="other"),
    "ResponsesBody.instructions": _responses(instructions="be brief"),
    "ResponsesBody.max_output_tokens": _responses(max_output_tokens=3),
    "ResponsesBody.temperature": _responses(temperature=0.5),
    "ResponsesBody.top_p": _responses(top_p=0.5),
    "ResponsesBody.seed": _responses(seed=3),
    "ResponsesBody.tools": _responses(tools=[R_TOOL]),
    "ResponsesBody.tool_choice": ("responses", {**RESPONSES, "tools": [R_TOOL]},
                                  {**RESPONSES, "tools": [R_TOOL], "tool_choice": "required"}),
    "ResponsesBody.parallel_tool_calls": ("responses", {**RESPONSES, "tools": [R_TOOL]},
                                          {**RESPONSES, "tools": [R_TOOL],
                                           "parallel_tool_calls": False}),
    "ResponsesBody.text": _responses(text={"format": {"type": "json_object"}}),
    "TextConfig.format": _responses(text={"format": R_SCHEMA}),
    "TextFormat.type": ("responses", {**RESPONSES, "text": {"format": {"type": "text"}}},
                        {**RESPONSES, "text": {"format": {"type": "json_object"}}}),
    "TextFormat.name": ("responses", {**RESPONSES, "text": {"format": R_SCHEMA}},
                        {**RESPONSES, "text": {"format": {**R_SCHEMA, "name": None}}}),
    "TextFormat.schema_": ("responses", {**RESPONSES, "text": {"format": R_SCHEMA}},
                           {**RESPONSES, "text": {"format": {**R_SCHEMA, "schema": {}}}}),
    "TextFormat.description": ("responses", {**RESPONSES, "text": {"format": R_SCHEMA}},
                               {**RESPONSES, "text": {"format": {**R_SCHEMA,
                                                                 "description": "d"}}}),
    "ResponsesBody.stream": _responses(stream=True),
    "ResponsesBody.store": _responses(store=False),
    "ResponsesBody.previous_response_id": _responses(previous_response_id="resp_1"),
    "ResponsesBody.metadata": _responses(metadata={"k": "v"}),
    "FunctionTool.type": _responses(tools=[R_TOOL]),
    "FunctionTool.name": ("responses", {**RESPONSES, "tools": [R_TOOL]},
                          {**RESPONSES, "tools": [{**R_TOOL, "name": "g"}]}),
    "FunctionTool.description": ("responses", {**RESPONSES, "tools": [R_TOOL]},
                                 {**RESPONSES, "tools": [{**R_TOOL, "description": "d"}]}),
    "FunctionTool.parameters": ("responses", {**RESPONSES, "tools": [R_TOOL]},
                                {**RESPONSES, "tools": [{**R_TOOL, "parameters": None}]}),
    "FunctionTool.strict": ("responses", {**RESPONSES, "tools": [R_TOOL]},
                            {**RESPONSES, "tools": [{**R_TOOL, "strict": True}]}),
    "FunctionChoice.type": ("responses", {**RESPONSES, "tools": [R_TOOL]},
                            {**RESPONSES, "tools": [R_TOOL],
                             "tool_choice": {"type": "function", "name": "f"}}),
    "FunctionChoice.name": ("responses",
                            {**RESPONSES, "tools": [R_TOOL, {**R_TOOL, "name": "g"}],
                             "tool_choice": {"type": "function", "name": "f"}},
                            {**RESPONSES, "tools": [R_TOOL, {**R_TOOL, "name": "g"}],
                             "tool_choice": {"type": "function", "name": "g"}}),
    "InputItem.type": _items([R_MESSAGE, R_CALL], [R_MESSAGE, {**R_CALL, "type": "message",
                             "role": "user", "content": "x", "call_id": None, "name": None,
                             "arguments": None}]),
    "InputItem.role": _items([R_MESSAGE], [{**R_MESSAGE, "role": "system"}]),
    "InputItem.content": _items([R_MESSAGE], [{**R_MESSAGE, "content": "y"}]),
    "InputItem.call_id": _items([R_MESSAGE, R_CALL], [R_MESSAGE, {**R_CALL, "call_id": "c2"}]),
    "InputItem.name": _items([R_MESSAGE, R_CALL], [R_MESSAGE, {**R_CALL, "name": "g"}]),
    "InputItem.arguments": _items([R_MESSAGE, R_CALL],
                                  [R_MESSAGE, {**R_CALL, "arguments": '{"a": 1}'}]),
    "InputItem.output": _items(
        [R_MESSAGE, R_CALL, {"type": "function_call_output", "call_id": "c1", "output": "1"}],
        [R_MESSAGE, R_CALL, {"type": "function_call_output", "call_id": "c1", "output": "2"}],
    ),
    "InputTextPart.type": _items([R_MESSAGE],
                                 [{**R_MESSAGE, "content": [{"type": "input_text",
                                                             "text": "y"}]}]),
    "InputTextPart.text": _items([{**R_MESSAGE, "content": [{"type": "input_text", "text": "x"}]}],
                                 [{**R_MESSAGE, "content": [{"type": "input_text", "text": "y"}]}]),
})  # fmt: skip
# Responses fields that change no answer by definition, by the path NO_EFFECT names them
RESPONSES_NO_EFFECT = {
    "ResponsesBody.user": "user",
    "ResponsesBody.truncation": "truncation",
    "InputItem.id": "input[].id",
    "InputItem.status": "input[].status",
    "InputTextPart.annotations": "input[].content[].annotations",
    "TextFormat.strict": "text.format.strict",
}
TEXT_CASES = {
    "TokenizeBody.model": ("tokenize", {"prompt": "hi"}, {"prompt": "hi", "model": "other"}),
    "TokenizeBody.prompt": ("tokenize", {"prompt": "hi"}, {"prompt": "other"}),
    "TokenizeBody.messages": ("tokenize", {"prompt": "hi"}, {"messages": CHAT["messages"]}),
    "TokenizeBody.tools": (
        "tokenize",
        {"messages": CHAT["messages"]},
        {"messages": CHAT["messages"], "tools": [TOOL]},
    ),
    "TokenizeBody.add_special_tokens": (
        "tokenize",
        {"prompt": "hi"},
        {"prompt": "hi", "add_special_tokens": False},
    ),
    "TokenizeBody.return_token_strs": (
        "tokenize",
        {"prompt": "hi"},
        {"prompt": "hi", "return_token_strs": True},
    ),
    "DetokenizeBody.model": ("detokenize", {"tokens": [1]}, {"tokens": [1], "model": "other"}),
    "DetokenizeBody.tokens": ("detokenize", {"tokens": [1]}, {"tokens": [2]}),
}
CASES.update(TEXT_CASES)
PARSERS = {
    "responses": lambda body: parse_responses(body, "m", LIMITS),
    "tokenize": lambda body: parse_tokenize(body, "m"),
    "detokenize": lambda body: parse_detokenize(body, "m"),
    "chat": lambda body: parse_chat(body, "m", LIMITS),
    "completions": lambda body: parse_completion(body, "m", LIMITS),
    "generate": lambda body: parse_native(body, LIMITS),
}


def _models(roots: tuple[type[BaseModel], ...]) -> dict[str, type[BaseModel]]:
    """Every model reachable from `roots`, by name (the classes that declare fields)."""
    found: dict[str, type[BaseModel]] = {}
    todo = list(roots)
    while todo:
        model = todo.pop()
        for cls in model.__mro__:
            if isinstance(cls, type) and issubclass(cls, BaseModel) and cls is not BaseModel:
                found.setdefault(cls.__name__, cls)
        for info in model.model_fields.values():
            inner = _model_in(info.annotation)
            if inner is not None and inner.__name__ not in found:
                todo.append(inner)
    return found


def _declared(roots: tuple[type[BaseModel], ...] = (*BODIES, ResponsesBody)) -> list[str]:
    """Each field as `Model.field`, named by the class that declares it."""
    names = []
    for name, model in _models(roots).items():
        own = getattr(model, "__annotations__", {})
        names += [f"{name}.{field}" for field in model.model_fields if field in own]
    return sorted(set(names))


def _effect(route: str, body: dict[str, Any]) -> Any:
    """What the gateway does with a body: the parsed request with its sampling fields replaced
    by the node messages they become (the pydantic model itself holds every field given),
    or the error it answers."""
    try:
        req = PARSERS[route](body)
    except APIError as exc:
        return ("error", exc.status, exc.param)
    if not hasattr(req, "sampling"):
        return req
    sampling = req.sampling
    messages = [sampling.to_proto(64, c).SerializeToString(deterministic=True) for c in range(2)]
    options = {f.name: getattr(sampling, f.name) for f in dataclasses.fields(sampling)}
    options.pop("fields")
    if isinstance(req, ResponsesRequest):  # the body's fields the handler reads, beside these
        body = req.body
        read = (body.stream, body.store, body.previous_response_id, body.metadata)
        return (req.input, req.instructions, req.tools, read), options, messages
    plain = {f.name: getattr(req, f.name) for f in dataclasses.fields(req) if f.name != "sampling"}
    return plain, options, messages


@pytest.mark.parametrize("field", _declared())
def test_every_declared_field_changes_what_is_sent_on(field: str) -> None:
    name = field.split(".")[1]
    if field in RESPONSES_NO_EFFECT:
        assert RESPONSES_NO_EFFECT[field] in RESPONSES_NO_EFFECT_REASONS
        return
    if name in NO_EFFECT or NESTED_NO_EFFECT.get(field) in NO_EFFECT:
        return  # checked below: accepted, and without effect by definition
    assert field in CASES, f"{field} is declared: add a case showing what it changes"
    route, base, changed = CASES[field]
    assert _effect(route, base) != _effect(route, changed), field


@pytest.mark.parametrize(
    ("name", "value"),
    [("user", "u1"), ("safety_identifier", "s1"), ("service_tier", "auto"), ("store", False),
     ("modalities", ["text"])],
)  # fmt: skip
def test_fields_without_effect_are_accepted_and_change_nothing(name: str, value: Any) -> None:
    assert name in NO_EFFECT
    assert _effect("chat", CHAT) == _effect("chat", {**CHAT, name: value})


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat", {**CHAT, "store": True}, "store"),
        ("chat", {**CHAT, "service_tier": "flex"}, "service_tier"),
        ("chat", {**CHAT, "modalities": ["text", "audio"]}, "modalities[1]"),
        ("chat", {**CHAT, "temprature": 0.1}, "temprature"),
        ("chat", {**CHAT, "messages": [{"role": "user", "content": "x", "lang": "en"}]},
         "messages[0].lang"),
        ("completions", {**COMPLETION, "nvext": {"use_raw_prompt": True}}, "nvext.use_raw_prompt"),
        ("generate", {**NATIVE, "sampling_params": {"skip_special_tokens": False}},
         "sampling_params.skip_special_tokens"),
        ("generate", {**NATIVE, "return_logprob": True}, "return_logprob"),
        *[("chat", {**CHAT, name: "x"}, name) for name in REFUSED],
    ],
)  # fmt: skip
def test_every_other_field_answers_400_naming_it(route: str, body: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        PARSERS[route](body)
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_empty_refused_fields_are_taken_as_absent() -> None:
    assert _effect("chat", CHAT) == _effect("chat", {**CHAT, "metadata": {}, "suffix": None})


def test_the_refusals_say_why() -> None:
    with pytest.raises(APIError) as info:
        parse_chat({**CHAT, "audio": {"voice": "x"}}, "m", LIMITS)
    assert "audio output is not supported" in info.value.message
    with pytest.raises(APIError) as info:
        parse_chat({**CHAT, "temprature": 0.1}, "m", LIMITS)
    assert "`temprature` is not a field of this request" in info.value.message


def test_no_effect_and_refused_lists_name_real_fields() -> None:
    declared = {field.split(".")[1] for field in _declared(BODIES)}
    assert set(NO_EFFECT) - set(NESTED_NO_EFFECT.values()) <= declared
    assert not set(REFUSED) & declared
    responses = {field.split(".")[1] for field in _declared((ResponsesBody,))}
    assert not set(RESPONSES_REFUSED) & responses
    assert protocol.REFUSED is REFUSED
