"""Builders and fixture factories shared by several test modules."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.config import RoutingConfig
from gateway.dispatch.pd_client import PDResult
from gateway.process.launcher import PDTrio
from proto import node_pb2
from scripts.tiny_models import hf_greedy, save_tiny_moe


def routing_config(
    prefill_policy: str, decode_policy: str, local_prefill_max_tokens: int
) -> RoutingConfig:
    """The routing knobs of the policy unit tests: 3 tries, 5 s cooldown, 4-token prefix blocks."""
    return RoutingConfig(
        prefill_policy=prefill_policy,
        decode_policy=decode_policy,
        local_prefill_max_tokens=local_prefill_max_tokens,
        max_attempts=3,
        node_cooldown_s=5.0,
        prefix_block_tokens=4,
        prefix_max_blocks=1000,
        prefix_balance_slack=2,
    )


def greedy_reference_fixtures(lengths: list[int], seed: int, max_new: int) -> tuple[Any, Any]:
    """Module fixtures `prompts` (random token ids, one prompt per length, seeded) and
    `hf_reference` (HF greedy output of each on the default model, `max_new` tokens)."""

    @pytest.fixture(scope="module")
    def prompts() -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in lengths]

    @pytest.fixture(scope="module")
    def hf_reference(default_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
        return hf_greedy(default_model_dir, prompts, max_new)

    return prompts, hf_reference


def moe_fixtures(
    variants: dict[str, tuple[str, dict[str, Any]]], prompts: list[list[int]], max_new: int
) -> tuple[Any, Any]:
    """Module fixtures over tiny MoE models (scripts/tiny_models.py `save_tiny_moe`):
    `moe_model(variant)`, the directory of `variants[variant]` = (family, overrides of its
    keywords), and `hf_reference(variant)`, HF's greedy tokens for `prompts` (`max_new` each);
    each made once per module."""

    @pytest.fixture(scope="module")
    def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
        cache: dict[str, Path] = {}

        def make(variant: str) -> Path:
            if variant not in cache:
                family, overrides = variants[variant]
                path = tmp_path_factory.mktemp(f"moe-{variant}")
                cache[variant] = save_tiny_moe(path, family, **overrides)
            return cache[variant]

        return make

    @pytest.fixture(scope="module")
    def hf_reference(moe_model: Any) -> Any:
        cache: dict[str, list[list[int]]] = {}

        def reference(variant: str) -> list[list[int]]:
            if variant not in cache:
                cache[variant] = hf_greedy(moe_model(variant), prompts, max_new)
            return cache[variant]

        return reference

    return moe_model, hf_reference


def terminate(process: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds; reaps it."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def generate_as_reference(
    trio: PDTrio,
    prompts: list[list[int]],
    sampling: node_pb2.SamplingParams,
    reference: list[list[int]],
) -> list[PDResult]:
    """Runs the prompts through the pair: each one finished, its prefill sent pages, and the
    tokens equal `reference`."""
    results = trio.generate_many(prompts, sampling)
    for result in results:
        assert result.finished is not None, result.prefill_error
        assert result.prefill is not None and result.prefill.sent_pages > 0
    assert [r.token_ids for r in results] == reference
    return results


def colocated_on_decode_node(
    cluster: PDTrio, prompts: list[list[int]], sampling: node_pb2.SamplingParams
) -> list[list[int]]:
    """The same decode node, requests without a room: it prefills locally."""
    import asyncio

    import grpc

    from gateway.dispatch.pd_client import pd_generate
    from gateway.routing.nodes import NodeTarget
    from proto import node_pb2_grpc

    async def run() -> list[list[int]]:
        async with grpc.aio.insecure_channel(cluster.decode.address) as chan:
            target = NodeTarget(cluster.decode_id, node_pb2_grpc.NodeStub(chan))
            results = await asyncio.gather(
                *(pd_generate(target, None, p, sampling) for p in prompts)
            )
        return [r.token_ids for r in results]

    return asyncio.run(run())
