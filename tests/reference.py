"""Reference outputs from HF transformers (fp32; CPU, or a GPU for scripts/gpu/check_tp.py)."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu"
) -> list[list[int]]:
    """HF transformers greedy generation, one prompt at a time (no padding), fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()  # type: ignore[arg-type]
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs
