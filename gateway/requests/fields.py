"""Request fields as pydantic constraints, and pydantic's errors as OpenAI 400s.

- `number(spec)`: the pydantic `Field` of a row of `engine/sampling_fields.py` (range,
  default, and a description in the table's words, which the schema and the errors both use);
- `ONE_OF`: a union field answers one error, in the words of its description, instead of one
  per alternative;
- `validation_error`: pydantic's first error as an `APIError` naming the field as clients write
  it (`messages[0].role`) and what it must be: `` `top_p` must be a finite number in (0, 1],
  got 0 ``. A field's `description` says what a valid value is, so the published schema and the
  error message say the same thing.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from engine.sampling_fields import NumberField, number_text
from gateway.errors import APIError, bad_request

# What a value must be, by pydantic error type, for errors on fields without a description
# (list items, nested objects). `{name}` is filled from the error's context.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a finite number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "greater_than_equal": ">= {ge}",
    "greater_than": "> {gt}",
    "less_than_equal": "<= {le}",
    "less_than": "< {lt}",
    "literal_error": "one of {expected}",
    "string_too_short": "at least {min_length} characters long",
    "too_short": "a list of at least {min_length} items",
    "too_long": "a list of at most {max_length} items",
}
_SHOWN_CHARS = 60  # of the offending value, quoted in the message


class RequestModel(BaseModel):
    """The base of every request body model: strict JSON types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


def number(spec: NumberField[Any], *, default: Any = ...) -> Any:
    """The field declared by `spec`; null and absent both mean its default."""
    bounds: dict[str, Any] = {}
    if spec.minimum is not None:
        bounds["gt" if spec.exclusive_minimum else "ge"] = spec.minimum
    if spec.maximum is not None:
        bounds["le"] = spec.maximum
    if spec.kind is float:
        bounds["allow_inf_nan"] = False
    return Field(
        default=spec.default if default is ... else default,
        description=f"{spec.type_text} {spec.rule}",
        **bounds,
    )


def _collapse(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("one_of", "matches none of the field's forms") from None


# Annotated metadata for a union field: one error, worded by the field's `description`, instead
# of one per alternative with pydantic's names for them in its location.
ONE_OF = WrapValidator(_collapse)


def validation_error(exc: ValidationError, model: type[BaseModel]) -> APIError:
    """A 400 for the first error: the field's path as `param`, what it must be as the text."""
    error = exc.errors(include_url=False)[0]
    loc = error["loc"]
    param = _path(loc)
    info = _field_at(model, loc)
    # A field's description is about the field itself, not about one item of its list.
    description = info.description if info and loc and isinstance(loc[-1], str) else None
    if error["type"] == "extra_forbidden":
        return bad_request(param, f"`{param}` is not a field of this request: leave it out")
    if error["type"] == "missing":
        hint = f": {description}" if description else ""
        return bad_request(param, f"`{param}` is required{hint}")
    if description:
        expected = description
    elif error["type"] in _EXPECTED:
        context = {k: _text(v) for k, v in (error.get("ctx") or {}).items()}
        expected = _EXPECTED[error["type"]].format(**context)
    else:  # a rule without words here: pydantic's own sentence
        return bad_request(param, f"`{param}`: {error['msg']}")
    return bad_request(param, f"`{param}` must be {expected}, got {_shown(error['input'])}")


def _path(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def _field_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> FieldInfo | None:
    """The declaration of the field an error's location ends in (list indices skipped)."""
    info: FieldInfo | None = None
    current: type[BaseModel] | None = model
    for part in loc:
        if isinstance(part, int):
            continue
        if current is None or part not in current.model_fields:
            return None
        info = current.model_fields[part]
        current = _model_in(info.annotation)
    return info


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model inside `X`, `X | None`, `list[X]` or `Annotated[...]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (list, typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def _text(value: Any) -> str:
    return number_text(value) if isinstance(value, (int, float)) else str(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."
