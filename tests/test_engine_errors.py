"""Bad input to the engine raises a clear error that names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.model_config import ModelConfigError


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(tiny_model_dir, tmp_path: Path) -> None:
    model = _copy(tiny_model_dir("llama"), tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPT7ForMagic"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="unknown architecture 'GPT7ForMagic'"):
        LLM(str(model), max_total_tokens=256)


def test_missing_weights(tiny_model_dir, tmp_path: Path) -> None:
    model = _copy(tiny_model_dir("llama"), tmp_path / "m")
    for f in model.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelConfigError, match="no safetensors weights"):
        LLM(str(model), max_total_tokens=256)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        LLM(str(tmp_path), max_total_tokens=256)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_weights_not_matching_config(tiny_model_dir, tmp_path: Path) -> None:
    model = _copy(tiny_model_dir("llama"), tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="does not match the weights"):
        LLM(str(model), max_total_tokens=256)


def test_prompt_longer_than_context(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), max_total_tokens=4096, context_length=64)
    with pytest.raises(ValueError, match="context length is 64"):
        llm.generate([[1] * 64], SamplingParams(max_new_tokens=4))
    out = llm.generate([[1] * 60], SamplingParams(max_new_tokens=50, temperature=0.0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    llm.check_integrity()


def test_empty_prompt_and_bad_ids(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), max_total_tokens=512)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 256]])
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[5]], SamplingParams(stop_token_ids=[999]))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -3),
        ("min_p", 2.0),
        ("max_new_tokens", 0),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 3.0),
        ("presence_penalty", float("nan")),
        ("top_logprobs", 50),
    ],
)
def test_bad_sampling_values(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"page_size": 0}, "page_size"),
        ({"dtype": "float8"}, "dtype"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"schedule_policy": "random"}, "schedule_policy"),
        ({"attention_backend": "nope"}, "attention backend"),
    ],
)
def test_bad_engine_config(tiny_model_dir, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_model_dir("llama")), max_total_tokens=256, **kwargs)
