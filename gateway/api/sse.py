"""Server-sent events of the streaming answers, encoded with orjson.

A streamed answer is many chunks that differ only in their `choices`: the header (`id`,
`object`, `created`, `model`, ...) is the same in every one. `ChunkFrames` encodes the header
once per response and splices each chunk's choice into it, so a token costs one small
`orjson.dumps` and two byte concatenations (orjson: UTF-8 bytes directly, no `str` round trip,
several times faster than the standard `json` module on these small objects). Most chunks carry
nothing but text: `TextFrames` encodes the bytes around the text once per choice (from a frame
that `ChunkFrames` encoded, so the bytes are the same) and a token costs one `orjson.dumps` of
its text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
_END = b"]}\n\n"


def sse(obj: object) -> bytes:
    """One `data:` frame holding `obj` as compact JSON (non-ASCII kept as UTF-8)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_event(kind: str, obj: object) -> bytes:
    """A named event: its `event:` line, then `data:` holding `obj` (the Responses API's)."""
    return b"event: " + kind.encode() + b"\n" + sse(obj)


@dataclass(frozen=True)
class ChunkFrames:
    """`data: {<header>, "choices": [<choice>]}` frames of one response, header encoded once."""

    prefix: bytes  # b'data: {"id":...,"model":"...","choices":['

    @classmethod
    def for_header(cls, header: dict[str, Any]) -> ChunkFrames:
        if not header or "choices" in header:
            raise ValueError("a chunk header must be a non-empty object without `choices`")
        encoded = orjson.dumps(header)  # b'{...}': reopen it after the last field
        return cls(b"data: " + encoded[:-1] + b',"choices":[')

    def choice(self, choice: dict[str, Any]) -> bytes:
        """The frame of a chunk that carries this one choice."""
        return self.prefix + orjson.dumps(choice) + _END


_MARKER = "\x00pdserve text\x00"  # encodes as a string no header or choice field holds


@dataclass
class TextFrames:
    """`ChunkFrames` frames of text-only choices: `choice(index, text)` is the choice object,
    the bytes before and after its text are encoded once per index."""

    frames: ChunkFrames
    choice: Callable[[int, str], dict[str, Any]]
    _parts: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)

    def frame(self, index: int, text: str) -> bytes:
        parts = self._parts.get(index)
        if parts is None:
            encoded = self.frames.choice(self.choice(index, _MARKER))
            before, marker, after = encoded.partition(orjson.dumps(_MARKER))
            if not marker:
                raise ValueError("the choice must hold its text as a value")
            parts = self._parts[index] = (before, after)
        return parts[0] + orjson.dumps(text) + parts[1]

    def event_frame(self, event: Any) -> bytes | None:
        """The frame of a text-only event (a `ChoiceEvent` without logprobs or end); None when
        it has no text (gateway/dispatch/lane.py's `frame` stage)."""
        return self.frame(event.index, event.text) if event.text else None
