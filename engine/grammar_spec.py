"""What a request's output must match: a `GrammarSpec`, torch-free so the gateway builds it too.

Kinds (the node API's `Grammar.kind`, proto/node.proto):
- `json_object`: any JSON object (OpenAI's `response_format: {"type": "json_object"}`);
- `json_schema`: a JSON document valid under the JSON Schema in `spec` (JSON text);
- `regex`: text matching the regular expression in `spec` (whole-output match);
- `ebnf`: text derived from the EBNF grammar in `spec` (GBNF dialect, start rule `root`).

The engine compiles a spec into a token mask per step (engine/grammar.py); a spec is its cache
key, so two requests with the same schema text share one compiled grammar.
"""

from __future__ import annotations

from dataclasses import dataclass

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")
# A schema or grammar larger than this is refused before it reaches the compiler.
MAX_GRAMMAR_CHARS = 100_000


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(
                f"grammar kind must be one of {list(GRAMMAR_KINDS)}, got {self.kind!r}"
            )
        if self.kind == "json_object":
            if self.spec:
                raise ValueError("a json_object grammar takes no spec; use json_schema for one")
        elif not self.spec:
            raise ValueError(f"a {self.kind} grammar needs its {self.kind} text, got none")
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"{self.kind} is {len(self.spec)} characters long; at most {MAX_GRAMMAR_CHARS}"
            )


# JSON Schema keywords the compiler would ignore (so an output could break them): refused with
# their place in the schema, so a client learns at once instead of getting invalid documents.
UNSUPPORTED_SCHEMA_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "propertyNames",
    "multipleOf",
    "unevaluatedProperties",
    "unevaluatedItems",
)
# Keywords whose value is a map of names to subschemas (the names are not keywords).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_schema_feature(schema: object, path: str = "") -> str | None:
    """Where `schema` uses a feature this server cannot enforce, in words naming the keyword
    and its JSON pointer (`'uniqueItems' at /properties/tags`); None if there is none."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = unsupported_schema_feature(item, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in UNSUPPORTED_SCHEMA_KEYWORDS and not (key == "uniqueItems" and value is False):
            return f"{key!r} at {path or '/'}"
        if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
            return f"a remote $ref ({value!r}) at {path or '/'}: inline it or use #/$defs"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                found = unsupported_schema_feature(sub, f"{where}/{name}")
                if found:
                    return found
        elif key not in ("enum", "const", "default", "examples", "required"):
            found = unsupported_schema_feature(value, where)
            if found:
                return found
    return None
