"""A random-weight llama with the default model's tokenizer: fast nodes that still speak text.

Nodes load it in a second on 2 cores; the gateway tokenizes and detokenizes with the real
SmolLM2 tokenizer, so every HTTP endpoint works. `positions` sets max_position_embeddings
(raise it for requests that must stream for a while).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def save_tiny_text_model(default_model_dir: Path, path: Path, positions: int = 1024) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    tf.LlamaForCausalLM(config).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, path / name)
    return path
