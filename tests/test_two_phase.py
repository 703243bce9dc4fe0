"""The two-phase benchmark's pure parts (scripts/planning/two_phase_score.py): the phase schedule,
attainment / goodput / lost from per-request records, and the prediction error from the
planner's own JSON lines (a real `Planner` deciding on real windows, not a fake of it)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from planner.metrics import SLO, RequestTrace
from planner.policy import Planner, PlannerConfig, run
from planner.profile import NodeProfile
from planner.window import Scrape
from scripts.planning.two_phase import build_bench, build_parser, cluster_argv, planner_argv
from scripts.planning.two_phase_score import (
    Phase,
    RunResult,
    TwoPhaseError,
    WindowCheck,
    Workload,
    actions,
    build_schedule,
    check_goals,
    error_summary,
    mean_abs_error,
    planner_tables,
    read_decisions,
    score_run,
    score_table,
    window_checks,
)

SLO_ = SLO(ttft_ms=1000.0, tpot_ms=100.0)
A = Phase("A", duration_s=20.0, rate=2.0, input_len=400, output_len=4)
B = Phase("B", duration_s=10.0, rate=5.0, input_len=40, output_len=64)


def test_the_schedule_is_each_phases_poisson_arrivals_in_turn() -> None:
    workload = Workload((A, B), SLO_, seed=3)
    schedule = build_schedule(workload)
    times = schedule.times
    assert times == sorted(times) and times[0] > 0 and times[-1] < workload.total_s == 30.0
    in_a = [t for t, p in zip(times, schedule.phase_of, strict=True) if p == 0]
    in_b = [t for t, p in zip(times, schedule.phase_of, strict=True) if p == 1]
    assert max(in_a) < 20.0 <= min(in_b)  # phase B starts when A's seconds are over
    assert 20 <= len(in_a) <= 65 and 25 <= len(in_b) <= 80  # ~40 and ~50 expected
    lengths_a = [s.turns[0].prompt_len for s, p in zip(schedule.sessions, schedule.phase_of,
                                                        strict=True) if p == 0]  # fmt: skip
    outputs_b = [s.turns[0].output_len for s, p in zip(schedule.sessions, schedule.phase_of,
                                                        strict=True) if p == 1]  # fmt: skip
    assert min(lengths_a) >= 300 and max(lengths_a) <= 500  # 400 +- 25%
    assert min(outputs_b) >= 48 and max(outputs_b) <= 80
    assert build_schedule(workload) == schedule  # same seed, same run
    prompts = {s.turns[0].prompt for s in schedule.sessions}
    assert len(prompts) == len(schedule.sessions)  # no prompt served from another's cache


def test_a_workload_needs_both_slos_and_positive_phases() -> None:
    with pytest.raises(TwoPhaseError, match="--slo-tpot-ms"):
        Workload((A,), SLO(ttft_ms=1000.0))
    with pytest.raises(TwoPhaseError, match="duration and rate"):
        Phase("X", 0.0, 1.0, 10, 10)


def _trace(session: int, sent: float, ttft: float, gap: float, tokens: int,
           error: str = "") -> RequestTrace:  # fmt: skip
    chunks = [sent + ttft + i * gap for i in range(tokens)] if not error else []
    done = chunks[-1] if chunks else sent + 1.0
    return RequestTrace(sent=sent, chunks=chunks, done=done, output_tokens=len(chunks),
                        error=error, session=session)  # fmt: skip


def test_attainment_goodput_and_lost_per_phase_from_request_records() -> None:
    workload = Workload((A, B), SLO_)
    schedule = build_schedule(workload)
    traces = []
    for i, (at, phase) in enumerate(zip(schedule.times, schedule.phase_of, strict=True)):
        if phase == 0:  # A: every third request misses TTFT (1.5 s > 1 s)
            traces.append(_trace(i, at, 1.5 if i % 3 == 0 else 0.2, 0.05, 4))
        elif i % 5 == 0:  # B: every fifth misses TPOT (150 ms > 100 ms), one failed
            traces.append(_trace(i, at, 0.2, 0.15, 64))
        else:
            traces.append(_trace(i, at, 0.2, 0.05, 64))
    lost_one = next(i for i, p in enumerate(schedule.phase_of) if p == 1 and i % 5)
    traces[lost_one] = _trace(lost_one, schedule.times[lost_one], 0, 0, 0, error="http_503")
    traces.pop()  # and one never came back at all

    a, b, whole = score_run(workload, schedule, traces)
    n_a = schedule.phase_of.count(0)
    n_b = schedule.phase_of.count(1)
    met_a = sum(1 for i, p in enumerate(schedule.phase_of) if p == 0 and i % 3)
    assert (a.phase, a.scheduled, a.met, a.lost) == ("A", n_a, met_a, 0)
    assert a.attainment == pytest.approx(met_a / n_a) and a.goodput == pytest.approx(met_a / 20)
    assert a.ttft_p90_ms == pytest.approx(1500.0)
    last = len(schedule.sessions) - 1
    met_b = sum(1 for i, p in enumerate(schedule.phase_of)
                if p == 1 and i % 5 and i not in (lost_one, last))  # fmt: skip
    assert (b.scheduled, b.met, b.lost, b.errors) == (n_b, met_b, 2, {"http_503": 1})
    assert b.goodput == pytest.approx(met_b / 10)
    assert (whole.phase, whole.met, whole.lost) == ("all", met_a + met_b, 2)
    assert whole.goodput == pytest.approx((met_a + met_b) / 30)
    table = score_table([RunResult("2P1D", planner=False, scores=[a, b, whole])])
    assert "| 2P1D | **whole run** |" in table and f"| {a.attainment:.0%} |" in table

    run = RunResult("2P1D", planner=False)
    run.record(workload, schedule, list(reversed(traces)))  # each request kept, in order
    rows = run.to_json()["requests"]
    assert run.scores == [a, b, whole] and [r["index"] for r in rows] == list(range(last))
    assert [r["phase"] for r in rows] == list(schedule.phase_of[:last])
    assert rows[0]["ttft"] == pytest.approx(1.5) and rows[lost_one]["error"] == "http_503"
    assert rows[1]["tpot"] == pytest.approx(0.05) and rows[1]["output_tokens"] == 4


def test_each_run_is_written_as_it_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark stopped during its second run keeps its first in `two_phase.json`."""
    import scripts.planning.two_phase as two_phase

    done: list[RunResult] = []

    def static(config: object, split: object, schedule: object) -> RunResult:
        if done:
            raise KeyboardInterrupt
        done.append(RunResult("1P2D", planner=False))
        return done[0]

    monkeypatch.setattr(two_phase, "run_static", static)
    with pytest.raises(KeyboardInterrupt):
        two_phase.main(["--out", str(tmp_path), "--splits", "1:2,2:1", "--no-planner"])
    doc = json.loads((tmp_path / "two_phase.json").read_text())
    assert [r["name"] for r in doc["runs"]] == ["1P2D"]


def _profile() -> NodeProfile:
    return NodeProfile(prefill_coef=(0.05, 0.0015, 0.0), decode_coef=(0.03, 0.0, 0.0),
                       kv_bytes_per_token=1000, transfer_bytes_per_s=1e9, handoff_s=0.01,
                       gateway_s=0.0, chunked_prefill_size=100)  # fmt: skip


def _planner_lines() -> str:
    """The JSON lines a real planner prints for three 10 s windows of 2 req/s, 400-token
    prompts on 1P2D (its clock: 100 s + the window's end), then an idle one (no line)."""
    planner = Planner(_profile(), PlannerConfig(3, SLO(ttft_ms=3000.0, tpot_ms=100.0),
                                                cooldown_s=60.0, sim_seconds=20.0,
                                                headroom=1.0))  # fmt: skip
    scrapes = [Scrape(100.0 + 10 * i, requests=20 * i, finished=20 * i, prompt_tokens=8000 * i,
                      completion_tokens=80 * i, itl_sum=1.8 * i, itl_count=60 * i,
                      prefill_nodes=1, decode_nodes=2) for i in range(4)]  # fmt: skip
    scrapes.append(Scrape(150.0, requests=60, finished=60, prompt_tokens=24000,
                          completion_tokens=240, prefill_nodes=1, decode_nodes=2))  # fmt: skip
    out = io.StringIO()
    run(planner, iter(scrapes), None, out)
    return out.getvalue()


def test_each_window_is_scored_by_the_requests_admitted_in_it() -> None:
    """Both sides count the window's admissions: the planner predicts the goodput of the
    requests that arrive in it, the client scores those requests once they finish, however
    late (a completion-counting window would give the long ones to the next window)."""
    decisions = read_decisions(_planner_lines())
    assert len(decisions) == 3 and decisions[0]["action"] == "switch"
    zero = 100.0  # the load started at the planner's 100 s
    # 0-10 s: 20 sent, all meet the SLO; the odd ones stream 100 tokens 90 ms apart, ending in
    # the next window. 10-20 s: 20 sent, every other one misses TTFT. 20-30 s: 10, all miss.
    traces = [_trace(0, 0.5 * i, 0.5, 0.09 if i % 2 else 0.03, 100 if i % 2 else 4)
              for i in range(1, 21)]  # fmt: skip
    assert sum(1 for t in traces if t.done > 10) == 10
    traces += [_trace(0, 10 + 0.5 * i, 0.5 if i % 2 else 5.0, 0.03, 4) for i in range(1, 21)]
    traces += [_trace(0, 20 + i, 5.0, 0.03, 4) for i in range(1, 11)]
    traces.append(_trace(0, 29.5, 0, 0, 0, error="unfinished"))  # lost: sent, never met
    checks = window_checks(decisions, traces, zero, end_s=30.0, slo=SLO_)
    assert [(c.start_s, c.end_s) for c in checks] == [(0, 10), (10, 20), (20, 30)]
    first, second, third = checks
    assert [(c.sent, c.met) for c in checks] == [(20, 20), (20, 10), (11, 0)]
    assert first.split == "1P2D" and first.rate == pytest.approx(2.0)
    # The planner's own figure for its window: the live split's attainment x the rate.
    predicted = decisions[0]["predicted_goodput"]
    assert predicted == pytest.approx(decisions[0]["predicted"]["1P2D"] * 2.0)
    assert first.predicted_goodput == pytest.approx(predicted)
    assert (first.measured_goodput, second.measured_goodput) == (2.0, 1.0)
    assert first.error == pytest.approx((predicted - 2.0) / 2.0)
    assert third.measured_goodput == 0.0
    assert third.error == (0.0 if third.predicted_goodput == 0 else None)
    scored = [c for c in checks if c.scored and c.error is not None]
    assert mean_abs_error(checks) == pytest.approx(
        sum(abs(c.error or 0.0) for c in scored) / len(scored)
    )
    # A window that starts before the load, or ends after it, is not the load's.
    assert len(window_checks(decisions, traces, zero + 5, 30.0, SLO_)) == 2
    assert len(window_checks(decisions, traces, zero, 25.0, SLO_)) == 2


def test_windows_after_a_switch_or_a_phase_change_and_empty_ones_are_left_out() -> None:
    decisions = read_decisions(_planner_lines())
    decisions[0]["acted"] = True  # switched at 10 s (the load's clock)
    traces = [_trace(0, 0.5 * i, 0.5, 0.03, 4) for i in range(1, 41)]  # in 0-20 s, none later
    checks = window_checks(decisions, traces, 100.0, 30.0, SLO_, boundaries=[20.0],
                           settle_s=15.0)  # fmt: skip
    first, second, third = checks
    assert first.transient == "" and first.scored
    assert second.transient == "switch at 10 s" and not second.scored  # its 15 s of settling
    assert third.transient == "switch at 10 s; phase at 20 s" and third.empty
    assert mean_abs_error(checks) == pytest.approx(abs(first.error or 0.0))
    later = window_checks(decisions, traces, 100.0, 30.0, SLO_, settle_s=5.0)
    assert later[1].transient == "switch at 10 s"  # the switch ran during the window
    assert later[2].transient == "" and later[2].empty  # nothing sent: left out all the same
    summary = error_summary(checks)
    assert "over 1 steady-state windows" in summary and "1 transient" in summary
    assert "1 empty" in summary
    table = planner_tables(RunResult("planner", True, checks=checks))
    assert "| 10-20 | 1P2D | 2.00 | 20 | 20 |" in table and "switch at 10 s |" in table
    # Lines of a planner before `predicted_goodput`: the live split's attainment x the rate.
    old = {k: v for k, v in decisions[0].items() if k != "predicted_goodput"}
    assert window_checks([old], traces, 100.0, 30.0, SLO_)[0].predicted_goodput == (
        pytest.approx(decisions[0]["predicted_goodput"])
    )


def test_actions_are_the_decisions_that_acted() -> None:
    decisions = read_decisions(_planner_lines())
    decisions[0]["acted"], decisions[0]["actuator"] = True, "stopped decode-1; started prefill-1"
    (only,) = actions(decisions, zero=100.0)
    assert (only.at_s, only.current, only.target) == (10.0, "1P2D", "2P1D")
    assert "2P1D" in only.reason and only.actuator.startswith("stopped decode-1")


def test_a_line_that_is_not_a_decision_names_its_line() -> None:
    good = _planner_lines().splitlines()[0]
    with pytest.raises(TwoPhaseError, match="line 2 is not a decision"):
        read_decisions(good + "\n" + json.dumps({"at": 1.0}) + "\n")


def test_the_goals_on_runs() -> None:
    def run_of(name: str, planner: bool, met: tuple[int, int]) -> RunResult:
        from scripts.planning.two_phase_score import Score

        a = Score("A", 10.0, 10, 10, met[0], 0)
        b = Score("B", 10.0, 10, 10, met[1], 0)
        whole = Score("all", 20.0, 20, 20, sum(met), 0)
        return RunResult(name, planner, [a, b, whole])

    runs = [run_of("1P2D", False, (3, 10)), run_of("2P1D", False, (10, 5)),
            run_of("planner", True, (9, 10))]  # fmt: skip
    goals = check_goals(runs, 0.9)
    assert goals.statics_each_miss_a_phase and goals.planner_meets_every_phase
    assert goals.goodput_ratio == pytest.approx(19 / 15) and goals.planner_lost == 0
    assert goals.mean_abs_error is None  # no windows
    assert any("1.27x" in line and "NO" in line for line in goals.lines())
    # Windows where 0 was predicted and 0 met the SLO agree exactly, and say nothing: said.

    zeros = [WindowCheck(0.0, 15.0, "1P2D", 0.4, 0.0, 6, 0),
             WindowCheck(15.0, 30.0, "1P2D", 0.4, 0.0, 6, 0)]  # fmt: skip
    runs[2].checks = zeros
    goals = check_goals(runs, 0.9)
    assert goals.mean_abs_error == 0.0 and (goals.error_windows, goals.informative_windows) == (
        2,
        0,
    )
    assert any("on no window with any goodput" in line for line in goals.lines())


def test_the_planner_gets_the_benchmarks_flags() -> None:
    args = build_parser().parse_args(["--out", "x", "--quick", "--actuator", "switch"])
    config = build_bench(args)
    assert config.workload.total_s == 120.0 and config.planner is not None
    argv = planner_argv(config, config.planner, config.workload.slo)
    assert argv[argv.index("--actuator") + 1] == "switch"
    assert argv[argv.index("--headroom") + 1] == "1"
    assert argv[argv.index("--interval") + 1] == "10.0"
    assert argv[argv.index("--sim-warmup") + 1] == "30.0"
    assert argv[argv.index("--node-max-total-tokens") + 1] == "16384"
    assert "--node-max-running-requests" not in argv
    # The nodes' KV pool and running cap: the cluster and the planner get the same.
    capped = build_bench(build_parser().parse_args(
        ["--out", "x", "--max-total-tokens", "3072", "--max-running-requests", "3"]))  # fmt: skip
    assert capped.planner is not None
    argv = planner_argv(capped, capped.planner, capped.workload.slo)
    assert argv[argv.index("--node-max-total-tokens") + 1] == "3072"
    assert argv[argv.index("--node-max-running-requests") + 1] == "3"
    cluster = cluster_argv(capped, capped.planner.start, Path("logs"))
    assert cluster[cluster.index("--max-total-tokens") + 1] == "3072"
    assert cluster[cluster.index("--node-args") + 1] == "--max-running-requests 3"
    with pytest.raises(TwoPhaseError, match="--planner-start"):
        build_bench(build_parser().parse_args(["--out", "x", "--planner-start", "1:1"]))
