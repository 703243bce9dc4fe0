"""Tensor parallelism on GPUs (NCCL): greedy output of TP=1 and TP=2 equals HF transformers.

    PYTHONUNBUFFERED=1 python3 -m scripts.gpu.check_tp

Needs 2 GPUs, torch and transformers (the GPU image has both). The model is a random-weight
Llama with SmolLM2-135M's head shape (9 query heads, 3 KV heads of 64 dims: TP=2 splits the KV
heads 2 + 1) and 4 layers, fp32, so the comparison is token for token. Both attention backends.

Not run yet: on 2026-11-23 only single-GPU machines were lent (NCCL needs one GPU per rank), so
the NCCL path is exercised by nothing but this script; CPU TP (gloo) is tested in tests/test_tp*.py.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from scripts.gpu.environment import gpu_defaults
from scripts.tiny_models import hf_greedy, tiny_sizes


def tiny_model(path: Path) -> Path:
    import transformers as tf

    config = tf.LlamaConfig(
        **tiny_sizes(
            vocab_size=2048,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
    )
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    gpu_defaults()  # before the ranks start: they inherit it
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print("GPUs:", torch.cuda.device_count())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 2048, (n,), generator=gen).tolist() for n in (5, 37, 200)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        expected = hf_greedy(model, prompts, params.max_new_tokens, device="cuda")
        for backend in ("torch_native", "triton"):
            for tp in (1, 2):
                started = time.perf_counter()
                llm = LLM(
                    str(model),
                    tp_size=tp,
                    device="cuda",
                    attention_backend=backend,
                    page_size=16,
                    chunked_prefill_size=64,
                    max_total_tokens=4096,
                )
                try:
                    got = [o.token_ids for o in llm.generate(prompts, params)]
                    llm.check_integrity()
                finally:
                    llm.shutdown()
                ok = got == expected
                failures += not ok
                print(
                    f"{backend} TP={tp}: {'equal to HF' if ok else f'DIFFERS {got} vs {expected}'}"
                    f" ({time.perf_counter() - started:.1f} s)"
                )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
