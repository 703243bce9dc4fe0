"""The JSON files of this package: read with errors that name the file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class EPLBFileError(ValueError):
    """A distribution or placement file that cannot be used; the message names file and field."""


def read_json(path: Path, kind: str, format_name: str) -> dict[str, Any]:
    """The object in `path`, which must say it is a `format_name` file (a `kind`, e.g.
    'expert distribution', names it in errors)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EPLBFileError(f"{kind} {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EPLBFileError(f"{kind} {path} cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != format_name:
        found = raw.get("format") if isinstance(raw, dict) else None
        raise EPLBFileError(f"{kind} {path}: field 'format' is {found!r}, not {format_name!r}")
    return raw


def write_json(path: Path, raw: dict[str, Any]) -> None:
    """`raw` as indented JSON with each list of numbers on one line (a [L, E] table reads as
    one row per layer); written whole or not at all (a temporary file renamed over `path`)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(raw), encoding="utf-8")
    tmp.replace(path)


def dumps(raw: dict[str, Any]) -> str:
    """`raw` as `write_json` writes it."""
    return _render(raw, "") + "\n"


def field(raw: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """`raw[key]`, which must be a `kind` (never a bool: JSON's true is no number)."""
    value = raw.get(key)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in kinds)
        raise EPLBFileError(f"field {key!r} must be a {names}, got {value!r}")
    return value


def int_list(value: Any, what: str) -> tuple[int, ...]:
    """`value` (`what`, named in the error) as a tuple of ints."""
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise EPLBFileError(f"{what} must be a list of integers, got {value!r}")
    return tuple(value)


def _render(value: Any, indent: str) -> str:
    inner = indent + " "
    if isinstance(value, dict):
        items = (f"{inner}{json.dumps(k)}: {_render(v, inner)}" for k, v in value.items())
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, list | dict) for v in value):
        return "[\n" + ",\n".join(inner + _render(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value)
