"""scripts/serving/bench_serving.py: metrics on hand-made traces, dataset generators, arrivals,
bad input.

The metric tests build `RequestTrace`s with chosen timestamps and check TTFT / ITL / TPOT / E2E,
percentiles, throughput and goodput against values worked out by hand. The CLI tests run the
script as a user would and check the exit code and a one-line message (no traceback).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.ports import free_port
from planner.arrivals import LoadConfig, LoadError, arrival_gaps
from planner.datasets import (
    DatasetConfig,
    DatasetError,
    build_sessions,
    build_shapes,
    load_sharegpt,
)
from planner.metrics import SLO, RequestTrace, SLOError, percentile, summarize
from scripts.serving.client import parse_server_timing
from scripts.serving.report import document, table, throughput_series, timing_table

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ("-m", "scripts.serving.bench_serving")  # run from ROOT


def trace(
    sent: float, chunks: list[float], tokens: int | None = None, **kw: object
) -> RequestTrace:
    done = kw.pop("done", chunks[-1] if chunks else sent)
    out = len(chunks) if tokens is None else tokens
    return RequestTrace(sent=sent, chunks=chunks, done=done, output_tokens=out, **kw)  # type: ignore[arg-type]


# -- metrics on hand-made traces ----------------------------------------------------------------


def test_one_trace_ttft_itl_tpot_e2e() -> None:
    t = trace(1.0, [1.5, 1.7, 2.0], done=2.1)
    assert t.ttft == pytest.approx(0.5)
    assert t.itls == pytest.approx([0.2, 0.3])
    assert t.e2e == pytest.approx(1.1)
    assert t.tpot == pytest.approx((1.1 - 0.5) / 2)


def test_tpot_counts_tokens_not_chunks() -> None:
    # 2 chunks carrying 5 tokens (a server that batches tokens per chunk).
    t = trace(0.0, [1.0, 3.0], tokens=5)
    assert t.tpot == pytest.approx((3.0 - 1.0) / 4)
    assert trace(0.0, [1.0]).tpot is None  # one token: no TPOT


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 100) == 4.0
    rng = np.random.default_rng(1)
    sample = list(rng.random(37))
    for q in (1, 50, 90, 99):
        assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))


def hand_made_run() -> list[RequestTrace]:
    return [
        trace(0.0, [0.1, 0.3, 0.5], prompt_tokens=10),  # TTFT 100, TPOT 200, E2E 500
        trace(1.0, [1.4, 1.5, 1.6], prompt_tokens=20),  # TTFT 400, TPOT 100, E2E 600
        trace(2.0, [3.0, 3.2, 3.4], prompt_tokens=30),  # TTFT 1000, TPOT 200, E2E 1400
        trace(3.0, [3.2], prompt_tokens=40),  # TTFT 200, no TPOT, E2E 200
        trace(4.0, [], error="http_503", done=4.1),
    ]


def test_summary_figures() -> None:
    s = summarize(hand_made_run(), duration_s=5.0, slo=SLO())
    assert (s.completed, s.failed, s.errors) == (4, 1, {"http_503": 1})
    assert s.request_throughput == pytest.approx(4 / 5)
    assert s.input_tokens == 100 and s.output_tokens == 10
    assert s.output_token_throughput == pytest.approx(2.0)
    assert s.total_token_throughput == pytest.approx(110 / 5)
    assert s.ttft_ms.mean == pytest.approx((100 + 400 + 1000 + 200) / 4)
    assert s.ttft_ms.median == pytest.approx(300)
    assert s.ttft_ms.max == pytest.approx(1000)
    assert s.tpot_ms.count == 3 and s.tpot_ms.median == pytest.approx(200)
    assert s.itl_ms.count == 6
    assert s.itl_ms.mean == pytest.approx((200 + 200 + 100 + 100 + 200 + 200) / 6)
    assert s.e2e_ms.p90 == pytest.approx(percentile([500, 600, 1400, 200], 90))
    assert s.goodput is None and s.slo_attainment is None


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        (SLO(ttft_ms=500), 3),  # the 1000 ms TTFT misses; the failure never counts
        (SLO(tpot_ms=150), 2),  # only the 100 ms TPOT and the one-token request (no TPOT)
        (SLO(e2e_ms=650), 3),
        (SLO(ttft_ms=500, tpot_ms=150, e2e_ms=650), 2),
        (SLO(ttft_ms=50), 0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slo: SLO, good: int) -> None:
    s = summarize(hand_made_run(), duration_s=4.0, slo=slo)
    assert s.goodput == pytest.approx(good / 4.0)
    assert s.slo_attainment == pytest.approx(good / 5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttft_ms": -1.0}, "--slo-ttft-ms must be a positive"),
        ({"tpot_ms": 0.0}, "--slo-tpot-ms must be a positive"),
        ({"e2e_ms": math.nan}, "--slo-e2e-ms must be a positive"),
        ({"ttft_ms": 500.0, "e2e_ms": 100.0}, "below --slo-ttft-ms"),
    ],
)
def test_nonsensical_slos_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(SLOError, match=message):
        SLO(**kwargs)


def test_report_table_and_json_carry_every_figure() -> None:
    traces = hand_made_run()
    s = summarize(traces, 5.0, SLO(ttft_ms=500))
    text = table(s, "hand-made")
    assert "Goodput (req/s)" in text and "errors: http_503" in text and "p99 TPOT" in text
    doc = json.loads(json.dumps(document(s, traces, {"request_rate": math.inf})))
    assert doc["settings"]["request_rate"] == "inf"
    assert doc["summary"]["ttft_ms"]["max"] == pytest.approx(1000)
    assert doc["requests"][0]["ttft"] == pytest.approx(0.1)
    assert len(doc["requests"]) == 5


def test_throughput_series_buckets_tokens_and_completions() -> None:
    seconds, tokens, requests = throughput_series(hand_made_run()[:4])
    assert seconds == [0.0, 1.0, 2.0, 3.0]
    assert sum(tokens) == pytest.approx(10)
    assert requests == [1.0, 1.0, 0.0, 2.0]


def test_plots_are_written(tmp_path: Path) -> None:
    from planner.splits import Split
    from scripts.planning.sweep import RatePoint, SplitResult, plot_goodput
    from scripts.serving.report import plot

    paths = plot(hand_made_run(), tmp_path, "t_")
    assert sorted(p.name for p in paths) == [
        "t_latency_cdf.png",
        "t_latency_over_time.png",
        "t_throughput_over_time.png",
    ]
    summary = summarize(hand_made_run(), 5.0, SLO(ttft_ms=500))
    plot_goodput([SplitResult(Split(1, 1), [RatePoint(1.0, summary)])], tmp_path / "g.png", "g")
    assert all(p.stat().st_size > 1000 for p in [*paths, tmp_path / "g.png"])


# -- datasets -----------------------------------------------------------------------------------


def test_random_lengths_within_bounds_and_ids_in_range() -> None:
    config = DatasetConfig("random", 200, input_len=100, output_len=20, range_ratio=0.5)
    sessions = build_sessions(config)
    assert len(sessions) == 200
    for s in sessions:
        (spec,) = s.turns
        assert isinstance(spec.prompt, tuple) and len(spec.prompt) == spec.prompt_len
        assert 50 <= spec.prompt_len <= 150 and 10 <= spec.output_len <= 30
        assert all(1000 <= t < 10000 for t in spec.prompt)
    ins = {s.turns[0].prompt_len for s in sessions}
    assert min(ins) < 70 and max(ins) > 130  # the range is used, not just its middle


def test_fixed_lengths_with_range_ratio_zero() -> None:
    sessions = build_sessions(DatasetConfig("random", 20, input_len=64, output_len=8))
    assert {(s.turns[0].prompt_len, s.turns[0].output_len) for s in sessions} == {(64, 8)}


@pytest.mark.parametrize("name", ["random", "prefix", "multiturn"])
def test_same_seed_same_workload_other_seed_other_workload(name: str) -> None:
    a = build_sessions(DatasetConfig(name, 12, seed=7, range_ratio=0.3))
    b = build_sessions(DatasetConfig(name, 12, seed=7, range_ratio=0.3))
    c = build_sessions(DatasetConfig(name, 12, seed=8, range_ratio=0.3))
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    "config",
    [
        DatasetConfig("random", 300, seed=7, input_len=200, output_len=30, range_ratio=0.3),
        DatasetConfig("random", 40, input_len=64, output_len=8),
        DatasetConfig(
            "prefix",
            301,
            seed=3,
            input_len=50,
            prefix_len=100,
            range_ratio=0.4,
            prefix_group_size=7,
        ),
        DatasetConfig("prefix", 32, input_len=16, prefix_len=64, prefix_group_size=4),
    ],
)
def test_shapes_without_prompts_are_the_sessions_lengths(config: DatasetConfig) -> None:
    """The planner takes a random or prefix workload's lengths without making its prompts
    (planner/datasets.py `SHAPES`): the sessions' lengths and groups, in their order."""
    sessions = build_sessions(config)
    expected = [(s.turns[0].prompt_len, s.turns[0].output_len, s.group) for s in sessions]
    assert build_shapes(config) == expected


def test_prefix_groups_share_their_prefix() -> None:
    config = DatasetConfig("prefix", 10, input_len=16, prefix_len=64, prefix_group_size=4)
    sessions = build_sessions(config)
    by_group: dict[int, list[tuple[int, ...]]] = {}
    for s in sessions:
        prompt = s.turns[0].prompt
        assert isinstance(prompt, tuple) and len(prompt) == 64 + 16
        by_group.setdefault(s.group, []).append(prompt)
    assert sorted(len(v) for v in by_group.values()) == [3, 3, 4]
    prefixes = {g: {p[:64] for p in prompts} for g, prompts in by_group.items()}
    assert all(len(p) == 1 for p in prefixes.values())  # one prefix per group
    assert len({next(iter(p)) for p in prefixes.values()}) == 3  # and they differ


def test_multiturn_conversations() -> None:
    sessions = build_sessions(DatasetConfig("multiturn", 5, turns=4, input_len=20))
    assert all(len(s.turns) == 4 and all(t.chat for t in s.turns) for s in sessions)
    first = sessions[0].turns[0]
    assert isinstance(first.prompt, str) and len(first.prompt.split()) == 20


def write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj))
    return path


def test_sharegpt_reads_first_exchange(tmp_path: Path) -> None:
    data = [
        {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "x" * 40}]},
        {"conversations": [{"from": "gpt", "value": "starts with gpt"}]},  # skipped
        {"id": 3},  # skipped
    ]
    path = write(tmp_path / "sg.json", data)
    assert load_sharegpt(path) == [("Hi?", "x" * 40)]
    sessions = build_sessions(DatasetConfig("sharegpt", 3, path=path))
    assert [s.turns[0].output_len for s in sessions] == [10, 10, 10]  # 40 chars ~ 10 tokens
    fixed = build_sessions(DatasetConfig("sharegpt", 1, path=path, sharegpt_output_len=7))
    assert fixed[0].turns[0].output_len == 7


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"conversations": []}', "expected a list of conversations"),
        ('[{"text": "hello"}]', "none of its 1 entries"),
        ("not json at all", "is not a JSON file"),
    ],
)
def test_not_sharegpt_is_refused(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_sharegpt(path)


def test_bad_dataset_options() -> None:
    with pytest.raises(DatasetError, match="--random-range-ratio"):
        DatasetConfig("random", 1, range_ratio=1.5)
    with pytest.raises(DatasetError, match="needs --dataset-path"):
        DatasetConfig("sharegpt", 1)
    with pytest.raises(DatasetError, match="--input-len must be >= 1"):
        DatasetConfig("random", 1, input_len=0)


# -- arrivals -----------------------------------------------------------------------------------


def test_poisson_gaps_have_the_rate_as_mean() -> None:
    rng = np.random.default_rng(0)
    gaps = arrival_gaps(4.0, 1.0, rng)
    sample = [next(gaps) for _ in range(20000)]
    assert np.mean(sample) == pytest.approx(0.25, rel=0.03)
    assert np.std(sample) == pytest.approx(0.25, rel=0.05)  # exponential: std == mean


def test_burstiness_keeps_the_mean_and_changes_the_spread() -> None:
    bursty = arrival_gaps(2.0, 0.25, np.random.default_rng(0))
    regular = arrival_gaps(2.0, 4.0, np.random.default_rng(0))
    b = [next(bursty) for _ in range(20000)]
    r = [next(regular) for _ in range(20000)]
    assert np.mean(b) == pytest.approx(0.5, rel=0.05) and np.mean(r) == pytest.approx(0.5, rel=0.05)
    # gamma(k, scale): cv = 1 / sqrt(k)
    assert np.std(b) / np.mean(b) == pytest.approx(2.0, rel=0.1)
    assert np.std(r) / np.mean(r) == pytest.approx(0.5, rel=0.1)
    inf = arrival_gaps(math.inf, 1.0, np.random.default_rng(0))
    assert [next(inf) for _ in range(3)] == [0.0, 0.0, 0.0]


def test_bad_load_options() -> None:
    with pytest.raises(LoadError, match="--request-rate must be > 0"):
        LoadConfig(request_rate=0)
    with pytest.raises(LoadError, match="exactly one of --num-prompts and --duration"):
        LoadConfig(num_sessions=10, duration_s=5)
    with pytest.raises(LoadError, match="--max-concurrency must be >= 1"):
        LoadConfig(max_concurrency=0)


# -- the command line on bad input --------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *SCRIPT, "--no-progress", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_base_url_that_does_not_answer() -> None:
    result = run_cli("--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2")
    assert result.returncode == 3
    assert "cannot connect to http://127.0.0.1:" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_file_that_is_not_sharegpt(tmp_path: Path) -> None:
    path = write(tmp_path / "x.json", {"hello": "world"})
    result = run_cli(
        "--base-url", "http://127.0.0.1:1", "--dataset", "sharegpt", "--dataset-path", str(path)
    )
    assert result.returncode == 2
    assert "is not ShareGPT JSON" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--slo-ttft-ms", "2000", "--slo-e2e-ms", "500"], "below --slo-ttft-ms"),
        (["--slo-tpot-ms", "-5"], "--slo-tpot-ms must be a positive"),
        (["--request-rate", "-1"], "--request-rate must be > 0"),
    ],
)
def test_cli_nonsensical_flags(flags: list[str], message: str) -> None:
    result = run_cli("--base-url", "http://127.0.0.1:1", *flags)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


# -- one real run -------------------------------------------------------------------------------


@contextmanager
def cluster_url(tmp_path: Path, model: Path, prefill: int, max_total_tokens: int) -> Iterator[str]:
    """A real pd-cluster (Mooncake, `prefill` prefill nodes, one decode node) for the test's
    length; its gateway URL. Its output goes to tmp_path / cluster.out, its logs to logs/."""
    import threading

    from gateway.process.cluster import Cluster, ClusterConfig

    config = ClusterConfig(
        prefill=prefill,
        decode=1,
        backend="mooncake",
        model=str(model),
        port=0,
        max_total_tokens=max_total_tokens,
        log_dir=tmp_path / "logs",
    )
    with (tmp_path / "cluster.out").open("w") as out:
        cluster = Cluster(config, out=out)
        try:
            yield cluster.start(threading.Event())
        finally:
            cluster.stop()


def run_against(url: str, out: Path, *args: str) -> tuple[str, dict[str, Any]]:
    """The script run on `url` with `args`, its JSON written to `out`: what it printed and that
    JSON, once it exited 0 with no request failed."""
    result = run_cli("--base-url", url, *args, "--output-file", str(out))
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(out.read_text())
    assert doc["summary"]["failed"] == 0
    return result.stdout, doc


@pytest.mark.slow
def test_cli_against_a_real_colocated_cluster(tmp_path: Path, default_model_dir: Path) -> None:
    """A few requests through a real pd-cluster (one colocated node): exact lengths, JSON."""
    with cluster_url(tmp_path, default_model_dir, prefill=0, max_total_tokens=4096) as url:
        printed, doc = run_against(
            url, tmp_path / "out.json", "--num-prompts", "3", "--random-input-len", "24",
            "--random-output-len", "4", "--ignore-eos", "--request-rate", "inf",
            "--slo-ttft-ms", "60000",
        )  # fmt: skip
    assert "Successful requests" in printed
    assert doc["summary"]["completed"] == 3
    assert [r["output_tokens"] for r in doc["requests"]] == [4, 4, 4]
    assert [r["prompt_tokens"] for r in doc["requests"]] == [24, 24, 24]
    assert all(len(r["chunks"]) >= 1 and r["ttft"] > 0 for r in doc["requests"])
    # The gateway's breakdown of each request arrives and is printed per segment.
    assert all(r["timing_ms"]["e2e"] > 0 and "decode_first" in r["timing_ms"]
               for r in doc["requests"])  # fmt: skip
    assert "Server-side breakdown of 3 requests" in printed
    assert "| prefill_queue |" in printed


def test_server_timing_parsed_and_tabled() -> None:
    parsed = parse_server_timing("gateway_queue;dur=1.5, prefill;dur=30, odd, bad;dur=x")
    assert parsed == {"gateway_queue": 1.5, "prefill": 30.0}
    traces = [
        RequestTrace(sent=0.0, chunks=[0.1], done=0.2,
                     timing_ms={"gateway_queue": 10.0, "prefill": 30.0, "e2e": 200.0}),
        RequestTrace(sent=0.0, chunks=[0.1], done=0.2,
                     timing_ms={"gateway_queue": 30.0, "prefill": 30.0, "e2e": 220.0}),
    ]  # fmt: skip
    text = timing_table(traces)
    assert "| gateway_queue | 20.0 | 30.0 | 30.0 | 40% |" in text  # 40 of the 100 ms before TTFT
    assert "| prefill | 30.0 | 30.0 | 30.0 | 60% |" in text
    assert "| e2e | 210.0 |" in text
    assert timing_table([RequestTrace(sent=0.0, chunks=[0.1], done=0.2)]) == ""
