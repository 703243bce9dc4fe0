"""Greedy output of the engine == HF transformers, token for token (fp32, CPU).

Every case runs all prompts together in one continuous batch, with chunked prefill small enough
to split prompts, twice (the second pass hits the prefix cache), with page sizes 1 and 16, and
checks the memory invariants afterwards.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.reference import hf_greedy

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


def _chat_prompts(tokenizer) -> list[list[int]]:
    questions = [
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
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for q in questions
    ]


DEFAULT_PARAMS = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_prompts_and_reference(default_model_dir):
    from transformers import AutoTokenizer

    prompts = _chat_prompts(AutoTokenizer.from_pretrained(default_model_dir))
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
