"""Greedy output of the engine == HF transformers, token for token (fp32, CPU).

Every case runs all prompts together in one continuous batch, with chunked prefill small enough
to split prompts, twice (the second pass hits the prefix cache), with page sizes 1 and 16, and
checks the memory invariants afterwards.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from scripts.tiny_models import hf_greedy, tiny_sizes

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def _run_twice(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    runs = []
    for attempt in range(2):
        outs = llm.generate(prompts, params)
        llm.check_integrity()
        runs.append([o.token_ids for o in outs])
        cached = sum(o.cached_tokens for o in outs)
        assert (cached > 0) == (attempt == 1), f"pass {attempt}: {cached} cached tokens"
    return runs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_models_match_hf(tiny_model_dir, arch: str, page_size: int) -> None:
    model_dir = tiny_model_dir(arch)
    gen = torch.Generator().manual_seed(1)
    lengths = [3, 17, 40, 5, 64, 33, 9, 100]
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]
    expected = hf_greedy(model_dir, prompts, GREEDY.max_new_tokens)
    llm = LLM(str(model_dir), page_size=page_size, chunked_prefill_size=48, max_total_tokens=4096)
    for run in _run_twice(llm, prompts, GREEDY):
        assert run == expected


def test_equal_length_prompts_batched_together_match_hf(tiny_model_dir) -> None:
    """Consecutive fresh prompts of one length attend as one batch (torch_native's fresh runs)."""
    model_dir = tiny_model_dir("llama")
    gen = torch.Generator().manual_seed(2)
    lengths = [12, 12, 12, 30, 30, 7, 40, 7, 7]
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]
    expected = hf_greedy(model_dir, prompts, GREEDY.max_new_tokens)
    llm = LLM(str(model_dir), page_size=16, chunked_prefill_size=512, max_total_tokens=4096)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    llm.check_integrity()


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat in the model's template, as token ids (also test_tp)."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for q in questions
    ]


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "Explain in detail how a transformer language model turns a prompt into text, "
    "covering tokenisation, embeddings, attention layers, the KV cache and sampling. " * 3,
    "List three prime numbers.",
    "Translate 'good morning' into Spanish and German.",
    "What does a CPU do? Answer in two sentences. " * 6,
    "Why is the sky blue?",
]


DEFAULT_PARAMS = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_prompts_and_reference(default_model_dir):
    from transformers import AutoTokenizer

    prompts = chat_prompts(AutoTokenizer.from_pretrained(default_model_dir), CHAT_QUESTIONS)
    return prompts, hf_greedy(default_model_dir, prompts, DEFAULT_PARAMS.max_new_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_default_model_matches_hf(
    default_model_dir, chat_prompts_and_reference, page_size: int
) -> None:
    prompts, expected = chat_prompts_and_reference
    assert max(len(p) for p in prompts) > 96 and min(len(p) for p in prompts) < 40
    llm = LLM(str(default_model_dir), page_size=page_size, chunked_prefill_size=96)
    for run in _run_twice(llm, prompts, DEFAULT_PARAMS):
        assert run == expected


@pytest.mark.slow
def test_default_model_answers_paris(default_model_dir) -> None:
    llm = LLM(str(default_model_dir))
    out = llm.chat(
        [[{"role": "user", "content": "What is the capital of France?"}]],
        SamplingParams(max_new_tokens=24, temperature=0.0),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_llama3_rope_scaling_and_sharded_checkpoint(tmp_path) -> None:
    """Llama-3 style RoPE scaling and a sharded safetensors index load and match HF."""
    import transformers as tf

    config = tf.LlamaConfig(
        **tiny_sizes(
            max_position_embeddings=2048,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            tie_word_embeddings=True,
        )
    )
    torch.manual_seed(3)
    tf.LlamaForCausalLM(config).eval().save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (300, 700)]
    expected = hf_greedy(tmp_path, prompts, 8)
    llm = LLM(str(tmp_path), page_size=16, chunked_prefill_size=256, max_total_tokens=4096)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def test_lpm_policy_and_retraction_keep_outputs(tiny_model_dir) -> None:
    """Longest-prefix-match scheduling and a KV pool small enough to force retraction change
    the order of work, never the tokens."""
    model_dir = tiny_model_dir("llama")
    gen = torch.Generator().manual_seed(9)
    base = torch.randint(1, 256, (48,), generator=gen).tolist()
    prompts = [base[: 16 + 8 * (i % 4)] + [i + 1] * (i % 5 + 1) for i in range(12)]
    expected = hf_greedy(model_dir, prompts, 24)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    lpm = LLM(str(model_dir), page_size=4, max_total_tokens=4096, schedule_policy="lpm")
    assert [o.token_ids for o in lpm.generate(prompts, params)] == expected
    small = LLM(str(model_dir), page_size=4, max_total_tokens=160, chunked_prefill_size=64)
    assert [o.token_ids for o in small.generate(prompts, params)] == expected
    assert small.scheduler.num_retractions > 0
    small.check_integrity()
