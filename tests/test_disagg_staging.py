"""PD end to end with staging pages forced on (`--kv-staging-min-runs 0`: every write of a
room that finds a free span is gathered on the prefill node and scattered on the decode node):
real bootstrap, prefill and decode processes on 127.0.0.1 over Mooncake and NIXL.

Greedy output equals HF transformers token for token, with few staging pages so that
concurrent rooms also fall back to their pool pages; with injected write failures the rooms that
succeed still match and the failed ones leave nothing behind. Afterwards each node's integrity
check (which includes the staging invariant: every held span owned by a live request) passes
with no page in use.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from engine.ports import free_port
from gateway.process.launcher import pd_trio
from proto import node_pb2
from scripts.tiny_models import hf_greedy

LENGTHS = [3, 4, 9, 17, 40, 77, 130, 250]  # 1 to 63 four-token pages; 250 needs > 24 pages
MAX_NEW = 5
STAGING = ["--kv-staging-pages", "24", "--kv-staging-min-runs", "0"]
NODE_ARGS = ["--page-size", "4", "--max-total-tokens", "2048", *STAGING]
SERVER_ENV = {"OMP_NUM_THREADS": "1"}


def prompts() -> list[list[int]]:
    return [[(i * 37 + k * 11) % 250 + 1 for k in range(n)] for i, n in enumerate(LENGTHS)]


def greedy() -> node_pb2.SamplingParams:
    return node_pb2.SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return hf_greedy(tiny_model_dir("llama"), prompts(), MAX_NEW)


def staged_pages(metrics_port: int, role: str) -> float:
    """The node's pdserve_{role}_staged_pages_total from its /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    name = f"pdserve_{role}_staged_pages_total "
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_staged_transfers_match_hf_and_leak_nothing(
    tmp_path: Path, tiny_model_dir, reference, backend: str
) -> None:  # type: ignore[no-untyped-def]
    p_metrics, d_metrics = free_port(), free_port()
    with pd_trio(
        tmp_path,
        tiny_model_dir("llama"),
        backend,
        node_args=NODE_ARGS,
        prefill_args=["--chunked-prefill-size", "32", "--metrics-port", str(p_metrics)],
        decode_args=["--metrics-port", str(d_metrics)],
        env=SERVER_ENV,
    ) as cluster:
        one_by_one = [cluster.generate(p, greedy()) for p in prompts()]
        together = cluster.generate_many(prompts(), greedy())  # spans run out: some fall back
        for result in one_by_one + together:
            assert result.finished is not None, result.prefill_error
            assert result.finished.finish_reason == "length", result.finished.detail
        assert [r.token_ids for r in one_by_one] == reference
        assert [r.token_ids for r in together] == reference
        cluster.check_no_leaks()
        # one by one, every room but the 63-page one had a span on both sides
        fit = sum(-(-n // 4) for n in LENGTHS if -(-n // 4) <= 24)
        assert staged_pages(p_metrics, "prefill") >= fit
        assert staged_pages(d_metrics, "decode") >= fit


def test_failed_staged_writes_leak_nothing(tmp_path: Path, tiny_model_dir, reference) -> None:  # type: ignore[no-untyped-def]
    with pd_trio(
        tmp_path,
        tiny_model_dir("llama"),
        "mooncake",
        node_args=NODE_ARGS,
        prefill_args=["--chunked-prefill-size", "32", "--inject-transfer-failures", "0.4"],
        env=SERVER_ENV,
    ) as cluster:
        results = cluster.generate_many(prompts() * 2, greedy())
        failed = 0
        for result, expected in zip(results, reference * 2, strict=True):
            if result.finished is not None and result.finished.finish_reason == "length":
                assert result.token_ids == expected
            else:  # the room failed mid-transfer: P says so (its span and pages freed too)
                assert "KV write to the decode node failed" in result.prefill_error, result
                failed += 1
        assert 0 < failed < len(results)
        cluster.check_no_leaks()
