"""bench_serving's client processes (`--workers`), server CPU (`--watch-*`) and node step split.

Units: the schedule dealt to workers, /proc readings of real processes on this host, the
Prometheus text of a real `NodeMetrics` registry. One real run: a colocated pd-cluster with a
tiny model, two client processes, the merged report. No timed assertions: CPU figures are only
checked to exist and be non-negative.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from planner.arrivals import LoadConfig, LoadError, arrival_times
from scripts.serving.node_metrics import StepSplit, parse_reading, parse_target
from scripts.serving.procstat import (
    CpuWatch,
    ProcessCpu,
    WatchError,
    WatchSpec,
    cpu_seconds,
    listening_pids,
    saturation_warnings,
)
from scripts.serving.workers import deal

ROOT = Path(__file__).resolve().parent.parent

# -- the schedule ----------------------------------------------------------------------------


def test_schedule_is_dealt_round_robin_with_concurrency_split() -> None:
    times = arrival_times(LoadConfig(request_rate=10.0, num_sessions=10, seed=3))
    assert len(times) == 10 and times == sorted(times)
    slices = deal(times, 3, max_concurrency=8)
    assert [s.indices for s in slices] == [(0, 3, 6, 9), (1, 4, 7), (2, 5, 8)]
    assert [s.max_concurrency for s in slices] == [3, 3, 2]  # 8 in all, never more
    assert slices[1].times == (times[1], times[4], times[7])
    assert [s.max_concurrency for s in deal(times, 2, None)] == [None, None]


def test_duration_schedule_stops_at_the_duration() -> None:
    times = arrival_times(LoadConfig(request_rate=50.0, num_sessions=None, duration_s=2.0))
    assert times and max(times) < 2.0
    with pytest.raises(LoadError, match="--duration needs a finite --request-rate"):
        arrival_times(LoadConfig(request_rate=math.inf, num_sessions=None, duration_s=2.0))


def test_bad_worker_counts_are_refused() -> None:
    with pytest.raises(LoadError, match="--workers must be >= 1"):
        deal([0.0], 0, None)
    with pytest.raises(LoadError, match="below --workers 4"):
        deal([0.0], 4, max_concurrency=2)


# -- /proc -----------------------------------------------------------------------------------


def test_a_listening_port_names_its_process() -> None:
    import os

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert os.getpid() in listening_pids(port)
        assert os.getpid() in WatchSpec.parse(f"me={port}", "port").resolve()
    assert cpu_seconds(os.getpid()) is not None


def test_watch_flags_that_name_nothing() -> None:
    with pytest.raises(WatchError, match="wants NAME=PID"):
        WatchSpec.parse("gateway", "pid")
    with pytest.raises(WatchError, match="no process of this user listens"):
        with socket.socket() as s:  # a port that was free a moment ago
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        WatchSpec.parse(f"x={free}", "port").resolve()
    with pytest.raises(ValueError, match="--watch-metrics wants NAME="):
        parse_target("decode-0")


def test_cpu_watch_counts_a_child_and_its_children() -> None:
    # A parent that starts a child: both are counted under the parent's name.
    code = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'input()'])"
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        watch = CpuWatch([WatchSpec("parent", pid=parent.pid)])
        watch.start(0.0)
        usage, *per_process = watch.stop(1.0)
        assert usage.name == "parent" and parent.pid in usage.pids and usage.cpu_s >= 0
        # a row per process only where more than one of them used CPU
        assert all(u.name.startswith("parent pid ") for u in per_process)
    finally:
        parent.communicate(b"\n", timeout=60)


def test_saturation_warning_names_the_process() -> None:
    busy = ProcessCpu("client-1", [1], cpu_s=9.5, wall_s=10.0)
    idle = ProcessCpu("client-0", [2], cpu_s=1.0, wall_s=10.0)
    (line,) = saturation_warnings([idle, busy])
    assert "client-1 used 95% of a core" in line and "--workers" in line
    assert busy.us_per_token(1000) == pytest.approx(9500.0)
    late = ProcessCpu("client", [3], cpu_s=1.0, wall_s=10.0, loop_lag_p99_ms=120.0)
    (line,) = saturation_warnings([late])
    assert "client's event loop ran 120 ms late" in line


def test_lag_probe_sees_a_blocked_loop() -> None:
    import asyncio
    import time

    from scripts.serving.load import LagProbe

    async def block_once() -> LagProbe:
        probe = LagProbe(period_s=0.01)
        task = asyncio.create_task(probe.run())
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # the loop cannot run the probe's timer meanwhile
        await asyncio.sleep(0.05)
        task.cancel()
        return probe

    probe = asyncio.run(block_once())
    assert max(probe.lags_s) >= 0.2  # a lower bound: the block itself


# -- the node's /metrics ---------------------------------------------------------------------


def test_step_split_from_a_real_node_registry() -> None:
    from prometheus_client import generate_latest

    from engine.metrics import NodeMetrics

    metrics = NodeMetrics("decode")
    before = parse_reading(generate_latest(metrics.registry).decode())
    for _ in range(4):
        metrics.forward_seconds.observe(0.25)
        metrics.step_seconds.observe(0.375)
        metrics.loop_seconds.observe(0.5)
    metrics.decode_tokens.inc(32)
    after = parse_reading(generate_latest(metrics.registry).decode())
    delta = after - before
    assert (delta.steps, delta.forward_s, delta.decode_tokens) == (4, 1.0, 32)
    split = StepSplit("decode-0", delta, wall_s=4.0)
    assert (split.forward_ms_per_step, split.schedule_ms_per_step) == (250.0, 125.0)
    assert (split.output_ms_per_step, split.busy_share) == (125.0, 0.5)
    old = StepSplit("old", replace(delta, step_s=0.0, loop_s=0.0), wall_s=4.0)
    assert old.schedule_ms_per_step is None and old.output_ms_per_step is None


# -- one real run through two client processes -----------------------------------------------


@pytest.mark.slow
def test_two_workers_against_a_real_cluster(tmp_path: Path, tiny_text_model: Path) -> None:
    import threading

    from gateway.process.cluster import Cluster, ClusterConfig

    config = ClusterConfig(
        prefill=0, decode=1, backend="mooncake", model=str(tiny_text_model), port=0,
        max_total_tokens=4096, log_dir=tmp_path / "logs",
    )  # fmt: skip
    out = tmp_path / "out.json"
    with (tmp_path / "cluster.out").open("w") as log:
        cluster = Cluster(config, out=log)
        try:
            url = cluster.start(threading.Event())
            node = next(c for c in cluster.children if c.name == "decode-0")
            port = url.rsplit(":", 1)[1]
            result = subprocess.run(
                [sys.executable, "-m", "scripts.serving.bench_serving", "--no-progress",
                 "--base-url", url, "--num-prompts", "7", "--random-input-len", "12",
                 "--random-output-len", "5", "--ignore-eos", "--max-concurrency", "4",
                 "--workers", "2", "--watch-port", f"gateway={port}",
                 "--watch-pid", f"decode-0={node.pid}",
                 "--watch-metrics", f"decode-0={node.metrics_url}", "--output-file", str(out)],
                cwd=ROOT, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
        finally:
            cluster.stop()
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert (summary["completed"], summary["failed"]) == (7, 0)
    assert sorted(r["session"] for r in doc["requests"]) == list(range(7))
    assert all(r["output_tokens"] == 5 for r in doc["requests"])
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = summary[name]
        assert 0 < d["median"] <= d["p90"] <= d["p99"] <= d["max"], name
    assert summary["e2e_ms"]["max"] <= summary["duration_s"] * 1000
    names = [u["name"] for u in doc["cpu"] if " pid " not in u["name"]]
    assert names == ["client-0", "client-1", "decode-0", "gateway"]  # pids, then ports
    assert all(u["cpu_s"] >= 0 for u in doc["cpu"])
    (steps,) = doc["node_steps"]
    assert steps["delta"]["decode_tokens"] >= 7 * 4  # the first token of each comes from prefill
    delta = steps["delta"]  # the node exports its whole step split: forward < step < loop
    assert 0 < delta["forward_s"] <= delta["step_s"] <= delta["loop_s"]
    assert "CPU-us / streamed token" in result.stdout and "forward ms / step" in result.stdout
    assert "role + output ms / step" in result.stdout
