"""Tool calling units (gateway/requests/tools.py): the parsers per chat-template family, the family
read from a template, the forcing grammar, and how tools reach a template that ignores them."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from gateway.requests.protocol import ChatMessage
from gateway.requests.tools import (
    ToolCall,
    ToolFunction,
    ToolSpec,
    parser_family,
    render_chat,
    tool_parser,
)

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = ToolFunction(
    "get_weather",
    "weather of a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = ToolFunction("get_time", "time now", {})


@pytest.mark.parametrize(
    ("family", "text", "content", "calls"),
    [
        ("qwen", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
         '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
         "Sure.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
        ("qwen", "No tools needed.", "No tools needed.", []),
        ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}; '
         '{"name": "get_time", "parameters": {}}', "",
         [("get_weather", {"city": "a;b"}), ("get_time", {})]),
        ("llama3", '{"name": "get_time", "parameters": {"tz": "say \\"hi\\"; ok"}}', "",
         [("get_time", {"tz": 'say "hi"; ok'})]),
        ("json", '[{"name": "get_time", "arguments": {}}]', "", [("get_time", {})]),
        ("json", '```json\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n```', "",
         [("get_weather", {"city": "Rome"})]),
        ("json", '{"name": "nope", "arguments": {}}', '{"name": "nope", "arguments": {}}', []),
        ("json", "The weather is fine.", "The weather is fine.", []),
    ],
)  # fmt: skip
def test_parsers_split_content_and_calls(
    family: str, text: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    got_content, got_calls = tool_parser(family).parse(text, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.as_openai(0)["type"] == "function" for c in got_calls)


def test_family_is_read_from_the_template() -> None:
    assert parser_family("{% for tool in tools %}<tool_call>{% endfor %}") == "qwen"
    assert parser_family("Environment: ipython\n<|python_tag|>") == "llama3"
    assert parser_family("<|im_start|>{{ message['content'] }}") == "json"
    assert parser_family(None) == "json"


@pytest.mark.parametrize("parallel", [True, False])
def test_forcing_grammar_accepts_only_calls_with_valid_arguments(parallel: bool) -> None:
    grammar = ToolSpec((WEATHER, TIME), "required", parallel).grammar()
    assert grammar is not None and grammar.kind == "json_schema"
    schema = json.loads(grammar.spec)
    call = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    good = [call] if parallel else call
    jsonschema.validate(good, schema)
    bad = {"name": "get_weather", "arguments": {}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([bad] if parallel else bad, schema)
    named = json.loads(ToolSpec((WEATHER, TIME), "get_time", False).grammar().spec)  # type: ignore[union-attr]
    assert named["properties"]["name"] == {"const": "get_time"}
    assert ToolSpec((WEATHER,), "auto").grammar() is None


def _template(turns: list[dict[str, Any]], tools: Any = None, **_: Any) -> str:
    """A template that renders tools only when `knows_tools` is on."""
    text = "".join(f"<{t['role']}>{t['content']}" for t in turns)
    return text + (f"<tools>{json.dumps(tools)}" if tools and _template.knows_tools else "")  # type: ignore[attr-defined]


def test_tools_reach_a_template_that_ignores_them_as_a_system_message() -> None:
    spec = ToolSpec((WEATHER,), "auto")
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in Oslo?")]
    _template.knows_tools = False  # type: ignore[attr-defined]
    text = render_chat(_template, messages, spec, "json")
    assert text.startswith("<system>Be brief.\n\nYou can call these functions.")
    assert '"name": "get_weather"' in text
    _template.knows_tools = True  # type: ignore[attr-defined]
    text = render_chat(_template, messages, spec, "qwen")
    assert text.endswith(f"<tools>{json.dumps([WEATHER.as_template_tool()])}")


def test_earlier_calls_are_shown_in_the_familys_form() -> None:
    call = ToolCall("call_1", "get_time", "{}")
    history = [ChatMessage("assistant", "", (call,)), ChatMessage("tool", "12:00", (), "call_1")]
    seen: list[list[dict[str, Any]]] = []

    def record(turns: list[dict[str, Any]], **_: Any) -> str:
        seen.append(turns)
        return ""

    render_chat(record, history, None, "json")
    assert seen[-1][0]["content"] == '{"name": "get_time", "arguments": {}}'
    render_chat(record, history, None, "qwen")
    assert seen[-1][0]["tool_calls"] == [
        {"type": "function", "function": {"name": "get_time", "arguments": {}}}
    ]
    assert seen[-1][1]["tool_call_id"] == "call_1"


def test_openapi_document_publishes_the_new_fields() -> None:
    from gateway.api.openapi import openapi_document
    from gateway.config import GatewayConfig, ModelInfo
    from tests.test_gateway_units import LIMITS, ROUTING

    config = GatewayConfig(
        "127.0.0.1", 1, "127.0.0.1:2", ModelInfo("path", "m", 32), LIMITS, ROUTING
    )
    schemas = openapi_document(config)["components"]["schemas"]
    chat = schemas["ChatBody"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "response_format"} <= set(chat)
    formats = schemas["ResponseFormat"]["properties"]["type"]["enum"]
    assert set(formats) == {"text", "json_object", "json_schema"}
    assert "schema" in schemas["JSONSchemaFormat"]["properties"]
    message = schemas["MessageBody"]["properties"]
    assert {"tool_calls", "tool_call_id"} <= set(message)
    native = schemas["NativeSamplingFields"]["properties"]
    assert {"json_schema", "regex", "ebnf", "prompt_logprobs"} <= set(native)
