"""Models the tests and the scripts share: tiny random-weight llamas and the HF greedy reference.

- `save_tiny_text_model` / `tiny_chat_model`: a 2-layer llama (hidden 64) with random weights
  over the default model's real tokenizer, so that nodes load in a second on 2 cores and every
  HTTP endpoint of the gateway still speaks text; `positions` sets max_position_embeddings
  (raise it for requests that must stream for a while). The chat one unties its embeddings and
  carries every tokenizer and generation file of the default model.
- `TINY_SIZES` / `tiny_sizes`: the sizes of the tests' random-weight HF models (2 layers, hidden 64,
  vocab 256), as transformers config keywords.
- `llama_config` / `write_llama_config`: config.json of a llama shape for `load_format="dummy"`:
  `SMALL_LLAMA` (4 layers, hidden 256, vocab 2,048: GPU checks) and `LLAMA3_8B` (benchmarks).
- `save_tiny_moe`: a tiny random-weight mixture-of-experts model of one of `MOE_FAMILIES`
  (Qwen3-MoE, Mixtral, dots.llm1 with DeepSeek-V3's MoE), saved in small safetensors shards.
- `hf_greedy`: HF transformers' greedy generation in fp32 (CPU, or a GPU for
  scripts/gpu/check_tp.py), the reference the engine's output is compared with.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

TINY_SIZES: dict[str, int | bool] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}  # fmt: skip


def tiny_sizes(**overrides: object) -> dict[str, Any]:
    """TINY_SIZES with `overrides`: keywords for a transformers model config."""
    return {**TINY_SIZES, **overrides}


_SMALL_SIZES = {
    "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
}  # fmt: skip


def llama_config(**sizes: float) -> dict[str, Any]:
    """A LlamaForCausalLM config.json: SMALL_LLAMA's sizes, with `sizes` overriding them."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        **_SMALL_SIZES,
        **sizes,
    }


SMALL_LLAMA = llama_config()
LLAMA3_8B = llama_config(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rope_theta=500000.0,
)  # fmt: skip


def write_llama_config(model_dir: Path, config: dict[str, object] = SMALL_LLAMA) -> Path:
    """`config` as model_dir/config.json (weights come from load_format="dummy")."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CHAT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def save_tiny_llama(
    default_model_dir: Path,
    path: Path,
    positions: int = 1024,
    *,
    tie_word_embeddings: bool = True,
    files: Sequence[str] = TEXT_FILES,
) -> Path:
    """Random weights (seed 0) over the default model's vocabulary; copies `files` from it."""
    import transformers as tf

    real = json.loads((default_model_dir / "config.json").read_text())
    config = tf.LlamaConfig(
        **tiny_sizes(
            vocab_size=real["vocab_size"],
            max_position_embeddings=positions,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=real.get("bos_token_id"),
            eos_token_id=real.get("eos_token_id"),
        )
    )
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).eval().save_pretrained(path)
    for name in files:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, path / name)
    return path


def save_tiny_text_model(default_model_dir: Path, path: Path, positions: int = 1024) -> Path:
    return save_tiny_llama(default_model_dir, path, positions)


def tiny_chat_model(default_model_dir: Path, path: Path, max_positions: int = 1024) -> Path:
    return save_tiny_llama(
        default_model_dir, path, max_positions, tie_word_embeddings=False, files=CHAT_FILES
    )


# family -> (transformers config class, its keywords beyond tiny_sizes). 8 experts, top-2,
# weights drawn 5x wider than HF's default (0.1, not 0.02), so that the experts and the routing
# decide the greedy tokens: a wrong expert, weight or renormalisation changes them.
MOE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", {
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "num_hidden_layers": 3, "mlp_only_layers": [1],
    }),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "dots1": ("Dots1Config", {
        "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "num_hidden_layers": 3,
    }),
}  # fmt: skip
_MOE_ARCHITECTURES = {"qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral", "dots1": "Dots1"}


def save_tiny_moe(
    path: Path, family: str, seed: int = 0, shard_size: str = "100KB", **overrides: Any
) -> Path:
    """A random-weight `family` model (MOE_FAMILIES, with `overrides` to its config keywords)
    saved with HF's checkpoint names in shards of `shard_size`. DeepSeek's router bias, zero
    when HF initialises it, is drawn in [-0.2, 0.2] so that it changes which experts win."""
    import transformers as tf

    config_cls, keywords = MOE_FAMILIES[family]
    sizes = tiny_sizes(initializer_range=0.1, **{**keywords, **overrides})
    config = getattr(tf, config_cls)(**sizes)
    torch.manual_seed(seed)
    model = getattr(tf, f"{_MOE_ARCHITECTURES[family]}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.2, 0.2)
    model.save_pretrained(path, max_shard_size=shard_size)
    return path


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu"
) -> list[list[int]]:
    """HF transformers greedy generation in fp32: prompts of similar lengths together, left
    padded with an attention mask as HF batches them (`length_buckets`). One prompt at a time,
    each decode step read the whole model for one token: a CPU spent 150 ms a step on the
    default model, and the suite minutes on its references."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()  # type: ignore[arg-type]
    outs: dict[int, list[int]] = {}
    with torch.inference_mode():
        for bucket in length_buckets([len(p) for p in prompts]):
            width = max(len(prompts[i]) for i in bucket)
            ids = torch.zeros(len(bucket), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(bucket):
                ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]) :] = 1
            gen = model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            for row, i in enumerate(bucket):
                outs[i] = gen[row, width:].tolist()
    return [outs[i] for i in range(len(prompts))]


def length_buckets(
    lengths: Sequence[int], max_padding: float = 0.25, slack: int = 32
) -> list[list[int]]:
    """Indices of `lengths` in groups of similar length, shortest first: a group grows while its
    padding stays within `max_padding` of its tokens or `slack` tokens."""
    buckets: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if buckets:
            padded = lengths[i] * (len(buckets[-1]) + 1)
            if padded - (tokens + lengths[i]) <= max(slack, max_padding * padded):
                buckets[-1].append(i)
                tokens += lengths[i]
                continue
        buckets.append([i])
        tokens = lengths[i]
    return buckets
