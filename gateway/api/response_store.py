"""The responses `POST /v1/responses` keeps for `previous_response_id`: bounded, in memory.

A kept response is the conversation it ended: the conversation it continued, its own input
items and its answer, as chat messages (instructions are not kept: OpenAI does not carry them
over). A chained request renders that conversation, then its own input.

Bounds: at most `size` responses (the oldest evicted first) and each for `ttl_s` seconds after it
was made. Every response has the same lifetime, so insertion order is expiry order: the expired
ones are always at the front, dropped when a response is added (and one found expired on lookup
goes at once). One response's conversation fit in its prompt plus its answer, so it holds at most
the context length in tokens; a chain shares its earlier turns' messages (immutable, referenced
by every later turn's tuple), so each response adds only its own items and a tuple of references.

The store lives in one gateway process: with `--workers N > 1` no worker keeps responses (see
gateway/api/responses_api.py, `store_refusal`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from gateway.requests.protocol import ChatMessage

Conversation = tuple[ChatMessage, ...]


class ResponseStore:
    def __init__(
        self, size: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if size < 1 or not ttl_s > 0:
            raise ValueError(f"a response store needs size >= 1 and ttl > 0, got {size}, {ttl_s}")
        self.size = size
        self.ttl_s = ttl_s
        self._clock = clock
        self._kept: OrderedDict[str, tuple[float, Conversation]] = OrderedDict()  # id -> expiry

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response_id: str, conversation: Conversation) -> None:
        now = self._clock()
        self._drop_expired(now)
        self._kept.pop(response_id, None)  # (ids are new) so that order stays expiry order
        self._kept[response_id] = (now + self.ttl_s, conversation)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def get(self, response_id: str) -> Conversation | None:
        """The kept conversation; None when it was never kept, evicted or expired."""
        kept = self._kept.get(response_id)
        if kept is None:
            return None
        expires, conversation = kept
        if self._clock() >= expires:
            del self._kept[response_id]
            return None
        return conversation

    def _drop_expired(self, now: float) -> None:
        while self._kept:
            expires, _ = next(iter(self._kept.values()))
            if now < expires:
                return
            self._kept.popitem(last=False)
