"""Tensor parallelism inside a node (engine/tp/): the head rule, refusals, and TP=1/2/3 greedy
output of the real default model (9 query heads, 3 KV heads) equal to HF transformers (fp32).

The TP ranks are real processes (spawned, gloo over loopback); rank 0 runs the scheduler.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from engine.tp.partition import TPConfigError, plan_tp
from engine.tp.workers import _rank_device
from scripts.tiny_models import hf_greedy
from tests.test_engine_correctness import chat_prompts

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
QUESTIONS = ["What is the capital of France?", "Hi", "List three prime numbers, then explain why."]


def _config(num_heads: int, num_kv_heads: int) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 49152,
            "hidden_size": 64 * num_heads,
            "intermediate_size": 1536,
            "num_hidden_layers": 2,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
        }
    )


def test_rank_devices_start_at_the_node_device() -> None:
    assert [_rank_device("cuda", r) for r in (0, 1)] == ["cuda:0", "cuda:1"]
    assert [_rank_device("cuda:2", r) for r in (0, 1)] == ["cuda:2", "cuda:3"]
    assert _rank_device("cpu", 1) == "cpu"


def test_kv_head_groups_split_unevenly_then_replicated() -> None:
    config = _config(9, 3)
    two = plan_tp(config, 2)
    assert [(list(s.kv_heads), list(s.q_heads)) for s in two] == [
        ([0, 1], [0, 1, 2, 3, 4, 5]),
        ([2], [6, 7, 8]),
    ]
    assert [len(s.intermediate) for s in two] == [768, 768]
    assert [s.vocab for s in two] == [range(0, 24576), range(24576, 49152)]
    six = plan_tp(config, 6)  # each KV head on 2 ranks, its 3 query heads split 2 + 1
    assert [list(s.kv_heads) for s in six] == [[0], [0], [1], [1], [2], [2]]
    assert [list(s.q_heads) for s in six] == [[0, 1], [2], [3, 4], [5], [6, 7], [8]]


@pytest.mark.parametrize(
    ("heads", "tp", "reason"),
    [
        ((9, 3), 4, "not a multiple of 3"),
        ((9, 3), 12, "only 3 query heads"),
        ((6, 4), 2, "query heads are not a multiple of KV heads"),
    ],
)
def test_unmappable_tp_is_refused_with_the_reason(heads, tp: int, reason: str) -> None:
    with pytest.raises(TPConfigError, match=reason):
        plan_tp(_config(*heads), tp)


def test_engine_refuses_unmappable_tp_before_spawning(default_model_dir) -> None:
    with pytest.raises(TPConfigError, match="tp_size 4 exceeds the KV heads"):
        LLM(str(default_model_dir), tp_size=4)


@pytest.fixture(scope="module")
def prompts_and_reference(default_model_dir):
    from transformers import AutoTokenizer

    prompts = chat_prompts(AutoTokenizer.from_pretrained(default_model_dir), QUESTIONS)
    return prompts, hf_greedy(default_model_dir, prompts, PARAMS.max_new_tokens)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp_size",
    [pytest.param(1, marks=pytest.mark.tp_matrix), 2, pytest.param(3, marks=pytest.mark.tp_matrix)],
)
def test_tp_colocated_matches_hf(default_model_dir, prompts_and_reference, tp_size: int) -> None:
    """Chunks small enough to split prompts; a second pass hits the prefix cache."""
    prompts, expected = prompts_and_reference
    llm = LLM(
        str(default_model_dir),
        tp_size=tp_size,
        page_size=4,
        chunked_prefill_size=24,
        max_total_tokens=2048,
    )
    ranks = llm.runner.on_shutdown.__self__.processes if tp_size > 1 else []  # TPWorkers.stop
    assert len(ranks) == tp_size - 1 and all(r.is_alive() for r in ranks)
    try:
        assert llm.runner.kv_cache.layout.num_kv_heads == llm.runner.shard.num_kv_heads
        for attempt in range(2):
            outs = llm.generate(prompts, PARAMS)
            assert [o.token_ids for o in outs] == expected
            assert (sum(o.cached_tokens for o in outs) > 0) == (attempt == 1)
            # Pages are allocated on rank 0 only; every rank's KV shard uses the same page ids.
            llm.check_integrity()
    finally:
        llm.shutdown()
    assert [r.exitcode for r in ranks] == [0] * (tp_size - 1)


def test_server_refuses_unmappable_tp_at_start(default_model_dir) -> None:
    import subprocess

    from gateway.process.launcher import console_script

    proc = subprocess.run(
        [console_script("decode-server"), "--model", str(default_model_dir), "--tp-size", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "tp_size 4 exceeds the KV heads and is not a multiple of 3" in proc.stderr + proc.stdout
