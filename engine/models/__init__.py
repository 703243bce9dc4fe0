"""Model architectures, chosen by a registry from `config.json`'s `architectures`.

Imports are lazy: the registry maps a name to `module:class`, so adding an architecture costs
nothing until a model of that kind is loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from torch import nn

from engine.model_config import ModelConfig, ModelConfigError

if TYPE_CHECKING:
    from engine.tp.group import TPGroup
    from engine.tp.partition import TPShard

MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "engine.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "engine.models.llama:Qwen3ForCausalLM",
    # Mixture of experts (engine/models/moe.py), their sparse layers read from config.json by
    # engine/model_config.py's MoE families.
    "Qwen3MoeForCausalLM": "engine.models.moe_llama:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "engine.models.moe_llama:MixtralForCausalLM",
    "Dots1ForCausalLM": "engine.models.moe_llama:Dots1ForCausalLM",
}


def model_class(architecture: str) -> type[nn.Module]:
    target = MODEL_REGISTRY.get(architecture)
    if target is None:
        raise ModelConfigError(
            f"unknown architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    module_name, cls_name = target.split(":")
    cls: type[nn.Module] = getattr(importlib.import_module(module_name), cls_name)
    return cls


def build_model(
    config: ModelConfig, shard: TPShard | None = None, group: TPGroup | None = None
) -> nn.Module:
    """The model, or one tensor-parallel rank's `shard` of it (None: the whole model)."""
    cls = model_class(config.architecture)
    if shard is None and group is None:
        return cls(config)
    return cls(config, shard, group)  # type: ignore[call-arg]
