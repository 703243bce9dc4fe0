"""bench_serving's multi-turn pieces: the conversation workload, the Mooncake trace reader, trace
arrivals, and the per-turn TTFT and cache-hit report (best rate the workload allows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.arrivals import LoadConfig, schedule
from planner.datasets import DatasetConfig, DatasetError, build_sessions, load_mooncake
from planner.metrics import RequestTrace
from scripts.serving.client import request_body
from scripts.serving.report import best_cached, cache_summary, turn_table


def test_conversation_sessions_share_one_system_prompt() -> None:
    config = DatasetConfig(
        "conversation", 4, turns=6, input_len=16, output_len=8, system_len=100, think_s=0.5
    )
    sessions = build_sessions(config)
    assert len(sessions) == 4 and {len(s.turns) for s in sessions} == {6}
    assert len({s.system for s in sessions}) == 1 and len(sessions[0].system.split()) == 100
    assert all(s.think_s == 0.5 for s in sessions)
    # Only a first turn reuses what others computed: the system prompt, not for session 0.
    assert [s.turns[0].reusable_tokens for s in sessions] == [0, 100, 100, 100]
    assert {t.reusable_tokens for s in sessions for t in s.turns[1:]} == {0}
    path, body = request_body(_client(), sessions[1].turns[2], [], sessions[1].system)
    assert path == "/v1/chat/completions"
    assert body["messages"][0] == {"role": "system", "content": sessions[1].system}


def _client():  # type: ignore[no-untyped-def]
    from scripts.serving.client import ClientConfig

    return ClientConfig("http://127.0.0.1:1", "m", True, 0.0, 10.0)


def _trace_file(tmp_path: Path, lines: list[object]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_mooncake_equal_hash_ids_are_equal_token_blocks(tmp_path: Path) -> None:
    path = _trace_file(
        tmp_path,
        [
            {"timestamp": 1500, "input_length": 10, "output_length": 3, "hash_ids": [7, 9, 4]},
            {"timestamp": 1000, "input_length": 9, "output_length": 2, "hash_ids": [7, 8, 5]},
            {"timestamp": 2250, "input_length": 12, "output_length": 1, "hash_ids": [7, 8]},
        ],
    )
    sessions = build_sessions(DatasetConfig("mooncake", 3, path=path, mooncake_block_size=4))
    prompts = [s.turns[0].prompt for s in sessions]
    assert [len(p) for p in prompts] == [9, 10, 12]  # timestamp order; longer than its blocks
    assert [s.arrival_s for s in sessions] == [0.0, 0.5, 1.25]
    assert prompts[0][:4] == prompts[1][:4] == prompts[2][:4]  # hash 7
    assert prompts[0][4:8] == prompts[2][4:8] != prompts[1][4:8]  # hash 8, not 9
    assert [s.turns[0].reusable_tokens for s in sessions] == [0, 4, 8]
    assert [s.turns[0].output_len for s in sessions] == [2, 3, 1]
    load = LoadConfig(num_sessions=2)
    assert schedule(sessions, load) == [0.0, 0.5]  # the trace's own arrivals


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"timestamp": 1, "input_length": 4}, "not a Mooncake trace record"),
        ({"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}, ">= 1"),
        ("just text", "not a Mooncake trace record"),
    ],
)
def test_not_a_mooncake_trace_is_refused(tmp_path: Path, line: object, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        load_mooncake(_trace_file(tmp_path, [line]))


def _trace(session: int, turn: int, prompt: int, output: int, cached: int, reusable: int = 0):  # type: ignore[no-untyped-def]
    trace = RequestTrace(sent=float(turn), chunks=[turn + 0.1 * (session + 1)], done=turn + 0.5)
    trace.session, trace.turn = session, turn
    trace.prompt_tokens, trace.output_tokens = prompt, output
    trace.cached_tokens, trace.reusable_tokens = cached, reusable
    return trace


def test_best_hit_is_the_shared_prefix_or_the_previous_turn_in_whole_blocks() -> None:
    traces = [
        _trace(0, 0, 120, 10, 0),
        _trace(1, 0, 120, 10, 96, reusable=100),
        _trace(0, 1, 150, 10, 128),
        _trace(1, 1, 150, 10, 0),
    ]
    assert best_cached(traces, 16) == [0, 96, 128, 128]
    cache = cache_summary(traces, 16)
    assert (cache.prompt_tokens, cache.cached_tokens, cache.best_tokens) == (540, 224, 352)
    table = turn_table(traces, 16).splitlines()
    assert table[2].startswith("| 1 | 2 | ") and table[2].endswith("| 240 | 40.0% | 40.0% |")
    assert table[3].endswith("| 300 | 42.7% | 85.3% |")
    assert table[4].startswith("| all | 4 |")


def test_conversation_run_against_a_real_cluster(tmp_path: Path, tiny_text_model: Path) -> None:
    """The conversation workload through a real 1P1D pd-cluster (tiny llama, real tokenizer):
    every turn completes, the server's cached_tokens reach the report, and the follow-up turns
    find their history in a cache (the per-turn table and the JSON's cache figures)."""
    from tests.test_bench_serving import cluster_url, run_against

    with cluster_url(tmp_path, tiny_text_model, prefill=1, max_total_tokens=8192) as url:
        printed, doc = run_against(
            url, tmp_path / "out.json", "--dataset", "conversation", "--num-prompts", "2",
            "--multiturn-turns", "3", "--conversation-system-len", "200",
            "--random-input-len", "20", "--random-output-len", "8", "--ignore-eos",
            "--max-concurrency", "1",
            # No pause between turns: each is routed before the nodes' KV events of the
            # last one arrive, on the blocks the gateway expects (prefix_index.py).
        )  # fmt: skip
    assert "| turn | requests | TTFT p50 ms" in printed
    assert doc["summary"]["completed"] == 6
    later = [r for r in doc["requests"] if r["turn"] > 0]
    assert all(r["cached_tokens"] > 0 for r in later), later
    # Session 2's first turn finds the system prompt the first session left in a cache.
    second = [r for r in doc["requests"] if r["session"] == 1 and r["turn"] == 0]
    assert second[0]["cached_tokens"] >= 192 and second[0]["reusable_tokens"] == 200
    assert 0 < doc["cache"]["hit_rate"] <= doc["cache"]["best_rate"] < 1
