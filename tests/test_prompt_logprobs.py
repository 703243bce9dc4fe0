"""Prompt logprobs in the engine == HF transformers' log_softmax over the same prompt (fp32).

Every position after the first is computed whatever splits the prompt: chunked prefill, a
batch shared with other requests, a prefix already in the cache (recomputed, not skipped), and a
request that asks for them beside one that does not.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams


def _hf_prompt_logprobs(model_dir, prompt: list[int], top: int) -> list[tuple[float, list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    log_probs = logits.log_softmax(dim=-1)
    out = []
    for pos in range(1, len(prompt)):
        row = log_probs[pos - 1]
        out.append((row[prompt[pos]].item(), row.topk(top).indices.tolist()))
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_logprobs_match_hf(tiny_model_dir, page_size: int) -> None:
    model_dir = tiny_model_dir("llama")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (2, 9, 40, 23)]
    llm = LLM(str(model_dir), page_size=page_size, chunked_prefill_size=8, max_total_tokens=4096)
    warm = llm.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0))
    assert all(o.prompt_logprobs is None for o in warm)
    params = [
        SamplingParams(max_new_tokens=3, temperature=0, prompt_logprobs=top) for top in (0, 3, 5, 1)
    ]
    outs = llm.generate([*prompts, prompts[2]], [*params, SamplingParams(max_new_tokens=2)])
    llm.check_integrity()
    assert outs[-1].prompt_logprobs is None
    for prompt, p, out in zip(prompts, params, outs, strict=False):
        assert out.cached_tokens == 0  # the warm prefix was recomputed, not skipped
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        expected = _hf_prompt_logprobs(model_dir, prompt, 5)
        for entry, (logprob, top_ids) in zip(got[1:], expected, strict=True):
            assert entry is not None
            assert entry.logprob == pytest.approx(logprob, abs=1e-4)
            assert [t for t, _ in entry.top] == top_ids[: p.prompt_logprobs or 0]


def test_prompt_logprobs_are_range_checked() -> None:
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)
