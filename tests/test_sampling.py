"""Sampling: parameter validation, greedy/warper/penalty semantics, seeds and logprobs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import (
    RequestSampler,
    SampleOutput,
    SamplingParams,
    _warp_logits,
    sample_batch,
)
from engine.sampling_fields import (
    INT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)

CPU = torch.device("cpu")
IDS = f"in [0, {INT32_MAX}]"


def make_sampler(
    vocab_size: int, prompt_ids: tuple[int, ...] = (), **params: Any
) -> RequestSampler:
    return RequestSampler(SamplingParams(**params), prompt_ids, vocab_size, CPU)


def random_logits(rows: int, vocab_size: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab_size, generator=generator) * scale


# --- SamplingParams validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_new_tokens", 0, "max_new_tokens must be >= 1, got 0"),
        ("max_new_tokens", 1.5, "max_new_tokens must be an integer, got 1.5"),
        ("temperature", -1.0, "temperature must be in [0, 2], got -1.0"),
        ("temperature", 2.5, "temperature must be in [0, 2], got 2.5"),
        ("temperature", math.nan, "temperature must be a finite number, got nan"),
        ("temperature", math.inf, "temperature must be a finite number, got inf"),
        ("temperature", "hot", "temperature must be a finite number, got 'hot'"),
        ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
        ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
        ("top_k", -2, f"top_k must be in [-1, {INT32_MAX}] (-1 or 0: disabled), got -2"),
        ("top_k", 1.0, "top_k must be an integer, got 1.0"),
        ("min_p", -0.1, "min_p must be in [0, 1], got -0.1"),
        ("min_p", 1.1, "min_p must be in [0, 1], got 1.1"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0, got 0.0"),
        ("repetition_penalty", -math.inf, "repetition_penalty must be a finite number, got -inf"),
        ("frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2], got 2.5"),
        ("frequency_penalty", -2.5, "frequency_penalty must be in [-2, 2], got -2.5"),
        ("presence_penalty", 3, "presence_penalty must be in [-2, 2], got 3"),
        ("presence_penalty", math.nan, "presence_penalty must be a finite number, got nan"),
        ("seed", 1.0, "seed must be an integer, got 1.0"),
        ("seed", 1 << 63, f"seed must be in [{-(1 << 63)}, {(1 << 63) - 1}], got {1 << 63}"),
        ("top_logprobs", -1, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got -1"),
        ("top_logprobs", 21, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got 21"),
        ("stop", "", "stop must contain non-empty strings, got ''"),
        ("stop", ["ok", ""], "stop must contain non-empty strings, got ''"),
        ("stop", ["ok", 3], "stop must contain non-empty strings, got 3"),
        ("stop", 3.5, "stop must be a single value, a list or a tuple, got 3.5"),
        ("stop_token_ids", [1, -1], f"stop_token_ids must contain integers {IDS}, got -1"),
        ("stop_token_ids", ["1"], f"stop_token_ids must contain integers {IDS}, got '1'"),
        (
            "stop_token_ids",
            [1] * (MAX_STOP_TOKEN_IDS + 1),
            f"stop_token_ids has 65 items; at most {MAX_STOP_TOKEN_IDS}",
        ),
        ("min_tokens", -1, f"min_tokens must be in [0, {INT32_MAX}], got -1"),
        ("logit_bias", {3: 101.0}, "logit_bias[3] must be in [-100, 100], got 101.0"),
        ("logit_bias", {3: math.nan}, "logit_bias[3] must be a finite number, got nan"),
        ("logit_bias", {-3: 1.0}, "logit_bias keys must be token ids >= 0, got -3"),
        (
            "logit_bias",
            {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)},
            f"logit_bias has {MAX_LOGIT_BIAS + 1} entries; at most {MAX_LOGIT_BIAS}",
        ),
    ],
)
def test_invalid_params_name_field_value_and_range(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert str(info.value) == message


def test_defaults_are_valid_and_sample_at_temperature_one() -> None:
    params = SamplingParams()
    assert params.max_new_tokens == 128
    assert params.temperature == 1.0 and not params.is_greedy
    assert params.stop == () and params.stop_token_ids == ()
    assert not params.logprobs and params.top_logprobs == 0


def test_boundary_values_are_accepted() -> None:
    SamplingParams(
        max_new_tokens=1,
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        repetition_penalty=1e-3,
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        seed=-5,
        top_logprobs=MAX_TOP_LOGPROBS,
    )


def test_stop_and_stop_token_ids_normalise_to_tuples() -> None:
    assert SamplingParams(stop="END").stop == ("END",)  # type: ignore[arg-type]
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=[3, 7]).stop_token_ids == (3, 7)  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=5).stop_token_ids == (5,)  # type: ignore[arg-type]
    params = SamplingParams(stop=["x"], stop_token_ids=[1])  # type: ignore[arg-type]
    hash(params)  # frozen and hashable once lists became tuples


def test_top_k_zero_means_disabled() -> None:
    assert SamplingParams(top_k=0).top_k == -1
    assert not SamplingParams(top_k=0).is_greedy


def test_top_logprobs_turns_logprobs_on() -> None:
    assert SamplingParams(top_logprobs=3).logprobs
    assert not SamplingParams(top_logprobs=0).logprobs


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy


def test_check_vocab() -> None:
    params = SamplingParams(stop_token_ids=(3, 9))
    params.check_vocab(10)
    with pytest.raises(ValueError, match=r"stop_token_ids must be < vocab_size 9, got 9"):
        params.check_vocab(9)
    with pytest.raises(ValueError, match="stop_token_ids"):
        RequestSampler(params, [], 5, CPU)


def test_sampler_rejects_out_of_vocab_prompt_and_tokens() -> None:
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 4\)"):
        make_sampler(4, (1, 4), repetition_penalty=1.2)
    sampler = make_sampler(4)
    with pytest.raises(ValueError, match="token_id must be in"):
        sampler.observe(4)


def test_batch_shape_and_vocab_mismatch_are_reported() -> None:
    with pytest.raises(ValueError, match=r"shape \[2, vocab\]"):
        sample_batch(torch.zeros(1, 4), [make_sampler(4), make_sampler(4)])
    with pytest.raises(ValueError, match="vocab_size 5 != logits width 4"):
        sample_batch(torch.zeros(1, 4), [make_sampler(5)])


# --- greedy and warpers --------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab_size=st.integers(1, 40),
    seed=st.integers(0, 2**31),
    ties=st.booleans(),
)
def test_greedy_equals_argmax(rows: int, vocab_size: int, seed: int, ties: bool) -> None:
    logits = random_logits(rows, vocab_size, seed)
    if ties:  # few distinct values, so the first-index tie rule of argmax is exercised
        logits = logits.round()
    samplers = [make_sampler(vocab_size, temperature=0.0) for _ in range(rows)]
    out = sample_batch(logits, samplers)
    assert out.token_ids == torch.argmax(logits, dim=-1).tolist()
    assert out.logprobs == [None] * rows and out.top_logprobs == [None] * rows


def test_greedy_accepts_half_precision_logits() -> None:
    logits = random_logits(3, 50, seed=1).to(torch.bfloat16)
    samplers = [make_sampler(50, temperature=0.0, logprobs=True) for _ in range(3)]
    assert sample_batch(logits, samplers).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = random_logits(4, 30, seed=2)
    samplers = [
        make_sampler(30, temperature=0.0),
        make_sampler(30, temperature=1.5, seed=1),
        make_sampler(30, temperature=0.9, top_k=1, seed=2),
        make_sampler(30, temperature=1.0, top_p=0.5, seed=3),
    ]
    out = sample_batch(logits, samplers)
    argmax = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == argmax[0]
    assert out.token_ids[2] == argmax[2]


@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 1, "temperature": 2.0},
        {"top_p": 1e-6, "temperature": 2.0},
        {"min_p": 1.0, "temperature": 2.0},
        {"min_p": 0.999, "temperature": 2.0},
        {"temperature": 1e-7},
    ],
)
def test_filters_that_keep_one_token_pick_the_max(params: dict[str, Any]) -> None:
    logits = random_logits(8, 64, seed=3, scale=0.5)
    for step in range(5):
        samplers = [make_sampler(64, seed=step * 8 + row, **params) for row in range(8)]
        assert sample_batch(logits, samplers).token_ids == logits.argmax(dim=-1).tolist()


def test_sampler_never_draws_a_filtered_token() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    probs = logits.softmax(dim=-1)[0]
    nucleus = int((probs.cumsum(0) < 0.9).sum()) + 1  # smallest prefix with mass >= 0.9
    cases: list[tuple[dict[str, Any], int]] = [
        ({"top_k": 2}, 2),
        ({"top_p": 0.9}, nucleus),
        ({"min_p": 0.3}, 2),
    ]
    for params, kept in cases:
        seen: set[int] = set()
        sampler = make_sampler(6, seed=11, **params)
        for _ in range(300):
            seen.update(sample_batch(logits, [sampler]).token_ids)
        assert seen == set(range(kept)), params


warper_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 3, 50]),
    top_p=st.sampled_from([0.3, 0.8, 0.95, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.2]),
)


def hf_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    warpers = pytest.importorskip("transformers.generation.logits_process")
    scores = warpers.TemperatureLogitsWarper(params.temperature)(None, logits.unsqueeze(0))
    if params.top_k > 0:
        scores = warpers.TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = warpers.TopPLogitsWarper(params.top_p)(None, scores)
    if params.min_p > 0:
        scores = warpers.MinPLogitsWarper(params.min_p)(None, scores)
    return scores[0]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.lists(warper_params, min_size=1, max_size=4))
def test_warpers_keep_the_same_tokens_as_hf(seed: int, rows: list[SamplingParams]) -> None:
    # Rows with different settings share the batch, so one row's filter must not leak into another.
    logits = random_logits(len(rows), 40, seed)
    ours = _warp_logits(logits.clone(), rows)
    for row, params in enumerate(rows):
        expected = hf_warp(logits[row], params)
        kept = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(ours[row]), kept), params
        torch.testing.assert_close(ours[row][kept], expected[kept])


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.8])
def test_sample_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    draws = 4000
    samplers = [make_sampler(5, temperature=temperature, seed=seed) for seed in range(draws)]
    tokens = sample_batch(logits.expand(draws, 5), samplers).token_ids
    frequencies = torch.bincount(torch.tensor(tokens), minlength=5).double() / draws
    expected = (logits.double() / temperature).softmax(dim=-1)
    # Binomial std is <= sqrt(0.25 / 4000) ~ 0.008; seeds are fixed, so this is deterministic.
    assert torch.allclose(frequencies, expected, atol=0.03), (frequencies, expected)


# --- seeds ------------------------------------------------------------------------------------


def run_steps(target_row: int, batch: int, steps: int, mix_seed: int) -> list[int]:
    """Tokens of a seeded request sitting at `target_row` among differently-configured others."""
    vocab_size = 100
    others: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 1.3, "top_k": 5},
        {"top_p": 0.7, "repetition_penalty": 1.3},
        {"min_p": 0.1, "frequency_penalty": 0.5},
        {"logprobs": True, "top_logprobs": 3},
    ]
    target = make_sampler(vocab_size, (1, 2, 3), seed=1234, top_p=0.9, top_k=40)
    samplers = [make_sampler(vocab_size, **others[(row + mix_seed) % 5]) for row in range(batch)]
    samplers[target_row] = target
    tokens = []
    for step in range(steps):
        logits = random_logits(batch, vocab_size, seed=1000 * mix_seed + step, scale=1.0)
        logits[target_row] = random_logits(1, vocab_size, seed=step, scale=1.0)[0]
        tokens.append(sample_batch(logits, samplers).token_ids[target_row])
    assert target.output_token_ids == tokens
    return tokens


def test_seeded_request_is_independent_of_batch_composition_and_position() -> None:
    alone = run_steps(target_row=0, batch=1, steps=12, mix_seed=0)
    assert run_steps(target_row=3, batch=5, steps=12, mix_seed=1) == alone
    assert run_steps(target_row=0, batch=7, steps=12, mix_seed=4) == alone
    assert run_steps(target_row=6, batch=7, steps=12, mix_seed=2) == alone


@pytest.mark.parametrize(
    "params", [{"temperature": 0.8, "seed": 5}, {"temperature": 0.0, "repetition_penalty": 1.3}]
)
def test_adopted_first_token_continues_the_same_stream(params: dict[str, Any]) -> None:
    """A decode node adopts the prefill node's first token: its next draws are the ones the
    request would have drawn had it sampled that token itself (seeded and penalised rows)."""
    steps = [random_logits(1, 500, seed=s, scale=1.0) for s in range(6)]
    local = make_sampler(500, prompt_ids=(1, 2), **params)
    tokens = [sample_batch(logits, [local]).token_ids[0] for logits in steps]
    remote = make_sampler(500, prompt_ids=(1, 2), **params)
    remote.adopt(tokens[0])
    assert [sample_batch(logits, [remote]).token_ids[0] for logits in steps[1:]] == tokens[1:]
    assert remote.output_token_ids == local.output_token_ids


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.8, "seed": 5},
        {"temperature": 1.0, "top_p": 0.9, "seed": -3, "frequency_penalty": 0.7},
        {"temperature": 0.0, "presence_penalty": 1.5, "repetition_penalty": 1.2},
    ],
)
def test_resumed_request_continues_the_same_stream(params: dict[str, Any]) -> None:
    """A migrated request: its first tokens come back as the end of its prompt on another node
    (`resume`); the draws that follow are the ones an uninterrupted run made, penalties included."""
    prompt = (1, 2, 3)
    steps = [random_logits(1, 500, seed=s, scale=1.0) for s in range(8)]
    whole = make_sampler(500, prompt_ids=prompt, **params)
    tokens = [sample_batch(logits, [whole]).token_ids[0] for logits in steps]
    for moved_after in (1, 3, 7):
        moved = make_sampler(500, prompt_ids=prompt, **params)
        moved.resume(tokens[:moved_after])
        rest = [sample_batch(logits, [moved]).token_ids[0] for logits in steps[moved_after:]]
        assert rest == tokens[moved_after:]
        assert moved.output_token_ids == whole.output_token_ids


def test_draws_depend_on_seed_and_position_only() -> None:
    """Seeded draws at the same position agree, whatever came before; other positions and
    other seeds draw differently."""
    logits = torch.zeros(1, 1000)
    early = make_sampler(1000, prompt_ids=(7,) * 4, seed=9)
    late = make_sampler(1000, prompt_ids=(7,) * 2, seed=9)
    late.adopt(5)
    late.adopt(6)
    assert early.position == late.position == 4
    assert sample_batch(logits, [early]).token_ids == sample_batch(logits, [late]).token_ids
    runs = [sample_batch(logits, [early]).token_ids[0] for _ in range(5)]
    assert len(set(runs)) > 1
    other = make_sampler(1000, prompt_ids=(7,) * 4, seed=10)
    first = make_sampler(1000, prompt_ids=(7,) * 4, seed=9)
    draws = [sample_batch(logits, [s]).token_ids[0] for s in (first, other)]
    assert draws[0] != draws[1]


def test_unseeded_requests_differ() -> None:
    logits = torch.zeros(2, 1000)
    samplers = [make_sampler(1000), make_sampler(1000)]
    for _ in range(5):
        sample_batch(logits, samplers)
    assert samplers[0].output_token_ids != samplers[1].output_token_ids


def test_negative_seed_is_masked_to_64_bits() -> None:
    # Seeds are int64 (the node API's type, engine/sampling_fields.py); the generator takes the
    # same 64 bits unsigned.
    assert make_sampler(1000, seed=-1).seed == 2**64 - 1
    assert make_sampler(1000, seed=-(2**63)).seed == 2**63


# --- penalties --------------------------------------------------------------------------------


def penalised(sampler: RequestSampler, logits: torch.Tensor) -> torch.Tensor:
    row = logits.clone()
    sampler.apply_penalties(row)
    return row


def test_repetition_penalty_matches_hf() -> None:
    warpers = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.tensor([2.0, -1.5, 0.0, 3.0, -0.25, 1.0])
    sampler = make_sampler(6, (0, 1, 2), repetition_penalty=1.7)
    sampler.observe(4)
    sampler.observe(4)
    seen = torch.tensor([[0, 1, 2, 4, 4]])
    expected = warpers.RepetitionPenaltyLogitsProcessor(1.7)(seen, logits.unsqueeze(0))[0]
    assert torch.equal(penalised(sampler, logits), expected)
    assert penalised(sampler, logits)[0] == pytest.approx(2.0 / 1.7)
    assert penalised(sampler, logits)[1] == pytest.approx(-1.5 * 1.7)


def test_repetition_penalty_steers_greedy_away_from_seen_token() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sample_batch(logits, [make_sampler(3, (0,), temperature=0.0)]).token_ids == [0]
    sampler = make_sampler(3, (0,), temperature=0.0, repetition_penalty=1.2)
    assert sample_batch(logits, [sampler]).token_ids == [1]
    assert sample_batch(logits, [sampler]).token_ids == [0]  # 1 is seen now too: 2/1.2 > 1.9/1.2


def test_frequency_and_presence_penalties_exact_values() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    sampler = make_sampler(4, (0, 0, 1), frequency_penalty=0.5, presence_penalty=0.25)
    for token in (2, 2, 2, 3):
        sampler.observe(token)
    # The prompt (tokens 0 and 1) is not penalised; counts are 3 for token 2 and 1 for token 3.
    expected = torch.tensor([1.0, 1.0, 1.0 - 3 * 0.5 - 0.25, 1.0 - 0.5 - 0.25])
    assert torch.equal(penalised(sampler, logits), expected)


def test_negative_penalties_encourage_repeats() -> None:
    sampler = make_sampler(3, frequency_penalty=-1.0, presence_penalty=-2.0)
    sampler.observe(1)
    assert torch.equal(penalised(sampler, torch.zeros(3)), torch.tensor([0.0, 3.0, 0.0]))


def test_penalties_are_off_by_default_and_leave_logits_untouched() -> None:
    sampler = make_sampler(5, (1, 2))
    assert not sampler.has_penalties
    logits = random_logits(1, 5, seed=4)[0]
    assert torch.equal(penalised(sampler, logits), logits)


def test_sample_batch_does_not_modify_caller_logits() -> None:
    logits = random_logits(2, 20, seed=5)
    before = logits.clone()
    samplers = [
        make_sampler(20, (1, 2), repetition_penalty=2.0, frequency_penalty=1.0, seed=1),
        make_sampler(20, temperature=0.3, top_k=4, top_p=0.5, min_p=0.1, seed=2),
    ]
    sample_batch(logits, samplers)
    assert torch.equal(logits, before)


# --- logprobs and bookkeeping -----------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_and_top_logprobs_sorted() -> None:
    logits = random_logits(3, 30, seed=6)
    samplers = [
        make_sampler(30, temperature=0.7, repetition_penalty=1.5, seed=7, top_logprobs=5),
        make_sampler(30),
        make_sampler(30, temperature=0.0, logprobs=True),
    ]
    out = sample_batch(logits, samplers)
    log_probs = logits.log_softmax(dim=-1)
    for row in (0, 2):
        logprob = out.logprobs[row]
        assert logprob is not None
        assert logprob == pytest.approx(log_probs[row, out.token_ids[row]].item(), abs=1e-6)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.top_logprobs[2] == []

    top = out.top_logprobs[0]
    assert top is not None and len(top) == 5
    values = [value for _, value in top]
    assert values == sorted(values, reverse=True)
    expected = log_probs[0].topk(5)
    assert [token for token, _ in top] == expected.indices.tolist()
    assert values == pytest.approx(expected.values.tolist(), abs=1e-6)


def test_top_logprobs_larger_than_vocab_is_clamped() -> None:
    out = sample_batch(random_logits(1, 3, seed=8), [make_sampler(3, top_logprobs=10, seed=1)])
    assert out.top_logprobs[0] is not None and len(out.top_logprobs[0]) == 3


def test_sample_batch_observes_each_row() -> None:
    samplers = [make_sampler(10, temperature=0.0), make_sampler(10, seed=3)]
    outputs: list[SampleOutput] = []
    for step in range(4):
        outputs.append(sample_batch(random_logits(2, 10, seed=step), samplers))
    for row, sampler in enumerate(samplers):
        assert sampler.output_token_ids == [out.token_ids[row] for out in outputs]


def test_a_stop_string_across_a_migration_matches() -> None:
    """The stop check reads the sampler's output, which a migrated request's resumed tokens
    are part of: a stop string half generated before the move still ends the request."""
    from engine.request import Req
    from engine.tokenizer import StopStringChecker

    class Letters:  # token id i decodes to chr(i)
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(i) for i in ids)

    params = SamplingParams(stop=("END",))
    sampler = RequestSampler(params, [ord("x")], 200, CPU)
    sampler.resume([ord("E"), ord("N")])  # generated on the node that died
    req = Req("r", [ord("x"), ord("E"), ord("N")], params, sampler)
    checker = StopStringChecker(Letters())
    assert checker(req) is None
    req.output_ids.append(ord("D"))
    sampler.observe(ord("D"))
    assert checker(req) == "END"


# --- logit_bias and min_tokens ---------------------------------------------------------------


def test_logit_bias_is_added_to_the_logits_of_every_draw() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    sampler = make_sampler(4, temperature=0.0, logit_bias={2: 1.75, 0: -100.0})
    assert sampler.params.logit_bias == ((0, -100.0), (2, 1.75))
    assert sampler.needs_processing  # not plain argmax: a CUDA graph must not pick it
    for _ in range(3):
        assert sample_batch(logits, [sampler]).token_ids == [2]
    # seeded draws see the biased distribution: a -100 bias leaves token 0 almost never drawn
    seeded = make_sampler(4, seed=7, logit_bias={0: -100.0})
    drawn = {sample_batch(logits, [seeded]).token_ids[0] for _ in range(200)}
    assert 0 not in drawn and drawn == {1, 2, 3}


def test_logit_bias_out_of_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="logit_bias must be < vocab_size 4, got 9"):
        make_sampler(4, logit_bias={9: 1.0})


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_tokens_until_reached(ignore_eos: bool) -> None:
    eos, stop = 0, 3
    logits = torch.tensor([[5.0, 1.0, 0.5, 4.0]])
    params = SamplingParams(
        temperature=0.0, min_tokens=3, stop_token_ids=(stop,), ignore_eos=ignore_eos
    )
    sampler = RequestSampler(params, (), 4, CPU, eos_ids=(eos,))
    drawn = [sample_batch(logits, [sampler]).token_ids[0] for _ in range(4)]
    # three draws may not end the request, then EOS (the best logit) is back; with ignore_eos,
    # EOS ends nothing and is never masked
    assert drawn == ([eos] * 4 if ignore_eos else [1, 1, 1, eos])
    assert not sampler.masks_ends and not sampler.needs_processing


def test_min_tokens_counts_tokens_generated_before_a_migration() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=3)
    sampler = RequestSampler(params, (5, 6), 8, CPU, eos_ids=(0,))
    sampler.resume([1, 2])  # generated on another node: one more token must not be EOS
    logits = torch.tensor([[9.0, 1.0, 0, 0, 0, 0, 0, 0]])
    assert sample_batch(logits, [sampler]).token_ids == [1]
    assert sample_batch(logits, [sampler]).token_ids == [0]
