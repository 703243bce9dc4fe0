"""Grammar-constrained decoding: compiled grammars, per-request matchers, per-step token masks.

A request with a `GrammarSpec` (engine/grammar_spec.py) gets a `RequestGrammar` when its sampler
is built: a matcher over the compiled grammar that knows which tokens may come next. Each step
the sampler asks every constrained row for its mask and sets the logits of forbidden tokens to
-inf before the penalties, warpers and draw (engine/sampling.py); after the draw the matcher
advances over the chosen token (`RequestSampler.observe`). A decode node that receives the first
token from a prefill node advances its own matcher over it (`RequestSampler.adopt`), so the
constraint holds across the hand-off. Requests without a grammar never touch this module.

Backends sit behind `GrammarBackend`, chosen by name from `GRAMMAR_BACKENDS` with lazy imports:
xgrammar (the library SGLang and vLLM use) is the one implemented. `GrammarCompiler` owns one
backend per engine (built on first use, since the backend's tokenizer tables take a moment) and
a cache of compiled grammars keyed by their spec.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.grammar_spec import GrammarSpec, unsupported_schema_feature
from engine.registry import needs_package, registered_class

GRAMMAR_BACKENDS: dict[str, tuple[str, str]] = {
    # name: (module:class, the package a user must install for it)
    "xgrammar": ("engine.grammar:XGrammarBackend", "xgrammar"),
}


class GrammarError(ValueError):
    """A spec the compiler refuses; the message names the kind and the compiler's reason."""


class GrammarViolation(ValueError):
    """A token the grammar forbids reached a matcher (a peer sampled without the grammar)."""


class TokenMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance over `token_id`; False (and no move) if the grammar forbids it."""

    @abstractmethod
    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of a backend mask."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""


class GrammarBackend(ABC):
    """Compiles specs and applies masks; one per engine, over the model's tokenizer."""

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec`; GrammarError with the compiler's reason if invalid."""

    @abstractmethod
    def matcher(self, compiled: Any) -> TokenMatcher: ...

    @abstractmethod
    def allocate_mask(self, rows: int) -> torch.Tensor:
        """A mask of `rows` rows on the CPU (filled by `TokenMatcher.fill_mask`)."""

    @abstractmethod
    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> None:
        """Set `logits[row, t]` to -inf for every token `t` that row `row` of `mask` forbids."""


@dataclass(frozen=True)
class GrammarTokenizer:
    """What a backend needs of the model: its HF tokenizer, logits width and stop tokens."""

    tokenizer: Any
    vocab_size: int
    stop_token_ids: tuple[int, ...]


def grammar_backend(name: str, tokenizer: GrammarTokenizer) -> GrammarBackend:
    cls = registered_class(GRAMMAR_BACKENDS, "grammar backend", name)
    # XGrammarBackend imports xgrammar when constructed
    with needs_package("grammar backend", name, GRAMMAR_BACKENDS[name][1]):
        backend: GrammarBackend = cls(tokenizer)
    return backend


class RequestGrammar:
    """A request's matcher and the backend that fills and applies its masks."""

    def __init__(self, backend: GrammarBackend, matcher: TokenMatcher) -> None:
        self.backend = backend
        self.matcher = matcher

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept(token_id):
            raise GrammarViolation(
                f"token {token_id} does not continue the request's grammar; a node sampled it "
                "without the grammar (is every node of the cluster on the same version?)"
            )

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated


def apply_grammar_masks(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
    """Mask, in place, each row of `logits` ([B, V], float) whose grammar is set."""
    rows = [row for row, g in enumerate(grammars) if g is not None and not g.is_terminated]
    if not rows:
        return
    first = grammars[rows[0]]
    assert first is not None
    backend = first.backend
    mask = backend.allocate_mask(len(grammars))
    for row in rows:
        grammar = grammars[row]
        assert grammar is not None
        grammar.matcher.fill_mask(mask, row)
    backend.apply_mask(logits, mask, rows)


class GrammarCompiler:
    """Compiles specs into per-request grammars, with a bounded cache keyed by spec.

    Thread-safe: node services compile on the gRPC thread while the engine thread samples.
    The backend (its tokenizer tables) is built on the first grammar request, so a node that
    never sees one never imports the backend's package.
    """

    def __init__(
        self, tokenizer: GrammarTokenizer, backend: str = "xgrammar", cache_size: int = 256
    ) -> None:
        self.tokenizer = tokenizer
        self.backend_name = backend
        self.cache_size = cache_size
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = grammar_backend(self.backend_name, self.tokenizer)
        return self._backend

    def compiled(self, spec: GrammarSpec) -> Any:
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                self.hits += 1
                return self._cache[spec]
            compiled = self.backend.compile(spec)
            self.misses += 1
            self._cache[spec] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def request_grammar(self, spec: GrammarSpec) -> RequestGrammar:
        compiled = self.compiled(spec)
        return RequestGrammar(self.backend, self.backend.matcher(compiled))


# ---- xgrammar --------------------------------------------------------------------------------
class XGrammarMatcher(TokenMatcher):
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(mask, row)

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarBackend(GrammarBackend):
    """xgrammar: a 32-bit-per-word token bitmask, filled per row, applied by its CPU kernel.

    JSON is compiled without free whitespace (compact separators): a small model offered
    whitespace can spend its whole budget on it and never close the document.
    """

    def __init__(self, tokenizer: GrammarTokenizer) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = tokenizer.vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer.tokenizer,
            vocab_size=tokenizer.vocab_size,
            stop_token_ids=list(tokenizer.stop_token_ids),
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        self._masks: dict[int, torch.Tensor] = {}

    def compile(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False
                )
            if spec.kind == "json_schema":
                # A parse error reads better from json than from C++.
                unsupported = unsupported_schema_feature(json.loads(spec.spec))
                if unsupported:
                    raise GrammarError(f"unsupported JSON Schema feature: {unsupported}")
                return self._compiler.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.spec)
            return self._compiler.compile_grammar(spec.spec)
        except GrammarError:
            raise
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"invalid {spec.kind}: {_compiler_reason(exc)}") from exc

    def matcher(self, compiled: Any) -> TokenMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def allocate_mask(self, rows: int) -> torch.Tensor:
        # Reused per batch size: every row that is applied is fully rewritten by its matcher.
        mask = self._masks.get(rows)
        if mask is None:
            mask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
            self._masks[rows] = mask
        return mask

    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> None:
        mask = mask.to(logits.device, non_blocking=True)
        indices = None if len(rows) == logits.shape[0] else list(rows)
        self._xgr.apply_token_bitmask_inplace(
            logits, mask, vocab_size=self.vocab_size, indices=indices
        )


def _compiler_reason(exc: Exception) -> str:
    """The compiler's message without its C++ source location (`[time] file.cc:12: reason`)."""
    text = str(exc).strip()
    head, sep, rest = text.partition(".cc:")
    if sep and "]" in head:
        _, _, rest = rest.partition(": ")
        return rest.strip() or text
    return text
