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

Where: a body of `LARGE_BODY_BYTES` or more is parsed in one worker thread (`BodyParser`), not
on the event loop. A 4 MB body costs 5-10 ms of parsing; eight at once, on the loop, would
hold every other client's requests and streams for all of that. In the thread, orjson still
holds the GIL while it runs, but the loop gets it back between the steps of the parse, and
large bodies queue for that one thread instead of competing with each other.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from gateway.errors import bad_request

MAX_JSON_DEPTH = 32  # nesting levels of objects and arrays
LARGE_BODY_BYTES = 64 << 10  # parsed off the event loop; memory handed back after (app.py)
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


class BodyParser:
    """`parse_body` on the event loop for small bodies, in one worker thread for large ones."""

    def __init__(self, max_containers: int = MIN_CONTAINERS) -> None:
        self.max_containers = max_containers
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="parse-body")

    async def parse(self, data: bytes) -> dict[str, Any]:
        if len(data) < LARGE_BODY_BYTES:
            return parse_body(data, self.max_containers)
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, parse_body, data, self.max_containers
        )

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
