"""Request bodies from bytes to JSON objects, safe against hostile clients (issue 25).

Client bytes must never reach code that can fail with a 5xx:
- depth: the stdlib parser recurses once per nesting level; a body nested 100,000 levels deep
  exhausts the interpreter's recursion limit. The parser's RecursionError and any depth beyond
  `MAX_JSON_DEPTH` answer 400 naming the limit. Fields nest 4 levels at most, except the JSON
  Schemas of `response_format`, `tools` and /generate's `json_schema`, which the limit bounds.
- text the tokenizer cannot encode: JSON's `\\ud800` escapes decode to lone surrogates, which are
  no Unicode text (the tokenizer raises TypeError, UTF-8 encoding raises). Such a string, or a
  key, answers 400 naming the field (`messages[0].content`). Bytes that are no UTF-8 answer 400
  before parsing.

Cost: orjson parses first (several times faster than the stdlib on a 4 MB prompt, and strict:
it rejects invalid UTF-8, lone surrogates, NaN and integers beyond 64 bits, and stops at 1,024
levels). Only a body orjson refuses goes through the stdlib parser, which accepts what JSON
allows and orjson does not, and whose result is checked for text as above, or answers the
precise error. The depth of a body whose objects and arrays hold at most `WALK_ITEMS` items
is measured by walking them (a 4 MB prompt is one item); a body with more is first counted at
C speed (its brackets), and walked only when the count allows too deep a body, so neither a
long prompt nor a long list costs a Python loop over its contents.

Count: a body holding more JSON objects and arrays than `max_containers` answers 400 before it
is parsed at all. orjson builds every one of them as a Python object while holding the GIL: a
4 MB body of a million one-id prompts (`[[1],[1],...]`) took 0.6 s of the GIL and 88 MB of
small objects, whose arenas stayed pinned by a few survivors after the request (+30-39% RSS
after a burst). The same bracket count that bounds the depth decides it at C speed; only a
body over the limit has its strings blanked out (a regular expression) to count the brackets
that are structure, not text. The limit (`container_limit`) leaves room for every request that
fits the context: a chat message costs at least one token and holds a few containers, a batch
of prompts is bounded by --max-n far below it, and tools' schemas are rendered into the prompt.

Where: a body of `LARGE_BODY_BYTES` or more is parsed in a parse process (gateway/
parse_process.py: a few children started with the app), not in the gateway's process. Parsing
a 3.9 MB body holds the GIL for 5-7 ms (the bracket counts, then orjson in one C call); in a
thread of the gateway, eight of them back to back starved the event loop of the GIL between
its I/O waits (a one-token request x1.7-x2.4 its idle latency beside eight 3.9 MB prompts on a
32-core host, where the same burst sent to a bare sink left it at x1.0). The parse process
also applies the route's cheap prompt bound (`PromptBounds`, gateway/requests/tokenize.py): a body
the bound refuses comes back as a small error record (`ErrorRecord`: no exception objects cross
between processes), answered where the handler would have raised it (after the draining and
admission checks); a body that passes comes back as its parsed object, which the bound keeps
small (the context's worth of text or token ids).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import APIError, bad_request
from gateway.requests.memory import malloc_trim

if TYPE_CHECKING:  # a parse process imports these as it unpickles its first job
    from gateway.requests.tokenize import BodyRoute, PromptBounds

MAX_JSON_DEPTH = 32  # nesting levels of objects and arrays
LARGE_BODY_BYTES = 64 << 10  # parsed in a parse process; memory handed back after (app.py)
WALK_ITEMS = 4096  # a body whose objects and arrays hold fewer is measured by walking it
MIN_CONTAINERS = 1 << 16  # objects and arrays a body may hold, whatever the context
CONTAINERS_PER_TOKEN = 4  # a message (an object, its content array and parts) per token
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"\s*:?')  # a string, or a key and its colon
# A plain nest in a body's structure: more than MAX_JSON_DEPTH openers in a row, `{` read as `[`
# (a translation and a substring search, C speed; a regular expression took 47 ms on 4 MB,
# holding the GIL in one call the event loop could not preempt).
_OPENERS_AS_ONE = bytes.maketrans(b"{", b"[")
_NEST = b"[" * (MAX_JSON_DEPTH + 1)


def container_limit(context_length: int) -> int:
    """The JSON objects and arrays a body may hold for a model of this context (see above)."""
    return max(MIN_CONTAINERS, CONTAINERS_PER_TOKEN * context_length)


def _too_many_error(limit: int) -> Exception:
    return bad_request(
        None,
        f"the request body holds more than {limit} JSON objects and arrays, more than any "
        "request that fits the model's context needs (a batch of prompts is bounded by --max-n, "
        "a chat's messages by the context length): send fewer prompts or messages",
        code="body_too_many_items",
    )


def _too_deep_error() -> Exception:
    return bad_request(
        None,
        f"the request body nests JSON objects and arrays deeper than {MAX_JSON_DEPTH} levels: "
        "no request field needs more than 4",
        code="body_too_deep",
    )


def parse_body(data: bytes, max_containers: int = MIN_CONTAINERS) -> dict[str, Any]:
    """The JSON object of a request body; APIError(400) for anything else."""
    brackets = data.count(b"[") + data.count(b"{")  # an upper bound of its containers
    if brackets > max_containers:
        _count_containers(data, max_containers)
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        body = _parse_leniently(data)
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object")
    if _too_deep(brackets, body):
        raise _too_deep_error()
    return body


def _count_containers(data: bytes, limit: int) -> None:
    """400 if the JSON text holds more than `limit` objects and arrays (brackets outside
    strings); a plain nest of them (`[[[...`, `{"a":{"a":...`) is answered as too deep."""
    structure = _JSON_STRING.sub(b"", data).translate(None, b" \t\r\n")
    if structure.count(b"[") + structure.count(b"{") <= limit:
        return
    if _NEST in structure.translate(_OPENERS_AS_ONE):
        raise _too_deep_error()
    raise _too_many_error(limit)


def _parse_leniently(data: bytes) -> Any:
    """The stdlib's parse of what orjson refused: a precise 400, or a value to check."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            None, f"the request body is not valid UTF-8 (byte {exc.start}): send UTF-8 JSON"
        ) from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise _too_deep_error() from None
    except ValueError as exc:
        raise bad_request(None, f"the request body is not valid JSON: {exc}") from None
    if isinstance(body, dict) and _SURROGATE_ESCAPE.search(data):
        _check_text(body)
    return body


def _too_deep(brackets: int, body: dict[str, Any]) -> bool:
    depth = _depth(body, WALK_ITEMS)
    if depth is not None:  # a walk over a few items decided it
        return depth > MAX_JSON_DEPTH
    # Long lists: the C-speed count of brackets first, the whole walk only if it allows too deep
    if brackets <= MAX_JSON_DEPTH:
        return False
    return (_depth(body) or 0) > MAX_JSON_DEPTH


def _depth(value: Any, max_items: int | None = None) -> int | None:
    """Nesting depth of objects and arrays, without recursion; stops past the limit. None when
    the containers hold more than `max_items` items in all."""
    deepest = 0
    items = 0
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            break
        items += len(item)
        if max_items is not None and items > max_items:
            return None
        children = item.values() if isinstance(item, dict) else item
        todo.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _check_text(body: dict[str, Any]) -> None:
    """400 naming the first string (value or key) that is not encodable Unicode."""
    todo: list[tuple[Any, str]] = [(body, "")]
    while todo:
        item, path = todo.pop()
        if isinstance(item, str):
            if not _encodable(item):
                raise _bad_text(path or "body")
        elif isinstance(item, dict):
            for key, child in item.items():
                name = f"{path}.{key}" if path else str(key)
                if not _encodable(key):
                    raise _bad_text(path or "body")
                todo.append((child, name))
        elif isinstance(item, list):
            todo.extend((child, f"{path}[{i}]") for i, child in enumerate(item))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_text(field: str) -> Exception:
    shown = field.encode("utf-8", "backslashreplace").decode("ascii", "replace")
    return bad_request(
        shown,
        f"`{shown}` holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is "
        "no Unicode text: send valid text, or a surrogate pair for characters beyond U+FFFF",
        code="invalid_text",
    )


@dataclass(frozen=True)
class ErrorRecord:
    """An APIError as plain fields, to cross from a parse process."""

    status: int
    message: str
    type: str
    param: str | None
    code: str | None

    @classmethod
    def of(cls, exc: APIError) -> ErrorRecord:
        return cls(exc.status, exc.message, exc.type, exc.param, exc.code)

    def error(self) -> APIError:
        return APIError(
            self.status, self.message, type_=self.type, param=self.param, code=self.code
        )


@dataclass(frozen=True)
class ParseJob:
    """What a parse process is asked about one body (its bytes follow the job)."""

    body_bytes: int
    max_containers: int
    route: BodyRoute | None  # whose cheap bound the parsed body gets, if any
    bounds: PromptBounds | None


@dataclass(frozen=True)
class ParseAnswer:
    """A parse process's answer: the parsed body, or a small error record instead of it."""

    body: dict[str, Any] | None = None
    invalid: ErrorRecord | None = None  # not a JSON object the gateway can take: raised at once
    refusal: ErrorRecord | None = None  # refused by the route's bound

    def parsed(self) -> ParsedBody:
        if self.invalid is not None:
            raise self.invalid.error()
        if self.refusal is not None:
            return ParsedBody({}, self.refusal.error())
        assert self.body is not None
        return ParsedBody(self.body)


@dataclass(frozen=True)
class ParsedBody:
    """A request body as parsed, or the refusal its route's bound answered instead of it."""

    body: dict[str, Any]
    refusal: APIError | None = None  # raised where the handler would have raised it


def answer_job(job: ParseJob, data: bytes) -> ParseAnswer:
    """In a parse process: `parse_body`, then the route's bound; only a small record comes
    back for a body that either refuses (and the memory its parse took is handed back)."""
    try:
        body = parse_body(data, job.max_containers)
    except APIError as exc:
        answer = ParseAnswer(invalid=ErrorRecord.of(exc))
    else:
        answer = ParseAnswer(body=body)
        if job.route is not None and job.bounds is not None:
            try:
                job.bounds.bound_body(job.route, body)
            except APIError as exc:
                answer = ParseAnswer(refusal=ErrorRecord.of(exc))
        del body
    if answer.body is None:
        malloc_trim()
    return answer
