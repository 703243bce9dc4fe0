"""Turning a batch of next-token logits into one token per request.

A request carries a frozen `SamplingParams` (validated once, at the edge) and owns a
`RequestSampler`: its seeded `torch.Generator` plus the token history that the penalties need.
`sample_batch` samples every row of a `[B, V]` logits tensor with that row's own sampler.

Processing order follows HF `generate` and vLLM, on a float32 copy of the logits:

    logit bias -> grammar mask -> min-tokens mask -> repetition penalty -> frequency/presence
    penalties -> temperature -> top-k -> top-p -> min-p -> one draw from the row's own generator

`logit_bias` (OpenAI's: token id -> a bias in [-100, 100]) is added to the raw logits of every
draw; `min_tokens` sets EOS and the stop tokens to -inf until that many tokens were generated,
except where the grammar allows nothing else (the grammar wins: its document must end).

A row with a grammar (`SamplingParams.grammar`, engine/grammar.py) first has every token its
grammar forbids set to -inf, so the whole chain above only ever sees allowed tokens; its matcher
advances over the chosen token in `observe`. Rows without one skip this entirely.

Greedy rows (`SamplingParams.is_greedy`) take `argmax` of the penalised logits, so with no
penalties they are exactly `torch.argmax` of the raw logits, ties included. When every row of the
batch is greedy and none has a penalty, the whole batch is one `argmax` and nothing is copied:
that is the common serving path. On the CPU that argmax is numpy's (`row_argmax`): the same
index, first of ties included, about 4x faster than torch's at a [256, 49152] batch, where
torch's took half a tiny model's host time per decode step.

Reproducibility: the random numbers of a request's draw are a function of its seed and of the
position of the token being drawn (its index in prompt + output) alone: before each draw the
row's generator is re-seeded with `position_seed(seed, position)` and fills one `V`-sized block.
So a seeded request draws the same tokens from the same logits wherever it sits in the batch,
whoever shares the batch with it (every other operation is row-wise), and whichever node draws
a given token: a decode node continuing after the prefill node's first token (`adopt`), or one
that takes over a migrated request whose earlier tokens arrive as part of its prompt (`resume`),
continues exactly the stream an uninterrupted run would have drawn. Streams are reproducible
per device type only: CPU and CUDA generators produce different numbers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine import sampling_fields as fields
from engine.grammar import RequestGrammar, apply_grammar_masks
from engine.grammar_spec import GrammarSpec

# Below this, dividing by the temperature can overflow float32 (inf - inf = nan in softmax), and
# the distribution is a point mass on the argmax anyway, so such rows are sampled greedily.
MIN_SAMPLING_TEMPERATURE = 1e-5
_SEED_MASK = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed of the draw for the token at `position` (its index in prompt +
    output) of a request seeded with `seed`: splitmix64 of the pair, so neighbouring positions
    get unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _SEED_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _SEED_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _SEED_MASK
    return z ^ (z >> 31)


def _as_tuple(name: str, value: object) -> tuple[object, ...]:
    """A single item, a list or a tuple; a lone str is one item, not its characters."""
    if isinstance(value, (str, int)):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise ValueError(f"{name} must be a single value, a list or a tuple, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens; validated on construction.

    Normalisations done in `__post_init__` (so downstream code sees one canonical form):
    - `stop` and `stop_token_ids` accept a single value or a list and are stored as tuples;
    - `top_k == 0` means disabled, like `-1`, and is stored as `-1`;
    - `top_logprobs > 0` turns `logprobs` on, since alternatives without the chosen token's
      logprob would be a confusing response.

    `seed` is an int64, as in the node API; it is masked to 64 bits (two's complement for
    negatives) when the generator is seeded, so clients sending signed seeds are not rejected.
    """

    # Types, ranges and defaults: engine/sampling_fields.py (the gateway declares its request
    # fields from the same table).
    max_new_tokens: int = fields.MAX_NEW_TOKENS.default
    temperature: float = fields.TEMPERATURE.default
    top_p: float = fields.TOP_P.default
    top_k: int = fields.TOP_K.default
    min_p: float = fields.MIN_P.default
    repetition_penalty: float = fields.REPETITION_PENALTY.default
    frequency_penalty: float = fields.FREQUENCY_PENALTY.default
    presence_penalty: float = fields.PRESENCE_PENALTY.default
    seed: int | None = fields.SEED.default
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = fields.TOP_LOGPROBS.default
    grammar: GrammarSpec | None = None  # the output must match it (engine/grammar.py)
    # Tokens at the end of the prompt that were generated under `grammar` (a migrated request's
    # streamed tokens): its matcher starts after them.
    grammar_generated_ids: tuple[int, ...] = ()
    # The logprob of every prompt token after the first and its top-n (None: not computed);
    # the node that prefills computes them, recomputing any cached prefix.
    prompt_logprobs: int | None = None
    # (token id, bias) pairs sorted by id; a mapping is accepted and normalised.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Counted from the request's first output token, also those before a move (`resume`),
    # while max_new_tokens is what is left to generate here: a min_tokens beyond it is cut
    # by the length limit (the gateway refuses min_tokens > max_tokens at the API).
    min_tokens: int = fields.MIN_TOKENS.default

    def __post_init__(self) -> None:
        self._validate_numbers()
        self._normalise_stops()
        self._normalise_logit_bias()
        object.__setattr__(self, "grammar_generated_ids", tuple(self.grammar_generated_ids))
        if self.grammar_generated_ids and self.grammar is None:
            raise ValueError("grammar_generated_ids needs a grammar")
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if self.top_logprobs > 0:
            object.__setattr__(self, "logprobs", True)

    def _validate_numbers(self) -> None:
        for spec in fields.NUMBER_FIELDS:
            value = getattr(self, spec.name)
            if value is not None or spec.default is not None:
                spec.check(value)
        if self.prompt_logprobs is not None:
            fields.PROMPT_LOGPROBS.check(self.prompt_logprobs)

    def _normalise_stops(self) -> None:
        stop = _as_tuple("stop", self.stop)
        for text in stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop must contain non-empty strings, got {text!r}")
        stop_token_ids = _as_tuple("stop_token_ids", self.stop_token_ids)
        if len(stop_token_ids) > fields.MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(stop_token_ids)} items; "
                f"at most {fields.MAX_STOP_TOKEN_IDS}"
            )
        for token_id in stop_token_ids:
            if fields.STOP_TOKEN_ID.problem(token_id) is not None:
                raise ValueError(
                    f"stop_token_ids must contain integers {fields.STOP_TOKEN_ID.rule}, "
                    f"got {token_id!r}"
                )
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)

    def _normalise_logit_bias(self) -> None:
        raw = self.logit_bias
        pairs = list(raw.items()) if isinstance(raw, Mapping) else list(raw)
        if len(pairs) > fields.MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias has {len(pairs)} entries; at most {fields.MAX_LOGIT_BIAS}"
            )
        for token_id, bias in pairs:
            if fields.STOP_TOKEN_ID.problem(token_id) is not None:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id!r}")
            problem = fields.LOGIT_BIAS.problem(bias)
            if problem is not None:
                raise ValueError(f"logit_bias[{token_id}] {problem}")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), b) for t, b in pairs)))

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a stop or biased token id cannot occur in a vocabulary of this
        size."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", [t for t, _ in self.logit_bias]),
        ):
            for token_id in ids:
                if token_id >= vocab_size:
                    raise ValueError(f"{name} must be < vocab_size {vocab_size}, got {token_id}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    @property
    def has_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def has_output_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


class RequestSampler:
    """One request's sampling state: its generator and the token history its penalties read.

    `position` is the index (in prompt + output) of the token the next draw is for: it starts at
    the prompt's length and moves on with every token this sampler draws, adopts or resumes.
    The penalty tensors live on the logits' device and exist only when that penalty is active,
    so a request without penalties costs one generator and an output list.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
        grammar: RequestGrammar | None = None,
        eos_ids: Sequence[int] = (),
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        params.check_vocab(vocab_size)
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output_token_ids: list[int] = []
        self.grammar = grammar  # built from params.grammar by the caller, which owns the compiler
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.seed = seed & _SEED_MASK
        self.position = len(prompt_ids)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)
        # Repetition penalty (HF) covers prompt and output; frequency/presence (OpenAI) only output.
        self._seen_mask: torch.Tensor | None = None
        self._output_counts: torch.Tensor | None = None
        if params.has_repetition_penalty:
            self._seen_mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            if len(prompt_ids) > 0:
                self._seen_mask[self._token_tensor(prompt_ids)] = True
        if params.has_output_penalties:
            self._output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=self.device)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias, strict=True)
            self._bias = (
                torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(biases, dtype=torch.float32, device=self.device),
            )
        # Masked until min_tokens: EOS (unless ignored) and the stop tokens.
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        ends = {t for t in ends if t < vocab_size}
        self._ends: torch.Tensor | None = None
        if params.min_tokens > 0 and ends:
            self._ends = torch.tensor(sorted(ends), dtype=torch.long, device=self.device)

    def _token_tensor(self, token_ids: Sequence[int]) -> torch.Tensor:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return torch.tensor(list(token_ids), dtype=torch.long, device=self.device)

    @property
    def has_penalties(self) -> bool:
        return self._seen_mask is not None or self._output_counts is not None

    @property
    def masks_ends(self) -> bool:
        """True while `min_tokens` keeps EOS and the stop tokens from being drawn."""
        return self._ends is not None and len(self.output_token_ids) < self.params.min_tokens

    @property
    def needs_processing(self) -> bool:
        """False when this row's token is plain argmax of the raw logits."""
        return (
            self.has_penalties
            or not self.params.is_greedy
            or self.grammar is not None
            or self._bias is not None
            or self.masks_ends
        )

    @property
    def grammar_done(self) -> bool:
        """True once this request's grammar is complete (its stop token accepted)."""
        return self.grammar is not None and self.grammar.is_terminated

    def observe(self, token_id: int) -> None:
        """Record a token generated for this request; `sample_batch` calls this itself."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token_id must be in [0, {self.vocab_size}), got {token_id}")
        if self.grammar is not None:
            self.grammar.accept(token_id)  # GrammarViolation if the grammar forbids it
        self.output_token_ids.append(token_id)
        if self._seen_mask is not None:
            self._seen_mask[token_id] = True
        if self._output_counts is not None:
            self._output_counts[token_id] += 1

    def adopt(self, token_id: int) -> None:
        """Take a token sampled for this request elsewhere (a decode node gets the first token
        from the prefill node) as if this sampler had drawn it: observe it and move past its
        position, so a seeded request continues the same stream as colocated."""
        self.position += 1
        self.observe(token_id)

    def resume(self, token_ids: Sequence[int]) -> None:
        """Take the tokens generated for this request before it moved here (a migrated request:
        they end its prompt) as its output so far: the penalties count them as output, and the
        next draw is for the position after them, as in an uninterrupted run. The prompt given
        to the constructor is then the original prompt, without these tokens."""
        for token_id in token_ids:
            self.adopt(token_id)

    def fill_noise(self, row: torch.Tensor) -> None:
        """This draw's `Exp(1)` noise, a function of (seed, position) only; moves on."""
        self.generator.manual_seed(position_seed(self.seed, self.position))
        row.exponential_(generator=self.generator)
        self.position += 1

    def apply_bias(self, row_logits: torch.Tensor) -> None:
        """`logit_bias` added to this request's `[V]` float logits, in place."""
        if self._bias is not None:
            ids, biases = self._bias
            row_logits.index_add_(0, ids, biases)

    def mask_ends(self, row_logits: torch.Tensor) -> None:
        """EOS and the stop tokens to -inf while `min_tokens` is not reached, unless nothing
        else is left (a grammar that must end now)."""
        if not self.masks_ends:
            return
        assert self._ends is not None
        kept = row_logits[self._ends].clone()
        row_logits[self._ends] = -math.inf
        if self.grammar is not None and not bool(torch.isfinite(row_logits).any()):
            row_logits[self._ends] = kept

    def apply_penalties(self, row_logits: torch.Tensor) -> None:
        """Penalise this request's `[V]` float logits in place (no-op without penalties)."""
        if self._seen_mask is not None:
            penalty = self.params.repetition_penalty
            # HF RepetitionPenaltyLogitsProcessor: negative logits are multiplied, others divided.
            penalised = torch.where(row_logits < 0, row_logits * penalty, row_logits / penalty)
            row_logits.copy_(torch.where(self._seen_mask, penalised, row_logits))
        if self._output_counts is not None:
            counts = self._output_counts
            row_logits -= self.params.frequency_penalty * counts
            row_logits -= self.params.presence_penalty * (counts > 0).to(row_logits.dtype)


@dataclass
class SampleOutput:
    """Per row: the chosen token, its logprob and its top alternatives, best first.

    Rows without `logprobs` get None in both lists; rows with `logprobs` but `top_logprobs=0`
    get an empty alternatives list.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]

    @classmethod
    def observed(cls, token_ids: list[int], samplers: Sequence[RequestSampler]) -> SampleOutput:
        """Tokens picked elsewhere (a CUDA graph's argmax, for rows without logprobs), each
        `observe`d on its row's sampler as `sample_batch` would."""
        for sampler, token_id in zip(samplers, token_ids, strict=True):
            sampler.observe(token_id)
        none = [None] * len(token_ids)
        return cls(token_ids=list(token_ids), logprobs=list(none), top_logprobs=list(none))


def sample_batch(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> SampleOutput:
    """Pick one token per row of `logits` ([B, V]) and `observe` it on that row's sampler.

    `logits` is not modified. Logprobs are log_softmax of the raw logits, before penalties and
    temperature: they describe the model's own distribution (vLLM's default "raw_logprobs") and
    do not change when a client tweaks its sampling knobs.
    """
    chosen = sample_tokens(logits, samplers)
    token_ids: list[int] = chosen.tolist()
    logprobs, top_logprobs = _logprobs(logits, chosen, samplers)
    for sampler, token_id in zip(samplers, token_ids, strict=True):
        sampler.observe(token_id)
    return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top_logprobs)


def sample_tokens(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """The chosen token of each row as a tensor on the logits' device, with no host sync and no
    `observe`: the overlap scheduler (engine/overlap.py) reads the values a step later."""
    _check_batch(logits, samplers)
    if not is_plain_argmax(samplers):
        return _sample_processed(logits, samplers)
    return row_argmax(logits)


def is_plain_argmax(samplers: Sequence[RequestSampler]) -> bool:
    """True when `sample_tokens` picks every row by one argmax of the raw logits (greedy, no
    penalty, no grammar): what a CUDA graph may compute in its place (engine/cuda_graph.py)."""
    return not any(s.needs_processing for s in samplers)


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """`values.argmax(dim=-1)` of a [B, V] tensor; on the CPU computed by numpy's vectorised
    argmax (same result, ties to the first index and a NaN winning as in torch)."""
    if values.device.type == "cpu" and values.dtype in _NUMPY_ARGMAX:
        return torch.from_numpy(values.detach().numpy().argmax(axis=-1))
    return values.argmax(dim=-1)


_NUMPY_ARGMAX = (torch.float32, torch.float64)


def _check_batch(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(samplers):
        raise ValueError(
            f"logits must have shape [{len(samplers)}, vocab] (one row per sampler), "
            f"got {tuple(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
    for row, sampler in enumerate(samplers):
        if sampler.vocab_size != logits.shape[1]:
            raise ValueError(
                f"row {row}: sampler vocab_size {sampler.vocab_size} != logits width "
                f"{logits.shape[1]}; build the RequestSampler with the model's logits width"
            )
        if sampler.device.type != logits.device.type:
            raise ValueError(
                f"row {row}: sampler is on {sampler.device} but logits are on {logits.device}"
            )


def _sample_processed(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """The general path: penalties for every row, then warpers and a draw for non-greedy rows."""
    logits = logits.to(torch.float32, copy=True)
    for row, sampler in enumerate(samplers):
        sampler.apply_bias(logits[row])
    if any(s.grammar is not None for s in samplers):
        apply_grammar_masks(logits, [s.grammar for s in samplers])
    for row, sampler in enumerate(samplers):
        sampler.mask_ends(logits[row])
        if sampler.has_penalties:
            sampler.apply_penalties(logits[row])
    chosen = row_argmax(logits)
    sampled_rows = [row for row, s in enumerate(samplers) if not s.params.is_greedy]
    if sampled_rows:
        index = torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)
        sampled = _sample_rows(logits[index], [samplers[row] for row in sampled_rows])
        chosen[index] = sampled
    return chosen


def _sample_rows(logits: torch.Tensor, samplers: Sequence[RequestSampler]) -> torch.Tensor:
    """One draw per row from its warped distribution; `logits` is owned and modified."""
    logits = _warp_logits(logits, [s.params for s in samplers])
    probs = logits.softmax(dim=-1)
    # Exponential-race sampling: argmax(p / q) with q ~ Exp(1) is a draw from p (what
    # torch.multinomial does for one sample, without its host sync). Each row fills its q from its
    # own generator, so a row's draw never depends on its neighbours.
    noise = torch.empty_like(probs)
    for row, sampler in enumerate(samplers):
        sampler.fill_noise(noise[row])
    # CPU exponential_ can return exactly 0, and 0/0 = nan would win argmax on a masked token.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return row_argmax(probs.div_(noise))


def _warp_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, in place; removed tokens become -inf."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits.div_(temperature.unsqueeze(1))
    _apply_top_k_top_p(logits, params)
    if any(p.min_p > 0 for p in params):
        _apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus.

    Both filters become a per-row logit threshold, so tokens tied with the last kept token are
    kept too (as HF's top-k does) and nothing needs scattering back from sorted order.
    """
    use_top_k = any(p.top_k > 0 for p in params)
    use_top_p = any(p.top_p < 1 for p in params)
    if not (use_top_k or use_top_p):
        return
    vocab_size = logits.shape[1]
    if use_top_p:
        ranked = logits.sort(dim=-1, descending=True).values
    else:
        ranked = logits.topk(min(max(p.top_k for p in params), vocab_size), dim=-1).values
    if use_top_k:
        # Rows without top-k get a -inf threshold, which removes nothing.
        k = [min(p.top_k, ranked.shape[1]) if p.top_k > 0 else 1 for p in params]
        k_index = torch.tensor(k, device=logits.device).sub_(1).unsqueeze(1)
        kth = ranked.gather(1, k_index)
        enabled = torch.tensor([p.top_k > 0 for p in params], device=logits.device)
        kth.masked_fill_(~enabled.unsqueeze(1), -math.inf)
        logits.masked_fill_(logits < kth, -math.inf)
        if use_top_p:
            # Top-p renormalises over the top-k survivors, as HF's chained warpers do.
            ranked.masked_fill_(ranked < kth, -math.inf)
    if use_top_p:
        top_p = [p.top_p if p.top_p < 1 else math.inf for p in params]
        _apply_top_p(logits, ranked, torch.tensor(top_p, device=logits.device))


def _apply_top_p(logits: torch.Tensor, ranked: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep the smallest prefix of `ranked` (descending logits) whose probability is >= top_p."""
    probs = ranked.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # A token stays while the mass ranked above it is < top_p; the best token always stays.
    num_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1).clamp_min(1)
    threshold = ranked.gather(1, (num_kept - 1).unsqueeze(1))
    logits.masked_fill_(logits < threshold, -math.inf)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below min_p times the row's highest probability."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < floor, -math.inf)


def _logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, samplers: Sequence[RequestSampler]
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Chosen-token logprob and top-n alternatives, computed only for rows that asked."""
    logprobs: list[float | None] = [None] * len(samplers)
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * len(samplers)
    rows = [row for row, s in enumerate(samplers) if s.params.logprobs]
    if not rows:
        return logprobs, top_logprobs
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    log_probs = logits[index].float().log_softmax(dim=-1)
    chosen_logprobs = log_probs.gather(1, chosen[index].unsqueeze(1)).squeeze(1).tolist()
    max_top = max(samplers[row].params.top_logprobs for row in rows)
    # Rows with logprobs but top_logprobs=0 get [] (OpenAI's shape), rows without get None.
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if max_top > 0:
        top = log_probs.topk(min(max_top, logits.shape[1]), dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for i, row in enumerate(rows):
        num_top = samplers[row].params.top_logprobs
        logprobs[row] = chosen_logprobs[i]
        top_logprobs[row] = list(zip(top_ids[i][:num_top], top_values[i][:num_top], strict=True))
    return logprobs, top_logprobs
