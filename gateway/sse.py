"""Server-sent events of the streaming answers, encoded with orjson.

A streamed answer is many chunks that differ only in their `choices`: the header (`id`,
`object`, `created`, `model`, ...) is the same in every one. `ChunkFrames` encodes the header
once per response and splices each chunk's choice into it, so a token costs one small
`orjson.dumps` and two byte concatenations (orjson: UTF-8 bytes directly, no `str` round trip,
several times faster than the standard `json` module on these small objects).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
_END = b"]}\n\n"


def sse(obj: object) -> bytes:
    """One `data:` frame holding `obj` as compact JSON (non-ASCII kept as UTF-8)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


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
