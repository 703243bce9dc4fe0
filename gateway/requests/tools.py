"""Tool calling: the request's tools, the grammar that forces a call, and parsing calls out of text.

`ToolSpec` is what a chat request's `tools`, `tool_choice` and `parallel_tool_calls` become:
- `none`: the tools are shown to the model (the chat template) but no call is parsed;
- `auto`: the model answers freely; calls in its text are parsed out (`ToolCallParser`);
- `required` / a named function: a grammar (`ToolSpec.grammar`) makes the answer a JSON call,
  `{"name": ..., "arguments": {...}}` (a list of them with `parallel_tool_calls`), whose
  arguments satisfy the function's `parameters` schema, even on a small model.

Parsers by chat-template family (`parser_family` reads the template): Qwen2/3 wrap each call in
`<tool_call>...</tool_call>`; Llama 3 writes `{"name": ..., "parameters": {...}}` (after
`<|python_tag|>`, several separated by `;`); anything else is read as JSON (an object or a list
of them, `arguments` or `parameters`). Forced calls are JSON, which every parser reads.

A template that ignores `tools` (many small models have none) gets the tools described in a
system message instead (`tools_system_prompt`), asking for the JSON form.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.grammar_spec import GrammarSpec

if TYPE_CHECKING:
    from gateway.requests.protocol import ChatMessage


@dataclass(frozen=True)
class ToolFunction:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_template_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @classmethod
    def new(cls, name: str, arguments: Any) -> ToolCall:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return cls("call_" + secrets.token_hex(12), name, text)

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolSpec:
    functions: tuple[ToolFunction, ...]
    choice: str  # "none" | "auto" | "required" | a function's name
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    @property
    def named(self) -> bool:
        return self.forced and self.choice != "required"

    def grammar(self) -> GrammarSpec | None:
        """The JSON call(s) a forced choice must produce; None for `none` and `auto`."""
        if not self.forced:
            return None
        chosen = [f for f in self.functions if self.choice in ("required", f.name)]
        calls = [_call_schema(f) for f in chosen]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": one, "minItems": 1} if self.parallel else one
        return GrammarSpec("json_schema", json.dumps(schema))


def _call_schema(function: ToolFunction) -> dict[str, Any]:
    parameters = function.parameters or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tools_system_prompt(spec: ToolSpec) -> str:
    """The tools in words, for a chat template that does not render them."""
    lines = [
        "You can call these functions. To call one, answer only with JSON "
        '{"name": <function name>, "arguments": <arguments object>}'
        + (" (a JSON list of such objects for several calls)." if spec.parallel else "."),
        "Functions:",
    ]
    for f in spec.functions:
        lines.append(json.dumps(f.as_template_tool()["function"]))
    return "\n".join(lines)


def render_chat(
    apply_template: Callable[..., Any],
    messages: Sequence[ChatMessage],
    tools: ToolSpec | None,
    family: str,
) -> str:
    """The chat prompt's text: `apply_template` is the tokenizer's `apply_chat_template`.

    The tools go through the template's own `tools` argument; a template that renders nothing
    for them gets them as a system message instead. Earlier calls are shown the way the family
    writes them (JSON content for the fallback family, `tool_calls` for the others)."""
    turns = [_template_message(m, family) for m in messages]

    def render(turns: list[dict[str, Any]], **extra: Any) -> str:
        text = apply_template(turns, tokenize=False, add_generation_prompt=True, **extra)
        return str(text)

    if tools is None:
        return render(turns)
    plain = render(turns)
    with_tools = render(turns, tools=[f.as_template_tool() for f in tools.functions])
    if with_tools != plain:
        return with_tools
    described = tools_system_prompt(tools)
    if turns and turns[0]["role"] == "system":
        first = {**turns[0], "content": turns[0]["content"] + "\n\n" + described}
        return render([first, *turns[1:]])
    return render([{"role": "system", "content": described}, *turns])


def _template_message(message: ChatMessage, family: str) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if not message.tool_calls:
        return turn
    calls = [{"name": c.name, "arguments": _arguments(c.arguments)} for c in message.tool_calls]
    if family == "json":  # the template knows no calls: show them as the model would write them
        shown = calls[0] if len(calls) == 1 else calls
        turn["content"] = (message.content + "\n" if message.content else "") + json.dumps(shown)
    else:
        turn["tool_calls"] = [{"type": "function", "function": c} for c in calls]
    return turn


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---- parsers ---------------------------------------------------------------------------------
class ToolCallParser(ABC):
    """Splits a model's answer into its text content and its tool calls."""

    @abstractmethod
    def parse(self, text: str, names: frozenset[str]) -> tuple[str, list[ToolCall]]:
        """(content, calls); calls to unknown functions are left in the content."""


def _calls_from_json(value: Any, names: frozenset[str]) -> list[ToolCall] | None:
    """Calls in a decoded JSON value (an object or a list of objects), None if it is none."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, (dict, str)):
            return None
        calls.append(ToolCall.new(item["name"], arguments))
    return calls or None


class JsonToolParser(ToolCallParser):
    """The whole answer (or a ```json fence in it) is a call or a list of calls."""

    def parse(self, text: str, names: frozenset[str]) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
        if fence:
            body = fence.group(1)
        try:
            calls = _calls_from_json(json.loads(body), names)
        except ValueError:
            return text, []
        return ("", calls) if calls else (text, [])


class QwenToolParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, any number; text around kept."""

    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str, names: frozenset[str]) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        for match in self._CALL.finditer(text):
            try:
                found = _calls_from_json(json.loads(match.group(1)), names)
            except ValueError:
                found = None
            if not found:
                return JsonToolParser().parse(text, names)
            calls += found
        if not calls:
            return JsonToolParser().parse(text, names)
        return self._CALL.sub("", text).strip(), calls


class Llama3ToolParser(ToolCallParser):
    """`<|python_tag|>{"name": ..., "parameters": ...}; {...}`, or the bare JSON."""

    def parse(self, text: str, names: frozenset[str]) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls: list[ToolCall] = []
        for part in _split_top_level(body, ";"):
            try:
                found = _calls_from_json(json.loads(part), names)
            except ValueError:
                found = None
            if not found:
                return JsonToolParser().parse(text, names)
            calls += found
        return ("", calls) if calls else (text, [])


def _split_top_level(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside JSON strings, objects and lists."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "qwen": QwenToolParser,
    "llama3": Llama3ToolParser,
    "json": JsonToolParser,
}


def parser_family(chat_template: str | None) -> str:
    """The tool-call family of a chat template: qwen, llama3, or json (the fallback)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "qwen"
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return "llama3"
    return "json"


def split_calls(
    text: str, tools: ToolSpec | None, template_family: str
) -> tuple[str, tuple[ToolCall, ...]]:
    """An answer's content and the tool calls parsed out of it: none unless `tools` parses
    them, one at most without `parallel`. A forced call is JSON whatever the template's family."""
    if tools is None or not tools.parses_calls:
        return text, ()
    names = frozenset(f.name for f in tools.functions)
    family = "json" if tools.forced else template_family
    content, calls = tool_parser(family).parse(text, names)
    if not calls:
        return text, ()
    return content, tuple(calls if tools.parallel else calls[:1])


def tool_parser(family: str) -> ToolCallParser:
    if family not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {family!r}; choose one of {list(TOOL_PARSERS)}")
    return TOOL_PARSERS[family]()
