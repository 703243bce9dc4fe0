"""Prompts to token ids without stalling the gateway (issue 25).

Tokenizing a 4 MB prompt takes seconds of CPU and a gigabyte of transient memory; on the event
loop it would delay every other client's stream. Two defences:

1. A cheap bound first. No token covers more characters than the longest vocabulary entry
   (`TextCodec.max_token_chars`), so a text of C characters has at least ceil(C / that) tokens:
   when that alone exceeds the context, the prompt is rejected at once with the usual
   context-length error, without tokenizing. Token-id lists are counted before they are
   checked against the vocabulary.
2. The tokenizing itself runs in a bounded thread pool (`--tokenizer-workers`) off the event
   loop (the Rust tokenizer releases the GIL while it works); prompts of at most
   `INLINE_CHARS` characters are tokenized in place, so a one-token request never queues
   behind someone else's long prompt. After a long prompt the worker hands the allocator's
   freed memory back to the system (glibc `malloc_trim`): the tokenizer's transient gigabyte
   would otherwise stay in the process's arenas for good.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gateway.errors import APIError, bad_request
from gateway.protocol import ChatMessage, Prompt
from gateway.text import TextCodec
from gateway.tools import ToolSpec

INLINE_CHARS = 2048  # tokenized on the event loop: well under a millisecond
TRIM_CHARS = 1 << 16  # after tokenizing this much, return freed memory to the system
T = TypeVar("T")


def _malloc_trim() -> Callable[[], object]:
    """glibc's `malloc_trim(0)`, or a no-op elsewhere (musl, macOS)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        return lambda: None
    return lambda: trim(0)


_TRIM = _malloc_trim()


def prompt_too_long(param: str, tokens: int, context_length: int, bound: str = "") -> APIError:
    """The context-length error; `bound` explains a lower bound (`at least`) of `tokens`."""
    count = f"at least {tokens} tokens ({bound})" if bound else f"{tokens} tokens"
    return bad_request(
        param,
        f"the prompt has {count} but the context length is {context_length}: shorten it to "
        f"at most {context_length - 1} tokens",
        code="context_length_exceeded",
    )


class PromptEncoder:
    """Bounds, then tokenizes, the prompts of requests for one served model."""

    def __init__(self, codec: TextCodec, context_length: int, workers: int) -> None:
        self.codec = codec
        self.context_length = context_length
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")

    def trim_soon(self) -> None:
        """Return freed memory to the system once the pool is free (after a large body)."""
        self._pool.submit(_TRIM)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def prompt(self, prompt: Prompt, param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            self._bound_chars(len(prompt), param)
        elif len(prompt) >= self.context_length:
            raise prompt_too_long(param, len(prompt), self.context_length)
        return await self._run(len(prompt), lambda: self.codec.encode_prompt(prompt, param))

    async def chat(
        self, messages: Sequence[ChatMessage], tools: ToolSpec | None = None
    ) -> list[int]:
        chars = sum(len(m.content) for m in messages)
        self._bound_chars(chars, "messages")
        return await self._run(chars, lambda: self.codec.chat_prompt(messages, tools))

    def _bound_chars(self, chars: int, param: str) -> None:
        per_token = self.codec.max_token_chars
        if per_token is None:
            return
        at_least = -(-chars // per_token)
        if at_least >= self.context_length:
            bound = f"{chars} characters, at most {per_token} per token"
            raise prompt_too_long(param, at_least, self.context_length, bound)

    async def _run(self, size: int, work: Callable[[], T]) -> T:
        if size <= INLINE_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, _trimmed, size, work)


def _trimmed(size: int, work: Callable[[], T]) -> T:
    try:
        return work()
    finally:
        if size >= TRIM_CHARS:
            _TRIM()
