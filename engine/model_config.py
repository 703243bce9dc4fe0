"""The model's shape, read once from an HF `config.json` and frozen.

Everything downstream (models, KV pools, the bootstrap layout check) reads these fields instead of
the raw JSON, so the names of HF's config keys live in exactly one place. A mixture-of-experts
family (Qwen3-MoE, Mixtral, dots.llm1 with DeepSeek-V3's MoE) adds a `MoEConfig`, read by its
parser in `_MOE_FAMILIES`; what a family's HF code does not do, or this engine cannot, is refused
here with the config field named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# How a MoE layer picks its experts (engine/models/moe.py, ROUTERS): softmax over the router's
# logits then top-k (Qwen3-MoE, Mixtral); DeepSeek-V3's sigmoid scores with a correction bias,
# top-k within the best expert groups (its `topk_method` "noaux_tc").
SOFTMAX_TOPK = "softmax_topk"
GROUPED_SIGMOID_TOPK = "grouped_sigmoid_topk"


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
class MoEConfig:
    """The mixture-of-experts MLP of the layers in `layers` (the others keep a dense MLP of
    `ModelConfig.intermediate_size`): each token goes to `top_k` of `num_experts` routed experts,
    each a gated MLP of `intermediate_size`, weighted as `router` says; a shared gated MLP of
    `shared_intermediate_size` (0: none) sees every token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    layers: frozenset[int]
    router: str = SOFTMAX_TOPK
    norm_topk_prob: bool = True  # the top-k weights renormalised to sum to 1
    num_groups: int = 1  # grouped routing: experts in `num_groups` groups, the best
    topk_groups: int = 1  # `topk_groups` of them eligible
    routed_scaling_factor: float = 1.0  # the routed experts' weights scaled by this
    shared_intermediate_size: int = 0

    @property
    def has_correction_bias(self) -> bool:
        """DeepSeek-V3's `e_score_correction_bias`: added to the scores for the choice only."""
        return self.router == GROUPED_SIGMOID_TOPK

    def routed_parameters(self, hidden: int) -> int:
        """The routed experts' weights of one sparse layer (what expert parallelism shards)."""
        return self.num_experts * 3 * hidden * self.intermediate_size

    def num_parameters(self, hidden: int) -> int:
        """The weights of one sparse layer's MLP: experts, router, shared experts."""
        router = self.num_experts * (hidden + self.has_correction_bias)
        return self.routed_parameters(hidden) + router + 3 * hidden * self.shared_intermediate_size


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
    moe: MoEConfig | None = None  # None: every layer's MLP is dense

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
        dense_mlp = 3 * h * self.intermediate_size
        mlps = self.num_layers * dense_mlp
        if self.moe is not None:
            mlps += len(self.moe.layers) * (self.moe.num_parameters(h) - dense_mlp)
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * h + self.num_layers * (attention + 2 * h) + mlps + h

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id`'s MLP is the mixture of experts (else a dense MLP)."""
        return self.moe is not None and layer_id in self.moe.layers

    @classmethod
    def from_dict(cls, raw: dict[str, Any], model_path: str = "") -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ModelConfigError(f"{model_path or 'config'}: config.json has no 'architectures'")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            arch = str(archs[0])
            num_layers = int(raw["num_hidden_layers"])
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", _rope_param(raw, "rope_theta", 10000.0))),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch in _QK_NORM_ARCHITECTURES,
                rope_scaling=_rope_scaling(raw),
                eos_token_ids=_eos_ids(raw.get("eos_token_id")),
                model_path=model_path,
                moe=parse_moe(arch, raw, num_layers, model_path or "config"),
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


# Qwen3's attention: an RMSNorm over each head of q and k before RoPE.
_QK_NORM_ARCHITECTURES = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Dots1ForCausalLM"})


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


# ---- mixture-of-experts families -------------------------------------------------------------
def parse_moe(arch: str, raw: dict[str, Any], num_layers: int, where: str) -> MoEConfig | None:
    """The MoE side of `raw` (None: a dense family), checked; a variant the family's HF model
    does not compute, or this engine cannot, raises ModelConfigError naming the field."""
    family = _MOE_FAMILIES.get(arch)
    if family is None:
        return None
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise _unsupported(where, "hidden_act", act, "the experts are SiLU-gated MLPs ('silu')")
    moe = family(raw, num_layers, where)
    if not moe.layers:
        return None  # e.g. Qwen3-MoE with num_experts 0: HF makes every MLP dense
    _check_routing(moe, where)
    return moe


def _first(raw: dict[str, Any], *keys: str) -> Any:
    """The value of the first of `keys` that `raw` has (HF renames some keys across versions:
    transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`)."""
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    raise KeyError(keys[0])


def _qwen3_moe(raw: dict[str, Any], num_layers: int, where: str) -> MoEConfig:
    if raw.get("shared_expert_intermediate_size"):
        raise _unsupported(
            where,
            "shared_expert_intermediate_size",
            raw["shared_expert_intermediate_size"],
            "Qwen3-MoE has no shared expert (a Qwen2-MoE checkpoint needs Qwen2MoeForCausalLM, "
            "which is not served yet)",
        )
    experts = int(_first(raw, "num_experts", "num_local_experts"))
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
    sparse = (i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoEConfig(
        num_experts=experts,
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        layers=frozenset(sparse if experts > 0 else ()),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )


def _mixtral(raw: dict[str, Any], num_layers: int, where: str) -> MoEConfig:
    return MoEConfig(
        num_experts=int(raw.get("num_local_experts", 8)),
        top_k=int(raw.get("num_experts_per_tok", 2)),
        intermediate_size=int(raw["intermediate_size"]),  # Mixtral's experts are its MLPs
        layers=frozenset(range(num_layers)),
    )


def _deepseek_v3_moe(
    raw: dict[str, Any], num_layers: int, where: str, defaults: dict[str, Any] | None = None
) -> MoEConfig:
    """DeepSeek-V3's MoE as HF's DeepseekV3MoE computes it (Dots1MoE is the same); a key that
    `raw` lacks takes HF's default of the family (DeepseekV3Config's unless `defaults`)."""
    raw = {**(defaults or _DEEPSEEK_V3_DEFAULTS), **raw}
    for key, served in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(key, served) != served:
            raise _unsupported(where, key, raw[key], f"DeepSeek-V3's MoE routes by {served!r}")
    if int(raw.get("moe_layer_freq") or 1) != 1:
        raise _unsupported(
            where,
            "moe_layer_freq",
            raw["moe_layer_freq"],
            "every layer after the dense ones is sparse (1), as in HF's DeepseekV3",
        )
    inter = int(raw["moe_intermediate_size"])
    return MoEConfig(
        num_experts=int(_first(raw, "n_routed_experts", "num_local_experts")),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=inter,
        layers=frozenset(range(int(raw["first_k_dense_replace"] or 0), num_layers)),
        router=GROUPED_SIGMOID_TOPK,
        norm_topk_prob=bool(raw["norm_topk_prob"]),
        num_groups=int(raw["n_group"] or 1),
        topk_groups=int(raw["topk_group"] or 1),
        routed_scaling_factor=float(raw["routed_scaling_factor"]),
        shared_intermediate_size=inter * int(raw["n_shared_experts"] or 0),
    )


def _dots1(raw: dict[str, Any], num_layers: int, where: str) -> MoEConfig:
    """dots.llm1: Qwen3's attention, DeepSeek-V3's MoE. Unless `layer_types` says otherwise, HF
    makes the layers from `max_window_layers` on sliding-window ones (Dots1Config's defaults)."""
    window = raw.get("sliding_window", 4096)
    first_sliding = int(raw.get("max_window_layers", 62))
    derived = [
        "sliding_attention" if window and i >= first_sliding else "full_attention"
        for i in range(num_layers)
    ]
    types = raw.get("layer_types") or derived
    if any(t != "full_attention" for t in types):
        key = "layer_types" if raw.get("layer_types") else "max_window_layers"
        raise _unsupported(
            where,
            key,
            raw.get(key, first_sliding),
            "sliding-window attention layers are not served; every layer must be 'full_attention'",
        )
    return _deepseek_v3_moe(raw, num_layers, where, _DOTS1_DEFAULTS)


_DEEPSEEK_V3_DEFAULTS = {
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "n_shared_experts": 1,
}
_DOTS1_DEFAULTS = {
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 0,
    "n_shared_experts": None,  # HF's Dots1MoE needs it: a config.json states it
}

# Architecture -> its MoE parser. DeepSeek-V3's MoE side is read (and checked) here, though
# engine/models refuses the architecture until its attention (MLA) is served.
_MOE_FAMILIES = {
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "MixtralForCausalLM": _mixtral,
    "Dots1ForCausalLM": _dots1,
    "DeepseekV3ForCausalLM": _deepseek_v3_moe,
}


def _check_routing(moe: MoEConfig, where: str) -> None:
    """What the routers need of the sizes, each failure naming its field."""
    if not 0 < moe.top_k <= moe.num_experts:
        raise _unsupported(
            where, "num_experts_per_tok", moe.top_k, f"between 1 and the {moe.num_experts} experts"
        )
    if moe.router != GROUPED_SIGMOID_TOPK:
        return
    groups = moe.num_groups
    if groups < 1 or moe.num_experts % groups or moe.num_experts // groups < 2:
        raise _unsupported(
            where,
            "n_group",
            groups,
            f"a divisor of the {moe.num_experts} experts leaving at "
            "least 2 per group (a group scores as the sum of its best two)",
        )
    if not 0 < moe.topk_groups <= groups:
        raise _unsupported(where, "topk_group", moe.topk_groups, f"between 1 and n_group {groups}")
    if moe.top_k > moe.topk_groups * (moe.num_experts // groups):
        raise _unsupported(
            where,
            "num_experts_per_tok",
            moe.top_k,
            f"at most the experts of topk_group "
            f"{moe.topk_groups} groups ({moe.topk_groups * (moe.num_experts // groups)})",
        )


def _unsupported(where: str, key: str, value: Any, served: str) -> ModelConfigError:
    return ModelConfigError(
        f"{where}: config.json's {key} = {value!r} is not supported: {served}; use a checkpoint "
        "with a supported value, or serve this model with a framework that implements it"
    )
