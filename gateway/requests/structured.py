"""Request bodies and their parsing for structured output and tools (used by protocol.py and
responses.py).

- `response_format` (`ResponseFormat`): `json_object` or `json_schema` become the request's
  grammar; `/generate`'s `json_schema`, `regex` and `ebnf` likewise (`native_grammar`);
- `tools`, `tool_choice`, `parallel_tool_calls` become a `ToolSpec` (gateway/requests/tools.py):
  `parse_tools` for a chat's, `tool_function` and `tool_spec` for any route's;
- a schema feature the engine cannot enforce answers 400 naming the field and the keyword; a
  schema the compiler refuses is answered by the node (gateway/api/openai_api.py, grammar_refusal).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from engine.grammar_spec import GrammarSpec, unsupported_schema_feature
from gateway.errors import bad_request
from gateway.requests.fields import RequestModel as _Body
from gateway.requests.tools import ToolFunction, ToolSpec

NonEmptyStr = Annotated[str, Field(min_length=1)]


class JSONSchemaFormat(_Body):
    name: str = Field(description="the schema's name")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        default=None, alias="schema", description="a JSON Schema object (absent: any object)"
    )
    strict: bool | None = Field(
        default=None, description="either: the output is always held to the schema"
    )


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(
        "text", description="'text', 'json_object' or 'json_schema' (with `json_schema`)"
    )
    json_schema: JSONSchemaFormat | None = None


class FunctionCallBody(_Body):
    name: NonEmptyStr
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallBody(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class FunctionBody(_Body):
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


class ToolBody(_Body):
    type: Literal["function"]
    function: FunctionBody


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


def parse_tools(
    tools: list[ToolBody] | None,
    choice_body: Literal["none", "auto", "required"] | NamedToolChoice | None,
    parallel_tool_calls: bool | None,
) -> ToolSpec | None:
    """A chat's `tools`, `tool_choice` and `parallel_tool_calls`."""
    functions = [
        tool_function(f.name, f.description, f.parameters, f"tools[{i}].function.parameters")
        for i, f in enumerate(t.function for t in tools or ())
    ]
    strict = [f"tools[{i}].function.strict" for i, t in enumerate(tools or ()) if t.function.strict]
    strict_param = strict[0] if strict else None
    if isinstance(choice_body, NamedToolChoice):
        named = "tool_choice.function.name"
        return tool_spec(
            functions, choice_body.function.name, parallel_tool_calls, named, strict_param
        )
    return tool_spec(functions, choice_body, parallel_tool_calls, strict_param=strict_param)


def tool_function(
    name: str, description: str | None, parameters: dict[str, Any] | None, param: str
) -> ToolFunction:
    """One function tool; 400 naming `param` (where its `parameters` are) for a schema feature
    the engine cannot enforce."""
    schema = parameters or {"type": "object", "properties": {}}
    unsupported = unsupported_schema_feature(schema)
    if unsupported:
        raise bad_request(
            param, f"`{param}` uses an unsupported JSON Schema feature: {unsupported}"
        )
    return ToolFunction(name, description or "", schema)


def tool_spec(
    functions: list[ToolFunction],
    choice: str | None,
    parallel_tool_calls: bool | None,
    named_param: str | None = None,
    strict_param: str | None = None,
) -> ToolSpec | None:
    """The tools of a request (OpenAI's defaults: auto, parallel); `named_param`: where the
    request names the function `choice` forces, None when `choice` names none; `strict_param`:
    the first tool that asks for calls held to its schema, which only a forced choice gives."""
    if not functions:
        if choice not in (None, "none"):
            raise bad_request("tool_choice", "`tool_choice` needs `tools`")
        return None
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools", "`tools` names a function twice: names must be unique")
    if named_param is not None and choice not in names:
        raise bad_request(
            named_param, f"`tool_choice` names {choice!r}, which is not in `tools` ({names})"
        )
    if strict_param is not None and (choice or "auto") == "auto":
        raise bad_request(
            strict_param,
            f"`{strict_param}`: calls under tool_choice 'auto' are read from the model's free "
            "text, not held to the schema; send tool_choice 'required' or a named function "
            "for calls held to it, or leave `strict` out",
        )
    parallel = parallel_tool_calls is not False
    return ToolSpec(tuple(functions), choice or "auto", parallel)


def response_format_grammar(fmt: ResponseFormat | None) -> tuple[GrammarSpec | None, str | None]:
    """OpenAI's `response_format` as a grammar (and the field a bad schema is reported on)."""
    if fmt is None or fmt.type == "text":
        return None, None
    if fmt.type == "json_object":
        return GrammarSpec("json_object"), "response_format"
    if fmt.json_schema is not None and fmt.json_schema.description:
        param = "response_format.json_schema.description"
        raise bad_request(
            param,
            f"`{param}` is not shown to the model here (the schema is enforced, its "
            "description is not read): leave it out",
        )
    if fmt.json_schema is None:
        raise bad_request(
            "response_format.json_schema",
            "`response_format.json_schema` is required with type 'json_schema': "
            "{name, schema, strict}",
        )
    schema = fmt.json_schema.schema_
    if schema is None:
        return GrammarSpec("json_object"), "response_format.json_schema"
    param = "response_format.json_schema.schema"
    return schema_grammar(schema, param), param


def schema_grammar(schema: dict[str, Any], param: str) -> GrammarSpec:
    """A json_schema grammar; 400 naming `param` for a feature the engine cannot enforce."""
    unsupported = unsupported_schema_feature(schema)
    if unsupported:
        raise bad_request(
            param, f"`{param}` uses an unsupported JSON Schema feature: {unsupported}"
        )
    return grammar_field("json_schema", json.dumps(schema), param)


def grammar_field(kind: str, spec: str, param: str) -> GrammarSpec:
    try:
        return GrammarSpec(kind, spec)
    except ValueError as exc:
        raise bad_request(param, f"`{param}`: {exc}") from None


def native_grammar(
    json_schema: str | dict[str, Any] | None, regex: str | None, ebnf: str | None
) -> tuple[GrammarSpec | None, str | None]:
    """/generate's `json_schema`, `regex` or `ebnf` (at most one) as a grammar."""
    values = {"json_schema": json_schema, "regex": regex, "ebnf": ebnf}
    given = [name for name, value in values.items() if value]
    if len(given) > 1:
        raise bad_request(
            f"sampling_params.{given[1]}",
            f"give at most one of `json_schema`, `regex` and `ebnf`, got {given}",
        )
    if not given:
        return None, None
    name = given[0]
    param = f"sampling_params.{name}"
    value = values[name]
    if name == "json_schema":
        return json_schema_field(value, param), param
    assert isinstance(value, str)
    return grammar_field(name, value, param), param


def json_schema_field(value: str | dict[str, Any] | None, param: str) -> GrammarSpec:
    """A JSON Schema given as an object or as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(param, f"`{param}` is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad_request(param, f"`{param}` must be a JSON Schema object")
    return schema_grammar(value, param)


def choice_grammar(choices: list[str]) -> GrammarSpec:
    """vLLM's `guided_choice`: the output is exactly one of the strings."""
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return grammar_field("ebnf", f"root ::= {alternatives}", "guided_choice")
