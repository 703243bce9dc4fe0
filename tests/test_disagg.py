"""Prefill/decode disaggregation end to end: real bootstrap, prefill and decode processes on
127.0.0.1 with a real transfer engine (Mooncake over TCP, NIXL over UCX).

Greedy output through the pair equals the decode node prefilling locally (colocated) and HF
transformers, token for token, and so does seeded sampling through the pair and colocated;
afterwards neither node holds a page.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.process.launcher import pd_trio
from proto import node_pb2
from tests.helpers import (
    colocated_on_decode_node,
    generate_as_reference,
    greedy_reference_fixtures,
)

# Within a page (5, 12), whole pages (64, 128), odd pages (30, 90), exactly one chunk (128) and
# three chunks whose last one ends mid-page (300 at 128 and at 125 tokens a chunk): every case
# of the old 16-length ladder (4,930 tokens) in 629 tokens, which the suite's slowest tests
# prefill up to four times over on the real model.
LENGTHS = [5, 12, 30, 64, 90, 128, 300]
CHUNK = 128
MAX_NEW = 6
GREEDY = node_pb2.SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
NODE_ARGS = ["--max-total-tokens", "16384", "--page-size", "16"]


prompts, hf_reference = greedy_reference_fixtures(LENGTHS, seed=7, max_new=MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_pd_matches_colocated_and_hf(
    tmp_path: Path, default_model_dir: Path, prompts, hf_reference, backend: str
) -> None:
    with pd_trio(
        tmp_path,
        default_model_dir,
        backend,
        node_args=NODE_ARGS,
        prefill_args=["--chunked-prefill-size", str(CHUNK)],
    ) as cluster:
        results = cluster.generate_many(prompts, GREEDY)
        for result in results:
            assert result.finished is not None, result.prefill_error
            assert result.finished.finish_reason == "length", result.finished.detail
            assert result.prefill is not None and result.prefill.sent_pages > 0
        pd_tokens = [r.token_ids for r in results]
        assert pd_tokens == hf_reference
        if backend == "mooncake":  # the node path is the same for both backends
            assert colocated_on_decode_node(cluster, prompts, GREEDY) == hf_reference
            # Seeded sampling: D continues the stream P started with the first token.
            seeded = node_pb2.SamplingParams(
                max_new_tokens=MAX_NEW, temperature=0.9, seed=11, ignore_eos=True
            )
            few = prompts[::5]
            pd_seeded = [r.token_ids for r in cluster.generate_many(few, seeded)]
            assert pd_seeded == colocated_on_decode_node(cluster, few, seeded)
        # Coalescing: each request's pages go in a few descriptors, not one per page.
        long = results[-1].prefill
        assert long is not None and long.descriptors < long.sent_pages
        cluster.check_no_leaks()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "groups", "chunk", "decode_tp"),
    [
        ("mooncake", 2, CHUNK, 1),  # 30 layers in 2 groups, chunks of whole pages
        ("nixl", 4, CHUNK - 3, 3),  # 8+8+7+7 layers; chunks end mid-page; D's 3 ranks (head runs)
    ],
)
def test_pd_streaming_kv_by_layer_group_matches_hf(
    tmp_path: Path,
    default_model_dir: Path,
    prompts,
    hf_reference,
    backend: str,
    groups: int,
    chunk: int,
    decode_tp: int,
) -> None:
    """`--kv-stream-layers G`: each chunk's pages leave layer group by layer group during the
    forward. Greedy output equals HF; a second round, the prompts in P's prefix cache, streams
    the cached pages too; no page leaks on either node."""
    with pd_trio(
        tmp_path,
        default_model_dir,
        backend,
        node_args=NODE_ARGS,
        prefill_args=["--chunked-prefill-size", str(chunk), "--kv-stream-layers", str(groups)],
        decode_args=["--tp-size", str(decode_tp)],
    ) as cluster:
        for _ in range(2):
            results = generate_as_reference(cluster, prompts, GREEDY, hf_reference)
        # Every page's layers went once per group: at least one range per group and page.
        long = results[-1].prefill
        assert long is not None and long.descriptors >= groups * long.sent_pages
        cluster.check_no_leaks()
