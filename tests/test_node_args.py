"""Node flags that size things: --mem-fraction leaves room for this rank's weights."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from engine.model_config import ModelConfig
from engine.node.args import add_node_args, engine_config
from scripts.tiny_models import LLAMA3_8B, write_llama_config


def node_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    return parser.parse_args(list(argv))


def test_parameter_count_of_known_shapes(default_model_dir: Path) -> None:
    assert ModelConfig.from_dir(default_model_dir).num_parameters == 134_515_008  # SmolLM2-135M
    assert ModelConfig.from_dict(LLAMA3_8B).num_parameters == 8_030_261_248  # Llama-3-8B


def test_mem_fraction_leaves_room_for_the_weights(tmp_path: Path) -> None:
    model = str(write_llama_config(tmp_path, LLAMA3_8B))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mc = ModelConfig.from_dir(model)
    weights, per_token = mc.num_parameters * 2, mc.num_layers * 2 * mc.kv_size * 2
    fraction = min(0.9, (weights + 4096 * per_token) / memory)  # the weights and 4k tokens
    if weights + 4096 * per_token > 0.9 * memory:
        pytest.skip("this machine cannot hold 8B bf16 weights in 90% of its memory")
    config = engine_config(node_args("--dtype", "bfloat16", "--mem-fraction", str(fraction)), model)
    assert abs(config.max_total_tokens - 4096) <= 1
    tp2 = node_args("--dtype", "bfloat16", "--mem-fraction", str(fraction), "--tp-size", "2")
    assert engine_config(tp2, model).max_total_tokens > 2 * 4096  # half the weights per rank
    too_little = str(weights / 2 / memory)  # half the weights
    with pytest.raises(ValueError, match=r"leaves no room for KV after 15\.0 GiB of weights"):
        engine_config(node_args("--dtype", "bfloat16", "--mem-fraction", too_little), model)


def test_kv_staging_pages_come_out_of_the_memory_fraction(tmp_path: Path) -> None:
    model = str(write_llama_config(tmp_path, LLAMA3_8B))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mc = ModelConfig.from_dir(model)
    weights, per_token = mc.num_parameters * 2, mc.num_layers * 2 * mc.kv_size * 2
    if weights + 4096 * per_token > 0.9 * memory:
        pytest.skip("this machine cannot hold 8B bf16 weights in 90% of its memory")
    fraction = str((weights + 4096 * per_token) / memory)  # the weights and 4k tokens
    staged = node_args(
        "--dtype", "bfloat16", "--mem-fraction", fraction, "--kv-staging-pages", "64"
    )
    config = engine_config(staged, model)
    assert abs(config.max_total_tokens - (4096 - 64 * 16)) <= 1
    assert config.kv_staging_pages == 64 and config.kv_staging_min_runs == 16
    too_many = node_args(
        "--mem-fraction", fraction, "--dtype", "bfloat16", "--kv-staging-pages", "256"
    )
    with pytest.raises(ValueError, match="--kv-staging-pages 256 leaves no KV pool"):
        engine_config(too_many, model)
    with pytest.raises(ValueError, match="kv_staging_pages needs tp_size 1"):
        engine_config(node_args("--kv-staging-pages", "8", "--tp-size", "2"), model)
