"""Shared fixtures: tiny random-weight HF models on disk and the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from scripts.tiny_models import save_tiny_text_model, tiny_sizes

# The machines running the suite are small and shared: never fail a property test on speed.
settings.register_profile("pdserve", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pdserve")


def _save_tiny(arch: str, path: Path) -> Path:
    import transformers as tf

    common = tiny_sizes()
    torch.manual_seed(0)
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=16))
    else:
        raise ValueError(arch)
    model.eval().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_model_dir('qwen3') -> directory of a saved random-weight HF model."""
    cache: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = _save_tiny(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from engine.model_fetch import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def tiny_text_model(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights, the default model's tokenizer: nodes start and run fast, text round-trips."""
    return save_tiny_text_model(default_model_dir, tmp_path_factory.mktemp("tiny-text") / "tiny")


@pytest.fixture(scope="session")
def long_context_model(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama allowed 65536 positions: same weights and outputs, but a long prompt takes
    many chunks and a request with a huge max_new_tokens never finishes during a test."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("tiny-llama-long") / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 65536
    (path / "config.json").write_text(json.dumps(config))
    return path
