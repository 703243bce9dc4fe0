"""JSON Schemas for structured-output checks: nested objects, arrays, enums, patterns, number
bounds and optional fields, each with a chat prompt that asks for it.

`tests/test_structured_output.py` and `scripts/serving/structured_check.py` send every one through a
gateway and validate the answers with `jsonschema`; the goal is 100% valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str
    prompt: str
    schema: dict[str, Any]


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _str(max_length: int = 24, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


SCHEMAS = [
    SchemaCase("person", "Describe a person.", _obj({"name": _str(), "age": {"type": "integer"}})),
    SchemaCase(
        "bounded_numbers",
        "Give a product rating.",
        _obj(
            {
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    SchemaCase(
        "enum_status",
        "What is the order status?",
        _obj({"status": {"enum": ["pending", "shipped", "delivered", "cancelled"]}}),
    ),
    SchemaCase(
        "tags_array",
        "Tag this article about cooking pasta.",
        _obj({"tags": {"type": "array", "items": _str(12), "minItems": 1, "maxItems": 4}}),
    ),
    SchemaCase(
        "nested_address",
        "Where does Alice live?",
        _obj(
            {
                "name": _str(),
                "address": _obj({"city": _str(), "zip": _str(5, pattern="^[0-9]{5}$")}),
            }
        ),
    ),
    SchemaCase(
        "optional_fields",
        "Describe a book.",
        _obj(
            {"title": _str(), "author": _str(), "year": {"type": "integer"}},
            required=["title"],
        ),
    ),
    SchemaCase("boolean_flag", "Is the sky blue?", _obj({"answer": {"type": "boolean"}})),
    SchemaCase(
        "pattern_date",
        "When is the meeting?",
        _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    ),
    SchemaCase(
        "array_of_objects",
        "List two planets and their moons count.",
        _obj(
            {
                "planets": {
                    "type": "array",
                    "items": _obj({"name": _str(12), "moons": {"type": "integer", "minimum": 0}}),
                    "minItems": 1,
                    "maxItems": 3,
                }
            }
        ),
    ),
    SchemaCase(
        "const_version",
        "Report the API version.",
        _obj({"version": {"const": "v1"}, "ok": {"type": "boolean"}}),
    ),
    SchemaCase(
        "any_of",
        "Give an id, either a number or a code.",
        _obj({"id": {"anyOf": [{"type": "integer"}, _str(8, pattern="^[A-Z]{3}[0-9]{2}$")]}}),
    ),
    SchemaCase(
        "nullable",
        "Who is the manager, if any?",
        _obj({"manager": {"anyOf": [_str(), {"type": "null"}]}}),
    ),
    SchemaCase(
        "number_array",
        "Give three temperatures.",
        _obj(
            {
                "temps": {
                    "type": "array",
                    "items": {"type": "number", "minimum": -50, "maximum": 50},
                    "minItems": 3,
                    "maxItems": 3,
                }
            }
        ),
    ),
    SchemaCase(
        "deep_nesting",
        "Describe a company.",
        _obj(
            {
                "company": _obj(
                    {"name": _str(), "ceo": _obj({"name": _str(), "age": {"type": "integer"}})}
                )
            }
        ),
    ),
    SchemaCase(
        "defs_ref",
        "Describe two points.",
        {
            "$defs": {"point": _obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
            **_obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}),
        },
    ),
    SchemaCase(
        "email_pattern",
        "Give a contact.",
        _obj({"email": _str(40, pattern="^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$")}),
    ),
    SchemaCase(
        "string_lengths",
        "Give a username.",
        _obj({"username": {"type": "string", "minLength": 3, "maxLength": 10}}),
    ),
    SchemaCase(
        "enum_array",
        "Which weekdays are you free?",
        _obj(
            {
                "days": {
                    "type": "array",
                    "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                    "maxItems": 5,
                }
            }
        ),
    ),
    SchemaCase(
        "exclusive_bounds",
        "Pick a probability.",
        _obj({"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
    ),
    SchemaCase(
        "mixed_record",
        "Describe an event.",
        _obj(
            {
                "title": _str(),
                "attendees": {"type": "integer", "minimum": 0, "maximum": 1000},
                "online": {"type": "boolean"},
                "level": {"enum": ["low", "medium", "high"]},
                "notes": _str(),
            },
            required=["title", "attendees", "online", "level"],
        ),
    ),
    SchemaCase(
        "top_level_array",
        "List three fruits.",
        {"type": "array", "items": _str(12), "minItems": 3, "maxItems": 3},
    ),
    SchemaCase(
        "integer_range_only",
        "How many legs does a spider have?",
        {"type": "integer", "minimum": 0, "maximum": 100},
    ),
]


def check(schema: dict[str, Any], text: str) -> str | None:
    """Why `text` is not a JSON document valid under `schema`, or None when it is."""
    import json

    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except ValueError as exc:
        return f"not JSON: {exc}"
    except jsonschema.ValidationError as exc:
        return f"invalid: {exc.message}"
    return None
