"""Tokenizer loading and stop-string handling (text-side concerns of the engine)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the gateway loads tokenizers here and must not import torch
    from engine.request import Req

# Tokens decoded to look for a stop string: enough for any stop string of up to ~4x this many
# characters, without re-decoding the whole output every step.
_STOP_WINDOW_TOKENS = 32


def load_tokenizer(model_dir: str) -> Any | None:
    """The model's HF tokenizer, or None when the directory has no tokenizer files."""
    path = Path(model_dir)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    if (path / "tokenizer.json").exists():
        # The same tokenizer class AutoTokenizer picks for a tokenizer.json, without its
        # import of torch (the gateway loads tokenizers here and runs without torch).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class StopStringChecker:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, req: Req) -> str | None:
        # The sampler's output: `output_ids` plus, for a request migrated from another node,
        # the tokens it generated there (they end its prompt here), so a stop string across
        # the move still matches.
        # Text of the first min_tokens tokens is not searched (the gateway does the same).
        ids = req.sampler.output_token_ids
        start = max(len(ids) - _STOP_WINDOW_TOKENS, req.params.min_tokens)
        tail = self.tokenizer.decode(ids[start:], skip_special_tokens=True)
        for stop in req.params.stop:
            if stop in tail:
                return stop
        return None


def trim_at_stop(text: str, stops: Sequence[str]) -> str:
    """Cut `text` before the earliest stop string it contains."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]
