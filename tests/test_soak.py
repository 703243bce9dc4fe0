"""scripts/serving/soak.py: the growth rule on hand-made series, the probes, and a 20-second real
soak.

The rule tests build series with a known shape (flat with noise, a steady leak, one late spike,
a step down) and check the verdict and its figures. The smoke test runs the script as a user
would against a real 1P1D cluster (random-weight llama with the default model's tokenizer,
Mooncake over loopback TCP) and checks that every process was sampled, nothing failed, no page
stayed in use and the summary says PASS.
"""

from __future__ import annotations

import csv
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.process.launcher import session_pids
from scripts.serving.growth import Tolerance, judge, slope
from scripts.serving.probes import Sample, metric_quantities, proc_usage
from scripts.serving.soak_report import Findings, SampleLog, judge_samples, new_errors

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ("-m", "scripts.serving.soak")  # run from ROOT
MINUTES = [60.0 * i for i in range(31)]  # 30 minutes, one sample a minute


# -- the growth rule ----------------------------------------------------------------------------


def test_slope_of_a_line_is_exact() -> None:
    assert slope([0, 1, 2, 3], [5, 7, 9, 11]) == pytest.approx(2.0)
    assert slope([1, 1], [0, 5]) == 0.0  # no spread in time: no slope
    assert slope([0], [3]) == 0.0


def test_flat_noisy_series_is_bounded() -> None:
    rng = random.Random(0)
    values = [600 + rng.uniform(-10, 10) for _ in MINUTES]
    v = judge(MINUTES, values, Tolerance(abs_tol=16, rel_tol=0.03))
    assert not v.grows and not v.too_short
    assert v.tolerance == pytest.approx(0.03 * v.baseline)  # 18 MiB beats 16 at 600 MiB
    assert abs(v.trend) < v.tolerance


def test_steady_leak_grows() -> None:
    values = [600 + 3.0 * i for i in range(len(MINUTES))]  # 3 MiB a minute
    v = judge(MINUTES, values, Tolerance(abs_tol=16, rel_tol=0.03))
    assert v.grows
    assert v.slope_per_hour == pytest.approx(180.0)
    assert v.trend == pytest.approx(45.0)  # the second half spans 15 minutes
    assert v.samples == 16  # minutes 15..30


def test_leak_below_the_tolerance_is_not_flagged() -> None:
    values = [600 + 1.0 * i for i in range(len(MINUTES))]  # 15 MiB over the second half
    assert not judge(MINUTES, values, Tolerance(abs_tol=16, rel_tol=0.03)).grows


def test_one_late_spike_is_not_growth() -> None:
    values = [100.0] * len(MINUTES)
    values[-1] = 400.0
    v = judge(MINUTES, values, Tolerance(abs_tol=8))
    assert v.trend > v.tolerance  # the fit alone would flag it ...
    assert not v.grows  # ... but the final window's median did not move
    assert v.peak == 400.0


def test_warm_up_in_the_first_half_is_ignored() -> None:
    values = [10.0 * i if i < 12 else 120.0 for i in range(len(MINUTES))]
    assert not judge(MINUTES, values, Tolerance(abs_tol=4)).grows


def test_a_step_up_that_stays_counts_as_growth() -> None:
    values = [50.0 if i < 24 else 90.0 for i in range(len(MINUTES))]
    v = judge(MINUTES, values, Tolerance(abs_tol=8))
    assert v.grows and v.shift == pytest.approx(40.0)


def test_falling_series_is_bounded() -> None:
    values = [900 - 5.0 * i for i in range(len(MINUTES))]
    assert not judge(MINUTES, values, Tolerance(abs_tol=1)).grows


def test_too_few_samples_are_not_judged() -> None:
    v = judge([0, 5, 10], [1, 100, 1000], Tolerance(abs_tol=1), min_samples=4)
    assert v.too_short and not v.grows
    assert judge([], [], Tolerance(abs_tol=1)).too_short


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="2 times but 1 values"):
        judge([0, 1], [1], Tolerance(abs_tol=1))
    with pytest.raises(ValueError, match=">= 0"):
        Tolerance(abs_tol=-1)


# -- samples, findings, probes -----------------------------------------------------------------


def _log(tmp_path: Path, rows: list[tuple[float, str, str, float]]) -> SampleLog:
    stream = (tmp_path / "samples.csv").open("w", newline="")
    log = SampleLog(stream)
    log.add(Sample(*row) for row in rows)
    stream.close()
    return log


def test_sample_log_judges_and_counts_errors(tmp_path: Path) -> None:
    rows = [(float(t), "decode-0", "open_fds", 40.0 + 2 * t) for t in range(20)]  # 2 fds/s
    rows += [(float(t), "decode-0", "kv_cached", t / 20) for t in range(20)]  # not judged
    rows += [(float(t), "gateway", "errors", 3.0 + (t >= 15)) for t in range(20)]
    log = _log(tmp_path, rows)
    verdicts = judge_samples(log)
    assert set(verdicts) == {("decode-0", "open_fds")}
    assert verdicts[("decode-0", "open_fds")].grows
    assert new_errors(log, ["gateway", "decode-0"]) == {"gateway": 1.0, "decode-0": 0.0}
    with (tmp_path / "samples.csv").open() as f:
        written = list(csv.reader(f))
    assert written[0] == ["t_s", "process", "quantity", "value"] and len(written) == 61


def test_findings_fail_on_errors_leaks_and_deaths() -> None:
    assert not Findings().failed
    assert Findings(errors={"gateway": 2}, max_errors=2).failed is False
    assert Findings(errors={"gateway": 2}, client_failed=1, max_errors=2).failed
    leaked = Findings(leaks=["decode-0: 3 pages in use"])
    assert leaked.failed and leaked.reasons() == ["leak: decode-0: 3 pages in use"]
    assert Findings(dead=["prefill-0"]).failed


def test_metric_quantities_sum_the_error_series() -> None:
    gateway = "\n".join(
        [
            'pdserve_gateway_requests_total{endpoint="/v1/completions",status="200"} 90.0',
            'pdserve_gateway_requests_total{endpoint="/v1/completions",status="503"} 2.0',
            'pdserve_gateway_requests_total{endpoint="/v1/chat/completions",status="429"} 1.0',
            "pdserve_gateway_failures_total 4.0",
            "pdserve_gateway_inflight 7.0",
        ]
    )
    assert metric_quantities("gateway", gateway) == {"errors": 7.0, "inflight": 7.0}
    decode = "\n".join(
        [
            'pdserve_node_requests_finished_total{reason="length"} 50.0',
            'pdserve_node_requests_finished_total{reason="abort"} 1.0',
            'pdserve_decode_transfer_failures_total{reason="transfer_timeout"} 2.0',
            "pdserve_decode_quarantine 0.0",
        ]
    )
    assert metric_quantities("decode", decode) == {"errors": 3.0, "quarantine": 0.0}


def test_proc_usage_of_this_process() -> None:
    pids = session_pids(os.getsid(0))
    assert os.getpid() in pids
    usage = proc_usage([os.getpid()])
    assert usage["rss_mib"] > 10 and usage["open_fds"] >= 3 and usage["threads"] >= 1
    assert proc_usage([2**22 + 1]) == {"rss_mib": 0.0, "open_fds": 0.0, "threads": 0.0}


def test_bad_flags_exit_2_with_one_line(tmp_path: Path) -> None:
    cmd = [sys.executable, *SCRIPT, "--output-dir", str(tmp_path), "--load-fraction", "1.5"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--load-fraction must be in (0, 1], got 1.5" in done.stderr
    assert "Traceback" not in done.stderr


# -- a real 20-second soak ----------------------------------------------------------------------


@pytest.mark.slow
def test_short_soak_on_a_real_cluster_passes(tiny_text_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak"
    cmd = [sys.executable, *SCRIPT, "--output-dir", str(out), "--model", str(tiny_text_model)]
    cmd += ["--duration", "20", "--interval", "2", "--capacity-requests", "6"]
    cmd += ["--capacity-concurrency", "3", "--input-len", "48", "--output-len", "8"]
    cmd += ["--max-total-tokens", "4096"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "[soak]" in done.stdout and "capacity" in done.stdout
    with (out / "samples.csv").open() as f:
        rows = list(csv.DictReader(f))
    seen = {(r["process"], r["quantity"]) for r in rows}
    for process in ("bootstrap", "prefill-0", "decode-0", "gateway"):
        for quantity in ("rss_mib", "open_fds", "threads", "errors", "probe_failures"):
            assert (process, quantity) in seen, (process, quantity)
    for node in ("prefill-0", "decode-0"):
        assert (node, "kv_used") in seen and (node, "kv_cached") in seen
    assert ("bootstrap", "rooms_open") in seen and ("decode-0", "quarantine") in seen
    rss = [float(r["value"]) for r in rows if r["quantity"] == "rss_mib"]
    assert min(rss) > 20  # every process is a real Python server (bootstrap: ~46 MiB)
    summary = (out / "summary.md").read_text()
    completed = re.search(r"^- completed (\d+), failed 0", summary, re.M)
    assert completed and int(completed.group(1)) >= 5, summary
    assert "- PASS: nothing grew, no error, no leak" in summary
    assert "- every node idle, 0 pages in use" in summary
    assert "- client-side failed requests: 0" in summary
    assert "| decode-0 | rss_mib |" in summary and "| bootstrap | rooms_open |" in summary
