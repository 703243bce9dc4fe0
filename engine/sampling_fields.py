"""The sampling fields' types, ranges and defaults, declared once; torch-free, dependency-free.

Two readers: `engine/sampling.py` validates every `SamplingParams` against this table, and the
gateway's request models (`gateway/requests/protocol.py`) take their field constraints, defaults and
range descriptions from it, so the HTTP API, its OpenAPI schema (`GET /openapi.json`) and the
engine accept exactly the same values and word a bad one the same way:
`temperature must be in [0, 2], got 3`.

Ranges include the node API's wire types (proto/node.proto: `top_k` and token ids are int32,
`seed` is int64), so a value the gateway accepts always fits the message it sends. Limits that
come from a deployment's flags (choices per request, stop strings, context length, vocabulary)
are not here: the gateway checks them at run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

INT32_MAX = (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_TOP_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64

T = TypeVar("T")


def number_text(value: float) -> str:
    """`2` rather than `2.0`, so that a rule reads as it was declared."""
    return str(int(value)) if float(value).is_integer() else repr(value)


@dataclass(frozen=True)
class NumberField(Generic[T]):
    """One numeric field: its type (int or finite float), default and range."""

    name: str
    kind: type  # int or float; a float field also takes an int, never a bool
    default: T
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    note: str = ""  # what special values mean, appended to the rule

    @property
    def type_text(self) -> str:
        return "an integer" if self.kind is int else "a finite number"

    @property
    def rule(self) -> str:
        """The range in words: `in (0, 1]`, `>= 1`, `> 0`."""
        low, high = self.minimum, self.maximum
        if low is not None and high is not None:
            bracket = "(" if self.exclusive_minimum else "["
            text = f"in {bracket}{number_text(low)}, {number_text(high)}]"
        elif low is not None:
            text = f"{'>' if self.exclusive_minimum else '>='} {number_text(low)}"
        elif high is not None:
            text = f"<= {number_text(high)}"
        else:
            text = "any value"
        return f"{text} ({self.note})" if self.note else text

    def problem(self, value: object) -> str | None:
        """Why `value` is not valid here (completed by the caller with the field's name), or
        None when it is."""
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if self.kind is int and not is_int:
            return f"must be {self.type_text}, got {value!r}"
        if not is_int and not (isinstance(value, float) and math.isfinite(value)):
            return f"must be {self.type_text}, got {value!r}"
        assert isinstance(value, (int, float))
        low, high = self.minimum, self.maximum
        too_low = low is not None and (value <= low if self.exclusive_minimum else value < low)
        if too_low or (high is not None and value > high):
            return f"must be {self.rule}, got {value!r}"
        return None

    def check(self, value: object) -> None:
        """Raise ValueError naming the field, its rule and the value."""
        problem = self.problem(value)
        if problem is not None:
            raise ValueError(f"{self.name} {problem}")


MAX_NEW_TOKENS = NumberField[int]("max_new_tokens", int, 128, minimum=1)
TEMPERATURE = NumberField[float]("temperature", float, 1.0, minimum=0, maximum=2)
TOP_P = NumberField[float]("top_p", float, 1.0, minimum=0, maximum=1, exclusive_minimum=True)
TOP_K = NumberField[int]("top_k", int, -1, minimum=-1, maximum=INT32_MAX, note="-1 or 0: disabled")
MIN_P = NumberField[float]("min_p", float, 0.0, minimum=0, maximum=1)
REPETITION_PENALTY = NumberField[float](
    "repetition_penalty", float, 1.0, minimum=0, exclusive_minimum=True
)
FREQUENCY_PENALTY = NumberField[float]("frequency_penalty", float, 0.0, minimum=-2, maximum=2)
PRESENCE_PENALTY = NumberField[float]("presence_penalty", float, 0.0, minimum=-2, maximum=2)
SEED = NumberField[int | None]("seed", int, None, minimum=INT64_MIN, maximum=INT64_MAX)
TOP_LOGPROBS = NumberField[int]("top_logprobs", int, 0, minimum=0, maximum=MAX_TOP_LOGPROBS)
# Top alternatives of each prompt token (None: no prompt logprobs).
PROMPT_LOGPROBS = NumberField[int]("prompt_logprobs", int, 0, minimum=0, maximum=MAX_TOP_LOGPROBS)
# One item of `stop_token_ids` (at most MAX_STOP_TOKEN_IDS of them).
STOP_TOKEN_ID = NumberField[int]("stop_token_ids", int, 0, minimum=0, maximum=INT32_MAX)
# EOS and stop tokens masked, and stop strings not matched, until this many output tokens.
MIN_TOKENS = NumberField[int]("min_tokens", int, 0, minimum=0, maximum=INT32_MAX)
# One value of `logit_bias` (token id -> bias, at most MAX_LOGIT_BIAS entries), OpenAI's range.
LOGIT_BIAS = NumberField[float]("logit_bias", float, 0.0, minimum=-100, maximum=100)
MAX_LOGIT_BIAS = 1024

NUMBER_FIELDS: tuple[NumberField[int] | NumberField[float] | NumberField[int | None], ...] = (
    MAX_NEW_TOKENS,
    TEMPERATURE,
    TOP_P,
    TOP_K,
    MIN_P,
    REPETITION_PENALTY,
    FREQUENCY_PENALTY,
    PRESENCE_PENALTY,
    SEED,
    TOP_LOGPROBS,
    MIN_TOKENS,
)
