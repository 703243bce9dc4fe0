"""Reading a JSON request body field by field, with 400s that name the field and the rule.

`BodyReader` wraps the decoded JSON object. Each accessor checks one field's type and range and
returns a plain Python value (None when the field is absent or null), so the request parsers
in protocol.py read as a list of fields with their limits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gateway.errors import bad_request

INT32_MAX = (1 << 31) - 1  # the node API's int32 fields (token ids, top_k)
INT64_MAX = (1 << 63) - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class BodyReader:
    def __init__(self, body: Mapping[str, Any]) -> None:
        self.body = body

    def raw(self, name: str) -> Any:
        return self.body.get(name)

    def integer(
        self, name: str, *, minimum: int | None = None, maximum: int | None = None
    ) -> int | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not _is_int(value):
            raise bad_request(name, f"`{name}` must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise bad_request(name, f"`{name}` must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise bad_request(name, f"`{name}` must be <= {maximum}, got {value}")
        return int(value)

    def number(
        self,
        name: str,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        exclusive_minimum: bool = False,
    ) -> float | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            raise bad_request(name, f"`{name}` must be a finite number, got {value!r}")
        low_ok = minimum is None or (value > minimum if exclusive_minimum else value >= minimum)
        if not low_ok:
            rule = ">" if exclusive_minimum else ">="
            raise bad_request(name, f"`{name}` must be {rule} {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise bad_request(name, f"`{name}` must be <= {maximum}, got {value}")
        return float(value)

    def boolean(self, name: str) -> bool | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, bool):
            raise bad_request(name, f"`{name}` must be true or false, got {value!r}")
        return value

    def string(self, name: str) -> str | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise bad_request(name, f"`{name}` must be a string, got {type(value).__name__}")
        return value

    def mapping(self, name: str) -> Mapping[str, Any] | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise bad_request(name, f"`{name}` must be an object, got {type(value).__name__}")
        return value

    def int_list(
        self, name: str, *, max_items: int, minimum: int = 0, maximum: int = INT32_MAX
    ) -> tuple[int, ...]:
        value = self.body.get(name)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise bad_request(name, f"`{name}` must be a list of integers")
        if len(value) > max_items:
            raise bad_request(name, f"`{name}` has {len(value)} items; at most {max_items}")
        bad = [v for v in value if not minimum <= v <= maximum]
        if bad:
            raise bad_request(
                name, f"`{name}` items must be in [{minimum}, {maximum}], got {bad[0]}"
            )
        return tuple(value)

    def stop_strings(self, name: str, *, max_items: int, max_chars: int) -> tuple[str, ...]:
        """`stop`: a string or a list of strings (OpenAI allows up to 4)."""
        value = self.body.get(name)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise bad_request(name, f"`{name}` must be a string or a list of strings")
        if len(items) > max_items:
            raise bad_request(name, f"`{name}` has {len(items)} strings; at most {max_items}")
        for s in items:
            if not s:
                raise bad_request(name, f"`{name}` must not contain an empty string")
            if len(s) > max_chars:
                raise bad_request(
                    name, f"a `{name}` string has {len(s)} characters; at most {max_chars}"
                )
        return tuple(items)
