"""The text side of the gateway: tokenising prompts, the chat template, and streaming detokenising.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas. It decodes only a
short window: the tokens since the last emitted boundary, and the same window plus the new
tokens; the difference is the new text. While the decoded window ends in U+FFFD (a multi-byte
character whose bytes are split across tokens) nothing is emitted, so a character is never cut
in half. The concatenation of all deltas equals decoding the whole output at once.

`StopTrimmer` cuts the text before the first stop string. While streaming it holds back the
longest tail that could still be the beginning of a stop string, so the client never sees a
part of a stop string that is later removed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gateway.errors import bad_request
from gateway.requests.protocol import ChatMessage, Prompt
from gateway.requests.tools import ToolSpec, parser_family, render_chat

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded before the output so the first output token keeps its leading space
# (SentencePiece drops it at the start of a decode).
_CONTEXT_TOKENS = 4


class TextCodec:
    """The served model's tokenizer: prompts to ids, ids to text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}
        self._decoded_alone: dict[int, str] = {}  # decode([id]); at most the vocabulary
        self._backend_decode = _backend_decoder(tokenizer)
        # No token covers more characters than this (None: unknown); gateway/requests/tokenize.py.
        self.max_token_chars = _max_token_chars(tokenizer)

    @classmethod
    def load(cls, model_dir: str) -> TextCodec:
        from engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        if tokenizer is None:
            raise FileNotFoundError(
                f"{model_dir} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json): "
                "the gateway needs one to serve text"
            )
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode_prompt(
        self, prompt: Prompt, param: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        else:
            ids = list(prompt)
            vocab = self.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise bad_request(param, f"token ids {bad[:5]} are outside [0, {vocab})")
        if not ids:
            raise bad_request(param, f"`{param}` is empty: give at least one token")
        return ids

    @property
    def tool_family(self) -> str:
        """How this model writes tool calls (gateway/requests/tools.py), read from its chat
        template."""
        template = getattr(self.tokenizer, "chat_template", None)
        return parser_family(template if isinstance(template, str) else None)

    def chat_prompt(
        self, messages: Sequence[ChatMessage], tools: ToolSpec | None = None
    ) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(
                "messages", "this model has no chat template: use /v1/completions instead"
            )
        text = render_chat(self.tokenizer.apply_chat_template, messages, tools, self.tool_family)
        # The template already writes the special tokens (BOS, role markers).
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        if len(ids) == 1:  # the streaming detokenizer's window after every one-token event
            return self._one_token(ids[0])
        if self._backend_decode is not None:
            return self._backend_decode(list(ids), skip_special_tokens=True)
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _one_token(self, token_id: int) -> str:
        text = self._decoded_alone.get(token_id)
        if text is None:
            if self._backend_decode is not None:
                text = self._backend_decode([token_id], skip_special_tokens=True)
            else:
                text = str(self.tokenizer.decode([token_id], skip_special_tokens=True))
            self._decoded_alone[token_id] = text
        return text

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs show it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = str(self.tokenizer.decode([token_id], skip_special_tokens=False))
            self._token_text[token_id] = text
        return text

    def detokenizer(self, prompt_ids: Sequence[int]) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids[-_CONTEXT_TOKENS:])


def _max_token_chars(tokenizer: Any) -> int | None:
    """The most characters of input one token can cover, where that is known: a byte-level
    tokenizer without a normalizer (GPT-2, Llama 3, SmolLM2) spells every token as one vocabulary
    character per byte, and an input character is at least one byte. Other tokenizers may map a
    whole unknown word to one token or rewrite the text first: no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    if "ByteLevel" not in repr(backend.pre_tokenizer):
        return None
    added = [len(t) for t in getattr(tokenizer, "all_special_tokens", ())]
    return max([len(token) for token in tokenizer.get_vocab()] + added)


def _backend_decoder(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust tokenizer's `decode` where transformers' `decode` would only call it (a fast
    tokenizer without the clean-up pass): the same text, without transformers' Python around
    each call (type conversions, keyword handling), which the streaming detokenizer pays twice
    per streamed chunk."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    decode: Callable[..., str] = backend.decode
    return decode


class IncrementalDetokenizer:
    def __init__(self, codec: TextCodec, context: Sequence[int]) -> None:
        self.codec = codec
        self.ids = list(context)
        self.prefix_offset = 0  # start of the window that is decoded again
        self.read_offset = len(self.ids)  # tokens before this have been emitted as text

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text they complete (maybe "", never half a character)."""
        self.ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: whatever is left, incomplete characters included (as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        done = self.codec.decode(self.ids[self.prefix_offset : self.read_offset])
        text = self.codec.decode(self.ids[self.prefix_offset :])
        if len(text) <= len(done) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return text[len(done) :]


class StopTrimmer:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""
        self.stopped: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> str:
        """Text safe to send now; after a stop string nothing more is ever returned."""
        if self.stopped is not None:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            cut, self.stopped = min(hits)
            self.held = ""
            return buf[:cut]
        keep = self._partial_stop_tail(buf)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped is not None else held

    def _partial_stop_tail(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
