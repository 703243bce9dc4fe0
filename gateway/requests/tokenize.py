"""Prompts to token ids without stalling the gateway (issue 25).

Tokenizing a 4 MB prompt takes seconds of CPU and a gigabyte of transient memory; on the event
loop it would delay every other client's stream. Two defences:

1. A cheap bound first. No token covers more characters than the longest vocabulary entry
   (`TextCodec.max_token_chars`), so a text of C characters has at least ceil(C / that) tokens:
   when that alone exceeds the context, the prompt is rejected at once with the usual
   context-length error, without tokenizing. Token-id lists are counted before they are
   checked against the vocabulary, and before validation (`bound_unvalidated`): validating a
   4 MB body's million token ids, prompts or messages item by item would take the event loop
   seconds. A chat message costs at least one token (every chat template marks its role), and
   a batch of prompts counts against --max-n.
2. The tokenizing itself runs in a bounded thread pool (`--tokenizer-workers`) off the event
   loop (the Rust tokenizer releases the GIL while it works); prompts of at most
   `INLINE_CHARS` characters (and chats of at most `INLINE_MESSAGES` messages: rendering the
   template is Python) are tokenized in place, so a one-token request never queues behind
   someone else's long prompt. The memory a long prompt took is handed back after the
   request (gateway/requests/memory.py).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.errors import APIError, bad_request
from gateway.requests.protocol import ChatMessage, Prompt, too_many_prompts
from gateway.requests.text import TextCodec
from gateway.requests.tools import ToolSpec

INLINE_CHARS = 2048  # tokenized on the event loop: well under a millisecond
INLINE_MESSAGES = 16
T = TypeVar("T")


def prompt_too_long(param: str, tokens: int, context_length: int, bound: str = "") -> APIError:
    """The context-length error; `bound` explains a lower bound (`at least`) of `tokens`."""
    count = f"at least {tokens} tokens ({bound})" if bound else f"{tokens} tokens"
    return bad_request(
        param,
        f"the prompt has {count} but the context length is {context_length}: shorten it to "
        f"at most {context_length - 1} tokens",
        code="context_length_exceeded",
    )


class BodyRoute(enum.Enum):
    """The API whose request a body is: which cheap bound its parsed body gets."""

    COMPLETION = "completion"
    CHAT = "chat"
    NATIVE = "native"
    RESPONSES = "responses"


@dataclass(frozen=True)
class PromptBounds:
    """The cheap bounds (1. above) for one served model: lengths only, no tokenizer. Picklable,
    so that a parse process applies a route's bound to a large body before sending its parsed
    object back (gateway/requests/body.py); each handler applies the same bound first thing."""

    context_length: int
    max_token_chars: int | None  # TextCodec.max_token_chars: None, no character bound
    max_prompts: int = 1 << 30  # a batch's prompts x n (--max-n)

    def bound_body(self, route: BodyRoute, body: dict[str, Any]) -> None:
        """The bound its route's handler applies first thing to a parsed body."""
        {
            BodyRoute.COMPLETION: self.completion_body,
            BodyRoute.CHAT: self.chat_body,
            BodyRoute.NATIVE: self.native_body,
            BodyRoute.RESPONSES: self.responses_body,
        }[route](body)

    def completion_body(self, body: dict[str, Any]) -> None:
        """/v1/completions' bound on its parsed body, before validation."""
        self.bound_prompts(body.get("prompt"), body.get("n"))

    def chat_body(self, body: dict[str, Any]) -> None:
        """/v1/chat/completions' bound on its parsed body, before validation."""
        self.bound_messages(body.get("messages"))

    def native_body(self, body: dict[str, Any]) -> None:
        """/generate's bound on its parsed body, before validation."""
        self.bound_unvalidated(body.get("input_ids"), "input_ids")

    def responses_body(self, body: dict[str, Any]) -> None:
        """/v1/responses' bound on its parsed body, before validation: `input` is a text or a
        list of items, each at least one token."""
        items = body.get("input")
        if isinstance(items, list):
            self.bound_messages(items, "input")
        else:
            self.bound_unvalidated(items, "input")

    def bound_prompts(self, prompt: Any, n: Any) -> None:
        """The cheap bound on a completion's `prompt` as parsed, before its validation (see
        the module docstring): len() of its lists only, no walk over their items."""
        if not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)):
            self.bound_unvalidated(prompt, "prompt")
            return
        if len(prompt) > self.max_prompts:  # a batch of prompts
            n = n if isinstance(n, int) and 0 < n <= self.max_prompts else 1
            raise too_many_prompts(len(prompt), n, self.max_prompts)
        for item in prompt:
            self.bound_unvalidated(item, "prompt")

    def bound_messages(self, messages: Any, param: str = "messages") -> None:
        """A chat's `messages` (or `param`) as parsed: every message costs at least one token."""
        if isinstance(messages, list) and len(messages) >= self.context_length:
            bound = f"{len(messages)} messages, at least one token each"
            raise prompt_too_long(param, len(messages), self.context_length, bound)

    def bound_unvalidated(self, value: Any, param: str) -> None:
        """A text or token-id list as parsed, before its validation."""
        if isinstance(value, str):
            self.bound_chars(len(value), param)
        elif isinstance(value, list) and len(value) >= self.context_length:
            raise prompt_too_long(param, len(value), self.context_length)

    def bound_chars(self, chars: int, param: str) -> None:
        per_token = self.max_token_chars
        if per_token is None:
            return
        at_least = -(-chars // per_token)
        if at_least >= self.context_length:
            bound = f"{chars} characters, at most {per_token} per token"
            raise prompt_too_long(param, at_least, self.context_length, bound)


class PromptEncoder:
    """Bounds, then tokenizes, the prompts of requests for one served model."""

    def __init__(
        self, codec: TextCodec, context_length: int, workers: int, max_prompts: int = 1 << 30
    ) -> None:
        self.codec = codec
        self.context_length = context_length
        self.bounds = PromptBounds(context_length, codec.max_token_chars, max_prompts)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def prompt(
        self, prompt: Prompt, param: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        if isinstance(prompt, str):
            self.bounds.bound_chars(len(prompt), param)
        elif len(prompt) >= self.context_length:
            raise prompt_too_long(param, len(prompt), self.context_length)
        return await self._run(
            len(prompt), lambda: self.codec.encode_prompt(prompt, param, add_special_tokens)
        )

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        tools: ToolSpec | None = None,
        param: str = "messages",
    ) -> list[int]:
        chars = sum(len(m.content) for m in messages)
        self.bounds.bound_chars(chars, param)
        size = chars if len(messages) <= INLINE_MESSAGES else INLINE_CHARS + 1
        return await self._run(size, lambda: self.codec.chat_prompt(messages, tools))

    async def _run(self, size: int, work: Callable[[], T]) -> T:
        if size <= INLINE_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)
