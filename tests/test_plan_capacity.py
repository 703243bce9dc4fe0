"""scripts/planning/plan_capacity.py's simulator on cases with closed-form answers, and its
pieces."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.arrivals import LoadConfig, arrival_gaps
from planner.capacity import (
    Comparison,
    arrivals,
    comparison_table,
    max_rate,
    workload_from_settings,
)
from planner.datasets import DatasetConfig
from planner.metrics import SLO, summarize
from planner.profile import HostMismatch, NodeProfile, ProfileError, fit_prefill, this_host
from planner.simulator import Arrival, HostConfig, Simulation
from planner.splits import Split, SplitError, parse_splits
from scripts.planning.plan_capacity import main as plan_capacity
from scripts.planning.sweep import SplitResult, best_split, parse_rates

S = 0.2  # seconds: prefill of one 100-token prompt (0.05 + 0.0015 * 100)
D0 = 0.03  # seconds per decode step, whatever the batch


def profile(**overrides: object) -> NodeProfile:
    base: dict[str, object] = dict(
        prefill_coef=(0.05, 0.0015, 0.0),
        decode_coef=(D0, 0.0, 0.0),
        kv_bytes_per_token=1000,
        transfer_bytes_per_s=1e6,  # 100 tokens -> 0.1 s
        handoff_s=0.01,
        gateway_s=0.0,
        chunked_prefill_size=100,  # one 100-token prompt per step
    )
    base.update(overrides)
    return NodeProfile(**base)  # type: ignore[arg-type]


def test_prefill_cost_of_a_step() -> None:
    p = profile(prefill_coef=(0.1, 0.001, 1e-6))
    assert p.prefill_s([]) == 0.0
    assert p.prefill_s([(100, 0)]) == pytest.approx(0.1 + 0.1 + 0.01)
    # two 100-token prompts: attention within each prompt only, cheaper than one of 200
    assert p.prefill_s([(100, 0), (100, 0)]) == pytest.approx(0.1 + 0.2 + 0.02)
    assert p.prefill_s([(200, 0)]) == pytest.approx(0.1 + 0.2 + 0.04)
    # a second chunk of 100 after 100 cached tokens attends over 100 * (100 + 200) pairs
    assert p.prefill_s([(100, 100)]) == pytest.approx(0.1 + 0.1 + 0.03)
    assert p.mixed_s([(100, 0)], 4, 50.0) == pytest.approx(0.21)  # decode adds d1, d2 terms: 0
    with pytest.raises(ProfileError, match="per-token cost must be > 0"):
        profile(prefill_coef=(0.1, 0.0, 0.0))


def test_fit_prefill_recovers_the_costs() -> None:
    truth = profile(prefill_coef=(0.07, 0.0015, 5e-7))
    shapes = [(1, 16), (1, 256), (1, 2048), (4, 256), (8, 64), (2, 512)]
    points = [(k, n, truth.prefill_s([(n, 0)] * k)) for k, n in shapes]
    assert fit_prefill(points) == pytest.approx((0.07, 0.0015, 5e-7), rel=1e-6)
    # step times that shrink per token as prompts grow: no negative pair cost, refitted
    p0, p1, p2 = fit_prefill([(1, 100, 0.3), (1, 200, 0.5), (1, 400, 0.8)])
    assert p2 == 0.0 and p1 > 0 and p0 > 0


def test_a_profile_from_before_the_fit_is_refitted_on_load(tmp_path: Path) -> None:
    old = {
        "prefill_points": [[16, 0.0724], [256, 0.4846], [2048, 5.218]],
        "decode_coef": [0.05, 0.004, 1e-5],
        "kv_bytes_per_token": 46080,
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = NodeProfile.load(path)
    assert loaded.prefill_s([(256, 0)]) == pytest.approx(0.4846, rel=0.01)
    assert loaded.meta["prefill_points"] == old["prefill_points"]
    path.write_text(json.dumps({"decode_coef": [0.05, 0, 0]}))
    with pytest.raises(ProfileError, match="is not a node profile"):
        NodeProfile.load(path)


def test_a_cpu_profile_from_another_processor_warns_on_load(tmp_path: Path) -> None:
    """Step times are the processor's: a profile recorded on another one says so and what to do;
    this host's own, a GPU profile and a profile that records no host load quietly."""
    here = this_host()
    assert here["cpu"] and here["cores"] >= 1
    other = (
        {**here, "family": "26", "model": "2"}
        if here["family"] != "26"
        else {**here, "family": "25"}
    )
    path = tmp_path / "p.json"
    profile(meta={"host": other}).save(path)
    with pytest.warns(HostMismatch, match="profile this host .* --profile FILE"):
        NodeProfile.load(path)
    for meta in ({"host": here}, {"host": other, "device": "cuda"}, {}):
        profile(meta=meta).save(path)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            NodeProfile.load(path)


def test_one_node_deterministic_service_all_at_once() -> None:
    """n requests at t=0 on one node serving one at a time: request k done at (k+1)*S."""
    n = 6
    traces = Simulation(profile(), 0, 1).run([Arrival(0.0, 100, 1)] * n)
    ttfts = sorted(t.ttft or 0.0 for t in traces)
    assert ttfts == pytest.approx([(k + 1) * S for k in range(n)])
    s = summarize(traces, max(t.done for t in traces), SLO(ttft_ms=1000 * 3 * S + 1))
    assert s.ttft_ms.mean == pytest.approx(1000 * S * (n + 1) / 2)
    assert s.goodput == pytest.approx(3 / (n * S))  # 3 of 6 within 3S, over n*S seconds


def test_one_node_md1_mean_wait() -> None:
    """Poisson arrivals, deterministic service S, utilisation 0.5: M/D/1 mean wait = S/2."""
    rng = np.random.default_rng(0)
    gaps = arrival_gaps(0.5 / S, 1.0, rng)
    at, arrivals_ = 0.0, []
    for _ in range(20000):
        at += next(gaps)
        arrivals_.append(Arrival(at, 100, 1))
    traces = Simulation(profile(), 0, 1).run(arrivals_)
    rho = 0.5
    expected_wait = rho * S / (2 * (1 - rho))
    mean_ttft = float(np.mean([t.ttft for t in traces]))
    assert mean_ttft == pytest.approx(S + expected_wait, rel=0.05)


def test_colocated_single_request_latencies() -> None:
    p = profile(gateway_s=0.004)
    (t,) = Simulation(p, 0, 1).run([Arrival(1.0, 100, 5)])
    assert t.ttft == pytest.approx(S + 0.004)
    assert t.itls == pytest.approx([D0] * 4)
    assert t.tpot == pytest.approx(D0)
    assert t.output_tokens == 5


def test_disaggregated_single_request_latencies() -> None:
    """1P1D: TTFT = destination hop + prefill + KV bytes + DONE hop; then a token per step."""
    (t,) = Simulation(profile(), 1, 1).run([Arrival(0.0, 100, 4)])
    assert t.ttft == pytest.approx(0.01 + S + 0.1 + 0.01)
    assert t.tpot == pytest.approx(D0)
    assert t.e2e == pytest.approx(0.01 + S + 0.1 + 0.01 + 3 * D0)


def test_a_prefill_node_reports_a_finished_transfer_mid_step() -> None:
    """A's KV lands at 0.01 + S + 0.1 while P runs B's prefill (S + 0.01 to 2 S + 0.01): P
    polls its writes between the model's layers, so D hears of A then, not at the end of B's
    step; B follows a step later."""
    traces = Simulation(profile(), 1, 1).run([Arrival(0.0, 100, 1), Arrival(0.0, 100, 1)])
    assert [t.ttft for t in traces] == pytest.approx([0.01 + S + 0.11, 0.01 + 2 * S + 0.11])


def test_two_prefill_nodes_halve_the_queue() -> None:
    burst = [Arrival(0.0, 100, 1)] * 4
    one = Simulation(profile(), 1, 1).run(burst)
    two = Simulation(profile(), 2, 1).run(burst)
    assert max(t.ttft or 0 for t in one) == pytest.approx(0.01 + 4 * S + 0.1 + 0.01)
    assert max(t.ttft or 0 for t in two) == pytest.approx(0.01 + 2 * S + 0.1 + 0.01)


def test_max_concurrency_queues_at_the_client() -> None:
    traces = Simulation(profile(), 0, 1, max_concurrency=1).run([Arrival(0.0, 100, 1)] * 3)
    assert [t.sent for t in traces] == pytest.approx([0.0, S, 2 * S])
    assert [t.ttft for t in traces] == pytest.approx([S] * 3)


def test_shared_host_slows_concurrent_steps() -> None:
    burst = [Arrival(0.0, 100, 1)] * 2
    alone = Simulation(profile(), 0, 2).run(burst)
    shared = Simulation(profile(), 0, 2, HostConfig(host_cores=1)).run(burst)
    assert sorted(t.ttft or 0 for t in alone) == pytest.approx([S, S])
    assert sorted(t.ttft or 0 for t in shared) == pytest.approx([2 * S, 2 * S])  # half a core each


def test_a_step_slows_down_when_another_starts_beside_it() -> None:
    """One core, processor sharing: A alone for S/2, then A and B at half speed until A is
    done at 1.5 S, then B alone for its last S/2: done at 2 S (B's TTFT: 1.5 S)."""
    traces = Simulation(profile(), 0, 2, HostConfig(host_cores=1)).run(
        [Arrival(0.0, 100, 1), Arrival(S / 2, 100, 1)]
    )
    assert [t.done for t in traces] == pytest.approx([1.5 * S, 2 * S])


def test_co_runner_slows_steps_beyond_core_sharing() -> None:
    """Two cores, so no sharing; a co-runner cost of 0.2: A alone for S/2, then A and B at
    1/1.2 speed; A has S/2 left, done at S/2 + 0.6 S = 1.1 S; B then has S - 0.5 S left alone:
    done at 1.6 S. Without a co-runner cost both run at full speed (done at S, 1.5 S)."""
    pair = [Arrival(0.0, 100, 1), Arrival(S / 2, 100, 1)]
    plain = Simulation(profile(), 0, 2, HostConfig(host_cores=2)).run(pair)
    assert [t.done for t in plain] == pytest.approx([S, 1.5 * S])
    slowed = Simulation(profile(), 0, 2, HostConfig(host_cores=2, co_runner=0.2)).run(pair)
    assert [t.done for t in slowed] == pytest.approx([1.1 * S, 1.6 * S])
    own_devices = Simulation(profile(), 0, 2, HostConfig(co_runner=0.2)).run(pair)
    assert [t.done for t in own_devices] == pytest.approx([S, 1.5 * S])  # GPUs: not charged


def test_host_work_per_streamed_token_slows_steps_on_a_shared_host() -> None:
    """0.5 CPU-s per token streamed in the last second: after 1 token the next step shares the
    one core with 0.5 cores of host work (x1.5), after 2 tokens with 1 core (x2)."""
    one = [Arrival(0.0, 100, 3)]
    host = HostConfig(host_cores=1, overhead_s_per_token=0.5)
    (plain,) = Simulation(profile(), 0, 1, HostConfig(host_cores=1)).run(one)
    (loaded,) = Simulation(profile(), 0, 1, host).run(one)
    assert plain.chunks == pytest.approx([S, S + D0, S + 2 * D0])
    assert loaded.chunks == pytest.approx([S, S + 1.5 * D0, S + 3.5 * D0])
    (own_devices,) = Simulation(profile(), 0, 1, replace(host, host_cores=0)).run(one)
    assert own_devices.chunks == plain.chunks  # one device per node: the host does not slow it
    # a disaggregated cluster is charged its own cost per token
    pd = HostConfig(host_cores=2, overhead_s_per_token=0.0, pd_overhead_s_per_token=1.0)
    assert pd.overhead(True) == 1.0 and pd.overhead(False) == 0.0
    (quiet,) = Simulation(profile(), 1, 1, replace(pd, pd_overhead_s_per_token=None)).run(one)
    (busy,) = Simulation(profile(), 1, 1, pd).run(one)
    assert quiet.itls == pytest.approx([D0, D0])
    # 1 node stepping + 1 (then 2) tokens x 1 CPU-s in the last second, on 2 cores
    assert busy.itls == pytest.approx([D0, D0 * 1.5])


def test_a_cached_prefix_is_not_computed_again() -> None:
    """60 of 100 tokens cached: the prefill computes 40 (their attention over the prefix is
    free in this profile, whose pair cost is 0); 1P1D still sends all 100 tokens' KV."""
    (t,) = Simulation(profile(), 0, 1).run([Arrival(0.0, 100, 2, cached_len=60)])
    assert t.ttft == pytest.approx(0.05 + 0.0015 * 40)
    (t,) = Simulation(profile(), 1, 1).run([Arrival(0.0, 100, 2, cached_len=60)])
    assert t.ttft == pytest.approx(0.01 + 0.05 + 0.0015 * 40 + 0.1 + 0.01)


def test_prefix_groups_are_cached_after_their_first_request() -> None:
    dataset = DatasetConfig("prefix", 6, input_len=16, output_len=4, prefix_len=64,
                            prefix_group_size=3, seed=1)  # fmt: skip
    out = arrivals(dataset, LoadConfig(request_rate=1.0, num_sessions=6, seed=1))
    assert sorted(a.cached_len for a in out) == [0, 0, 64, 64, 64, 64]  # 2 groups of 3
    assert all(a.prompt_len == 64 + 16 for a in out)


def test_arrivals_match_the_benchmark_schedule() -> None:
    dataset = DatasetConfig("random", 5, input_len=64, output_len=8, range_ratio=0.5, seed=3)
    load = LoadConfig(request_rate=2.0, num_sessions=5, seed=3)
    out = arrivals(dataset, load)
    gaps = arrival_gaps(2.0, 1.0, np.random.default_rng(3))
    assert [a.at for a in out] == pytest.approx(list(np.cumsum([next(gaps) for _ in range(5)])))
    assert all(32 <= a.prompt_len <= 96 and 4 <= a.output_len <= 12 for a in out)


def test_max_rate_of_one_node_is_near_capacity() -> None:
    dataset = DatasetConfig("random", 400, input_len=100, output_len=1)
    load = LoadConfig(request_rate=1.0, num_sessions=400)
    rate = max_rate(profile(), Split(0, 1), dataset, load, SLO(ttft_ms=5000), HostConfig(), 0.9, 50)
    # Near the service rate 1/S; a little above it is possible: a finite run's backlog
    # stays under the TTFT SLO for most of its requests.
    assert 0.6 / S < rate < 1.2 / S


def test_workload_from_tune_ratio_settings() -> None:
    settings = {
        "name": "random",
        "num_sessions": 30,
        "seed": 4,
        "input_len": 256,
        "output_len": 16,
        "range_ratio": 0.0,
        "request_rate": None,
        "burstiness": 1.0,
        "max_concurrency": None,
        "duration_s": None,
        "ttft_ms": 3000.0,
        "tpot_ms": None,
        "e2e_ms": None,
        "path": None,
    }
    dataset, load, slo = workload_from_settings(settings)
    assert (dataset.input_len, dataset.num_sessions, load.num_sessions, load.seed) == (
        256,
        30,
        30,
        4,
    )
    assert slo == SLO(ttft_ms=3000.0)


def test_the_speed_band_flags_predictions_a_profile_error_would_move() -> None:
    steady = Comparison(Split(1, 1), 1.0, (0.5, 0.52), 0.5, band=(0.48, 0.53))
    cliff = Comparison(Split(2, 1), 3.0, (0.3, 0.4), 0.6, band=(0.3, 0.8))
    assert not steady.fragile(0.15) and cliff.fragile(0.15)
    assert not Comparison(Split(1, 1), 1.0, (0.5,), 0.5).fragile(0.15)  # no band: no claim
    table = comparison_table([steady, cliff], 0.15)
    assert "speed band" in table and "0.300-0.800" in table
    assert "moves more than 15% within the speed band: 1/2" in table
    assert "speed band" not in comparison_table([replace(steady, band=None)], 0.15)


def test_comparison_error_and_best_split() -> None:
    assert Comparison(Split(1, 1), 1.0, (0.5,), 0.55).error == pytest.approx(0.1)
    assert Comparison(Split(1, 1), 1.0, (0.5,), 0.55).spread is None
    repeated = Comparison(Split(1, 1), 1.0, (0.4, 0.6, 0.5), 0.55)
    assert repeated.measured == pytest.approx(0.5) and repeated.spread == pytest.approx(0.4)
    assert Comparison(Split(1, 1), 1.0, (0.0,), 0.0).error is None
    assert math.isinf(Comparison(Split(1, 1), 1.0, (0.0, 0.0), 0.2).error or 0)
    assert [s.name for s in parse_splits("all", 3)] == ["1P2D", "2P1D", "colocated x3"]
    names = [s.name for s in parse_splits("1:1, 0:2,colocated,2:1", 3)]
    assert names == ["1P1D", "colocated x2", "colocated x3", "2P1D"]
    with pytest.raises(SplitError, match="is not P:D"):
        parse_splits("1-1", 2)
    with pytest.raises(SplitError, match="--rates must be positive"):
        parse_rates("0,1")
    assert parse_rates("2,0.5") == (0.5, 2.0)
    assert best_split([SplitResult(Split(1, 1))], 0.9) is None


def test_a_speed_band_outside_zero_to_one_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["validate", "--profile", "p.json", "--measured", "m.json", "--speed-band", "1.5"]
    assert plan_capacity(args) == 2
    assert "--speed-band must be in [0, 1)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--slowdown", "0", "--slowdown > 0"),
        ("--co-runner-slowdown", "-0.1", "--co-runner-slowdown must be >= 0, got -0.1"),
    ],
)
def test_host_flags_that_make_no_sense_exit_2(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = Path(__file__).parent.parent / "benchmarks/serving-2026-11-24/node_profile.json"
    args = ["simulate", "--profile", str(profile), flag, value, "--request-rate", "1"]
    assert plan_capacity(args) == 2
    assert message in capsys.readouterr().err


def test_profile_decode_points_beyond_the_nodes_pool(long_context_model: Path,
                                                     tmp_path: Path, capsys) -> None:  # fmt: skip
    """`profile --decode-batches/--decode-contexts` measure the decode points asked for, and
    the profiler's own pool grows to hold the largest (24 streams of 40 tokens need more than
    the node's 256) while the profile keeps the node's pool."""
    out = tmp_path / "profile.json"
    argv = ["profile", "--model", str(long_context_model), "--repeats", "1",
            "--max-total-tokens", "256", "--decode-batches", "2,24",
            "--decode-contexts", "16,40", "--output", str(out)]  # fmt: skip
    assert plan_capacity(argv) == 0
    doc = json.loads(out.read_text())
    points = doc["meta"]["decode_points"]
    # mean context: the prompt, its first token and the 6 timed steps' tokens
    assert [(b, c) for b, c, _ in points] == [(2, 23), (24, 23), (2, 47), (24, 47)], points
    assert all(seconds > 0 for _, _, seconds in points)
    assert doc["max_total_tokens"] == 256
    with pytest.raises(SystemExit) as bad:
        plan_capacity([*argv[:-2], "--decode-batches", "4,x", "--output", str(out)])
    assert bad.value.code == 2
    assert "expected positive integers like 1,4,16, got '4,x'" in capsys.readouterr().err
