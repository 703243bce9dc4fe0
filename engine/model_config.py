"""The model's shape, read once from an HF `config.json` and frozen.

Everything downstream (models, KV pools, the bootstrap layout check) reads these fields instead of
the raw JSON, so the names of HF's config keys live in exactly one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """The model directory or its config.json cannot be used."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; only `llama3` (and none) is implemented."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    eos_token_ids: tuple[int, ...] = ()
    model_path: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Weights of the decoder (embeddings, attention, MLP, norms; the LM head unless tied)."""
        h = self.hidden_size
        attention = 2 * h * self.q_size + 2 * h * self.kv_size
        if self.attention_bias:
            attention += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attention += 2 * self.head_dim
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * h + self.num_layers * layer + h

    @classmethod
    def from_dict(cls, raw: dict[str, Any], model_path: str = "") -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ModelConfigError(f"{model_path or 'config'}: config.json has no 'architectures'")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            arch = str(archs[0])
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", _rope_param(raw, "rope_theta", 10000.0))),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch == "Qwen3ForCausalLM",
                rope_scaling=_rope_scaling(raw),
                eos_token_ids=_eos_ids(raw.get("eos_token_id")),
                model_path=model_path,
            )
        except KeyError as exc:
            raise ModelConfigError(
                f"{model_path or 'config'}: config.json lacks required key {exc.args[0]!r}"
            ) from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelConfigError(
                f"{path}: no config.json; pass a Hugging Face model directory "
                "(config.json, *.safetensors, tokenizer files)"
            )
        raw = json.loads(cfg_file.read_text())
        gen_file = path / "generation_config.json"
        if "eos_token_id" not in raw and gen_file.is_file():
            raw["eos_token_id"] = json.loads(gen_file.read_text()).get("eos_token_id")
        return cls.from_dict(raw, str(path))


def _rope_param(raw: dict[str, Any], key: str, default: float) -> float:
    params = raw.get("rope_parameters") or {}
    return float(params.get(key, default))


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in ("default", "llama3"):
        raise ModelConfigError(
            f"rope_scaling type {rope_type!r} is not supported (default, llama3)"
        )
    if rope_type == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
