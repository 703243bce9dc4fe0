"""Mixture-of-experts models (engine/models/moe.py, moe_llama.py): Qwen3-MoE, Mixtral and
dots.llm1 (Qwen3's attention with DeepSeek-V3's MoE) greedy output equal to HF transformers
(fp32, CPU), token for token: in process, over two TP ranks, through a prefill/decode pair and
through `pd-cluster`. The DeepSeek-V3 MoE layer itself is also compared with HF's
`DeepseekV3MoE` on random inputs (DeepSeek-V3's attention, MLA, is not served yet).

The tiny models (scripts/tiny_models.py `save_tiny_moe`: 8 experts, top-2 or top-3, weights
wide enough that a wrong expert or weight changes the tokens) are saved in small safetensors
shards under HF's checkpoint names, so every test also loads per-expert tensors across shards.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig, ModelConfigError
from engine.models.expert_compute import grouped_experts
from engine.models.moe import SparseMoEBlock
from engine.tp.partition import TPConfigError, full_shard, plan_tp
from scripts.tiny_models import CHAT_FILES, hf_greedy, save_tiny_moe
from tests.helpers import moe_fixtures

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
LENGTHS = [3, 17, 40, 5, 64, 33]

# Model variants: (family, overrides of its MOE_FAMILIES keywords).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # norm_topk_prob on; layer 1 dense through mlp_only_layers
    "qwen3_moe": ("qwen3_moe", {}),
    # norm_topk_prob off, top-3; decoder_sparse_step 2: only layer 1 sparse
    "qwen3_moe_unnormed": (
        "qwen3_moe",
        {"norm_topk_prob": False, "num_experts_per_tok": 3, "mlp_only_layers": [],
         "decoder_sparse_step": 2},
    ),
    "mixtral": ("mixtral", {}),
    # 4 groups of 2 experts, 2 kept; one shared expert; layer 0 dense; scaled by 2.5
    "dots1": ("dots1", {}),
    # norm_topk_prob off, top-3 from 1 of 2 groups, two shared experts, every layer sparse
    "dots1_unnormed": (
        "dots1",
        {"norm_topk_prob": False, "num_experts_per_tok": 3, "n_group": 2, "topk_group": 1,
         "n_shared_experts": 2, "first_k_dense_replace": 0, "routed_scaling_factor": 1.5},
    ),
}  # fmt: skip


def _prompts(seed: int = 1, lengths: list[int] = LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lengths]


# moe_model(variant): its directory; hf_reference(variant): HF's greedy tokens for _prompts().
moe_model, hf_reference = moe_fixtures(VARIANTS, _prompts(), GREEDY.max_new_tokens)


# ---- (a, b) each family in process, loaded from HF's sharded checkpoint ----------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_family_matches_hf(moe_model, hf_reference, variant: str) -> None:
    """Chunks split prompts; the second pass hits the prefix cache; experts come from several
    shards and are stacked at load ([E, 2I, H] and [E, H, I] parameters, no module per expert)."""
    model_dir = moe_model(variant)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    expert_files = {f for name, f in index["weight_map"].items() if ".experts." in name}
    assert len(expert_files) > 1
    llm = LLM(str(model_dir), page_size=16, chunked_prefill_size=48, max_total_tokens=4096)
    config = ModelConfig.from_dir(model_dir)
    assert config.moe is not None
    for layer_id, layer in enumerate(llm.runner.model.layers):
        assert isinstance(layer.mlp, SparseMoEBlock) == config.is_sparse_layer(layer_id)
        if isinstance(layer.mlp, SparseMoEBlock):
            experts, inter, hidden = config.moe.num_experts, config.moe.intermediate_size, 64
            assert layer.mlp.experts.w13.shape == (experts, 2 * inter, hidden)
            assert layer.mlp.experts.w2.shape == (experts, hidden, inter)
    for attempt in range(2):
        outs = llm.generate(_prompts(), GREEDY)
        assert [o.token_ids for o in outs] == hf_reference(variant)
        assert (sum(o.cached_tokens for o in outs) > 0) == (attempt == 1)
        llm.check_integrity()


@pytest.mark.parametrize("variant", ["qwen3_moe_unnormed", "mixtral", "dots1"])
def test_num_parameters_and_sparse_layers_are_hfs(moe_model, variant: str) -> None:
    """What the memory planner counts (engine/node/args.py) is every tensor of the checkpoint;
    the sparse layers are those where HF built a MoE block."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model_dir = moe_model(variant)
    config = ModelConfig.from_dir(model_dir)
    stored = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                stored += torch.Size(handle.get_slice(key).get_shape()).numel()
    assert config.num_parameters == stored
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    sparse = {i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")}
    assert config.moe is not None and config.moe.layers == sparse
    assert len(sparse) < config.num_layers or variant != "dots1"


def test_bf16_model_keeps_the_deepseek_router_in_fp32(moe_model) -> None:
    """As HF's `_keep_in_fp32_modules_strict`: the router's weight and correction bias stay
    fp32 in a 16-bit model (the bias decides close choices); the experts are bf16."""
    llm = LLM(str(moe_model("dots1")), dtype="bfloat16", max_total_tokens=512)
    block = llm.runner.model.layers[1].mlp
    assert block.gate.weight.dtype == block.gate.e_score_correction_bias.dtype == torch.float32
    assert block.experts.w13.dtype == block.experts.w2.dtype == torch.bfloat16
    out = llm.generate(_prompts(lengths=[9]), GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_new_tokens


def test_checkpoint_missing_an_expert_is_refused(moe_model, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(moe_model("qwen3_moe"), tmp_path / "model")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    shard = model_dir / index["weight_map"][name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ModelConfigError, match=r"lacks 1 tensors.*experts\.w13 expert 5 part 1"):
        LLM(str(model_dir), max_total_tokens=256)


# ---- (c) the CPU expert compute --------------------------------------------------------------
class _CountLinears(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += func is F.linear
        return func(*args, **(kwargs or {}))


def _per_token_experts(x, w13, w2, weights, ids) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gate, up = (w13[ids[t, k]] @ x[t]).chunk(2)
            out[t] += weights[t, k] * (w2[ids[t, k]] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_grouped_experts_equal_a_per_token_loop_without_one(tokens: int) -> None:
    """Two GEMMs per expert that received tokens, whatever the number of tokens."""
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 8, 16, 12, 3
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / 4
    w2 = torch.randn(experts, hidden, inter, generator=gen) / 4
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=-1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=gen)
    with _CountLinears() as count:
        got = grouped_experts(x, w13, w2, weights, ids)
    assert count.calls == 2 * len(ids.unique())
    torch.testing.assert_close(got, _per_token_experts(x, w13, w2, weights, ids))


# ---- the MoE layer against HF's modules, same weights, random inputs -------------------------
def _hf_block(kind: str, norm: bool):
    """(HF's MoE block with random weights, its config as a config.json dict)."""
    import transformers as tf

    common = {"hidden_size": 32, "num_experts_per_tok": 3, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 64}  # fmt: skip
    if kind == "deepseek_v3":
        config = tf.DeepseekV3Config(
            **common, n_routed_experts=16, moe_intermediate_size=8, n_shared_experts=2,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=norm,
            first_k_dense_replace=1,
        )  # fmt: skip
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as cls
    elif kind == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **common, num_experts=16, moe_intermediate_size=8, norm_topk_prob=norm
        )
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock as cls,
        )
    else:
        config = tf.MixtralConfig(**common, num_local_experts=16, intermediate_size=8)
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as cls
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    torch.manual_seed(5)
    block = cls(config).eval()
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.uniform_(-0.5, 0.5)
    return block, config.to_dict()


def _engine_block(hf_block, raw: dict[str, Any]) -> SparseMoEBlock:
    config = ModelConfig.from_dict(raw)
    assert config.moe is not None
    block = SparseMoEBlock(config.moe, config.hidden_size, full_shard(config))
    hf = hf_block.state_dict()
    ours = {
        "gate.weight": hf["gate.weight"],
        "experts.w13": hf["experts.gate_up_proj"],  # HF stacks them too: gate rows, then up
        "experts.w2": hf["experts.down_proj"],
    }
    if "gate.e_score_correction_bias" in hf:
        ours["gate.e_score_correction_bias"] = hf["gate.e_score_correction_bias"]
        shared = "shared_experts.{}_proj.weight"
        gate_up = [hf[shared.format("gate")], hf[shared.format("up")]]
        ours["shared_experts.gate_up_proj.weight"] = torch.cat(gate_up)
        ours["shared_experts.down_proj.weight"] = hf[shared.format("down")]
    block.load_state_dict(ours, strict=True)
    return block.eval()


@pytest.mark.parametrize(
    ("kind", "norm"),
    [("deepseek_v3", True), ("deepseek_v3", False), ("qwen3_moe", True), ("qwen3_moe", False),
     ("mixtral", True)],
)  # fmt: skip
def test_moe_layer_matches_hf_module(kind: str, norm: bool) -> None:
    """The block built from the HF config's config.json equals HF's MoE module (for DeepSeek-V3,
    `DeepseekV3MoE`: grouped sigmoid routing with the correction bias, shared experts): the same
    experts with the same weights, and outputs equal to fp32 rounding."""
    hf_block, raw = _hf_block(kind, norm)
    block = _engine_block(hf_block, raw)
    x = torch.randn(1, 97, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf_block(x)[0]
        hf_routing = hf_block.gate(x[0])
        weights, ids = block.gate(x[0])
        got = block(x[0])
    hf_weights, hf_ids = hf_routing[1].float(), hf_routing[2]
    order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if kind == "deepseek_v3":  # the group limit and the bias decided some tokens' experts
        scores = F.linear(x[0], block.gate.weight).sigmoid()
        plain = scores.topk(3, dim=-1)[1].sort(dim=-1)[0]
        assert not torch.equal(plain, ids.sort(dim=-1)[0])


# ---- (f) refusals at start --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("variant", "change", "field"),
    [
        ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ("dots1", {"scoring_func": "softmax"}, "scoring_func"),
        ("dots1", {"topk_method": "group_limited_greedy"}, "topk_method"),
        ("dots1", {"n_group": 3}, "n_group"),
        ("dots1", {"topk_group": 5}, "topk_group"),
        ("dots1", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
         "layer_types"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
        ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
)  # fmt: skip
def test_unsupported_moe_config_is_refused_naming_the_field(
    moe_model, tmp_path: Path, variant: str, change: dict[str, Any], field: str
) -> None:
    raw = json.loads((moe_model(variant) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ModelConfigError, match=f"config.json's {field} = "):
        LLM(str(tmp_path))


def test_deepseek_v3_is_refused_until_mla_lands(tmp_path: Path) -> None:
    import transformers as tf

    config = tf.DeepseekV3Config(vocab_size=64, hidden_size=32, num_hidden_layers=4)
    config.architectures = ["DeepseekV3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert ModelConfig.from_dir(tmp_path).moe is not None  # its MoE side parses
    with pytest.raises(ModelConfigError, match="unknown architecture 'DeepseekV3ForCausalLM'"):
        LLM(str(tmp_path))


def test_server_refuses_an_unsupported_moe_config_at_start(moe_model, tmp_path: Path) -> None:
    import subprocess

    from gateway.process.launcher import console_script

    raw = json.loads((moe_model("dots1") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "topk_method": "greedy"}))
    proc = subprocess.run(
        [console_script("decode-server"), "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "config.json's topk_method = 'greedy' is not supported" in proc.stderr + proc.stdout


# ---- (d) tensor parallelism -------------------------------------------------------------------
def test_tp_splits_each_experts_rows_and_refuses_too_few(moe_model) -> None:
    raw = json.loads((moe_model("dots1") / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    shards = plan_tp(config, 2)
    assert [s.expert_intermediate for s in shards] == [range(0, 16), range(16, 32)]
    assert [s.shared_intermediate for s in shards] == [range(0, 16), range(16, 32)]
    assert [s.intermediate for s in shards] == [range(0, 64), range(64, 128)]  # dense layer 0
    narrow = ModelConfig.from_dict({**raw, "moe_intermediate_size": 1})
    with pytest.raises(TPConfigError, match="expert intermediate size 1 is smaller than tp_size 2"):
        plan_tp(narrow, 2)


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral", "dots1"])
def test_tp2_matches_hf(moe_model, hf_reference, variant: str) -> None:
    """Each rank holds its rows of every expert and of the shared experts (gloo, 2 processes)."""
    model_dir = moe_model(variant)
    moe = ModelConfig.from_dir(model_dir).moe
    assert moe is not None
    llm = LLM(
        str(model_dir),
        tp_size=2,
        page_size=4,
        chunked_prefill_size=24,
        max_total_tokens=2048,
    )
    try:
        rank_rows = llm.runner.model.layers[-1].mlp.experts.w2.shape[-1]
        assert rank_rows == moe.intermediate_size // 2
        assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == hf_reference(variant)
        llm.check_integrity()
    finally:
        llm.shutdown()


# ---- (e) prefill/decode disaggregation ----------------------------------------------------------
@pytest.mark.parametrize(
    ("variant", "backend"),
    [("qwen3_moe", "mooncake"), ("qwen3_moe", "nixl"), ("mixtral", "mooncake"), ("dots1", "nixl")],
)
def test_pd_matches_colocated_and_hf(
    tmp_path: Path, moe_model, hf_reference, variant: str, backend: str
) -> None:
    """P prefills in chunks that split prompts and pushes the KV pages to D, which decodes;
    D alone (no room: it prefills locally) gives the same tokens; no page leaks."""
    from gateway.process.launcher import pd_trio
    from proto import node_pb2
    from tests.helpers import colocated_on_decode_node, generate_as_reference

    greedy = node_pb2.SamplingParams(
        max_new_tokens=GREEDY.max_new_tokens, temperature=0.0, ignore_eos=True
    )
    with pd_trio(
        tmp_path,
        moe_model(variant),
        backend,
        node_args=["--max-total-tokens", "4096", "--page-size", "16"],
        prefill_args=["--chunked-prefill-size", "32"],
    ) as cluster:
        generate_as_reference(cluster, _prompts(), greedy, hf_reference(variant))
        assert colocated_on_decode_node(cluster, _prompts(), greedy) == hf_reference(variant)
        cluster.check_no_leaks()


# ---- (g) pd-cluster and the OpenAI client -------------------------------------------------------
def test_pd_cluster_serves_qwen3_moe_to_the_openai_client(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """`pd-cluster --prefill 1 --decode 1 --model DIR` on a tiny Qwen3-MoE over the default
    model's tokenizer: chat and completion, streamed and not, equal HF's greedy text."""
    import openai
    from transformers import AutoTokenizer

    from tests.test_gateway import pd_cluster_process

    real = json.loads((default_model_dir / "config.json").read_text())
    model_dir = save_tiny_moe(
        tmp_path / "tiny-qwen3-moe",
        "qwen3_moe",
        vocab_size=real["vocab_size"],
        bos_token_id=real.get("bos_token_id"),
        eos_token_id=real.get("eos_token_id"),
    )
    for name in CHAT_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, model_dir / name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = "The capital of France is"
    chat_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    max_tokens = 12
    expected = [
        tokenizer.decode(_until(out, tokenizer.eos_token_id), skip_special_tokens=True)
        for out in hf_greedy(model_dir, [chat_ids, tokenizer.encode(prompt)], max_tokens)
    ]
    assert all(expected), expected
    gateway_args = ["--local-prefill-max-tokens", "0"]  # every prompt through P -> D
    log = tmp_path / "pd-cluster.log"
    with pd_cluster_process(log, model_dir, "mooncake", gateway_args=gateway_args) as cluster:
        client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
        chat = dict(model=model_dir.name, messages=messages, max_tokens=max_tokens, temperature=0)
        whole = client.chat.completions.create(**chat).choices[0].message.content
        streamed = client.chat.completions.create(**chat, stream=True)
        assert [whole, "".join(c.choices[0].delta.content or "" for c in streamed)] == [
            expected[0],
            expected[0],
        ]
        completion = dict(model=model_dir.name, prompt=prompt, max_tokens=max_tokens, temperature=0)
        text = client.completions.create(**completion).choices[0].text
        pieces = [c.choices[0].text for c in client.completions.create(**completion, stream=True)]
        assert [text, "".join(pieces)] == [expected[1], expected[1]]
        assert len(pieces) > 2  # really streamed


def _until(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
