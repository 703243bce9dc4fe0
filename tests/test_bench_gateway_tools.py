"""The pure parts of the gateway benchmarks (scripts/bench/fake_node.py, gateway_cpu.py,
pinning.py): what the fake node sends per step, the figures the tables print, and which cores
each process is pinned to."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from gateway.process.cpus import worker_cpus
from proto import node_pb2
from scripts.bench.fake_node import FakeNodeConfig, FakeRequest, StepSource
from scripts.bench.fake_node import build_config as fake_node_config
from scripts.bench.gateway_cpu import (
    Row,
    WorkerCounts,
    WorkerWindow,
    build_config,
    fake_node_id,
    requests_by_worker,
    table,
    worker_counts,
    worker_table,
)
from scripts.bench.pinning import group_cores, parse_cpu_list, pinned, plan_cpus


def _source(per_message: int = 1) -> StepSource:
    config = FakeNodeConfig("b:1", "a:2", (10, 11, 12), tokens_per_message=per_message)
    return StepSource(config)


def _batch(source: StepSource) -> dict[str, tuple[list[int], str]]:
    batch = node_pb2.StreamBatch.FromString(source.batch())
    return {
        d.rid: (list(d.chunk.token_ids), d.finished.finish_reason if d.HasField("finished") else "")
        for d in batch.deltas
    }


def test_fake_node_merges_steps_the_stream_did_not_take() -> None:
    async def run() -> None:
        source = _source()
        source.open["a"] = FakeRequest(wanted=4, prompt_tokens=3)
        source.open["b"] = FakeRequest(wanted=2, prompt_tokens=3)
        source.step()
        assert _batch(source) == {"a": ([10], ""), "b": ([10], "")}
        source.step()
        source.step()  # the call was busy: two steps' tokens go out together
        assert _batch(source) == {"a": ([11, 12], ""), "b": ([11], "length")}
        assert "b" not in source.open
        assert _batch(source) == {}  # nothing new since the last batch
        source.step()
        source.step()  # past `wanted`: no more tokens
        assert _batch(source) == {"a": ([10], "length")}

    asyncio.run(run())


def test_fake_node_flags() -> None:
    config = fake_node_config(["--bootstrap", "h:1", "--port", "5", "--token-ids", "1,2"])
    assert config.step_s == 0 and config.token_ids == (1, 2) and config.address.endswith(":5")
    assert config.node_id == ""  # the bootstrap names it
    named = fake_node_config(["--bootstrap", "h:1", "--port", "5", "--token-ids", "1",
                              "--node-id", "fake-03"])  # fmt: skip
    assert named.node_id == "fake-03"
    paced = fake_node_config(["--bootstrap", "h:1", "--port", "5", "--token-ids", "1", "--step-ms",
                              "6.4"])  # fmt: skip
    assert paced.step_s == pytest.approx(0.0064)
    with pytest.raises(SystemExit):
        fake_node_config(["--bootstrap", "h:1", "--port", "5", "--token-ids", "1", "--step-ms",
                          "-1"])  # fmt: skip


def test_gateway_cpu_rows_and_table() -> None:
    one = Row(1, 1, tokens=40_000, requests=80, frames=20_000, wall_s=1.0, cpu_s=0.8,
              node_cpu_s=0.2, client_busy=0.5)  # fmt: skip
    two = Row(2, 1, tokens=72_000, requests=140, frames=72_000, wall_s=1.0, cpu_s=1.8,
              node_cpu_s=0.3)  # fmt: skip
    assert one.us_per_token == pytest.approx(20.0) and one.tokens_per_frame == 2.0
    assert two.busy == pytest.approx(0.9)
    lines = table([one, two]).splitlines()
    assert lines[2].startswith("| 1 | 1 | 20.0 | 1.25 | 40,000 | 40,000 | 1.00x | 1.00 of 40k |")
    assert "| 1.80x | 1.12 |" in lines[3]  # 1.8x for two workers against 0.8 x 2
    # repeats (`--workers 1,2,1,2`): each row against the one-worker row run last before it
    again = Row(1, 1, tokens=20_000, requests=1, frames=1, wall_s=1.0, cpu_s=1.0, node_cpu_s=0.0)
    lines = table([one, two, again, two]).splitlines()
    assert "| 1.80x |" in lines[3] and "| 3.60x |" not in lines[3]
    assert "| 3.60x |" in lines[5]  # 72,000 against the 20,000 of the row before it
    assert build_config(["--load-tool", "bench_serving"]).load_tool == "bench_serving"
    with pytest.raises(SystemExit):
        build_config(["--workers", "0"])


def test_gateway_cpu_decode_policy_flag_and_pinning_report() -> None:
    assert build_config([]).decode_policy == "kv_aware"  # the gateway's own default
    config = build_config(["--decode-policy", "worker_affinity", "--fake-nodes", "4"])
    assert config.decode_policy == "worker_affinity" and config.fake_nodes == 4
    with pytest.raises(SystemExit):
        build_config(["--decode-policy", "pinned"])  # not a registered policy
    # the fake nodes' ids sort as their indices (past 9 too): worker i -> fake node i
    ids = [fake_node_id(i) for i in (0, 1, 2, 10)]
    assert sorted(reversed(ids)) == ids
    series = "pdserve_gateway_worker_node_requests"
    colocated = 'role="colocated"'
    metrics = "\n".join(
        [
            f"# TYPE {series}_total counter",
            f'{series}_total{{node_id="fake-00",{colocated},worker="0"}} 12.0',
            f'{series}_total{{node_id="fake-01",{colocated},worker="1"}} 9.0',
            f'{series}_total{{node_id="fake-00",{colocated},worker="1"}} 2.0',
            f'{series}_created{{node_id="fake-00",{colocated},worker="0"}} 1.7e9',
            'pdserve_gateway_node_requests_total{node_id="fake-00",role="colocated"} 14.0',
            'pdserve_gateway_requests_total{endpoint="completions",status="200"} 23.0',
        ]
    )
    assert requests_by_worker(metrics) == {0: {"fake-00": 12}, 1: {"fake-01": 9, "fake-00": 2}}
    row = Row(4, 1, tokens=1000, requests=8, frames=1000, wall_s=1.0, cpu_s=0.1, node_cpu_s=0.2,
              decode_policy="worker_affinity", nodes_per_worker=(1, 1, 1, 1),
              node_busy=(0.25, 0.5))  # fmt: skip
    assert table([row]).splitlines()[2].endswith("| worker_affinity | 1 1 1 1 | 0.25 0.50 |")


def test_gateway_cpu_reads_each_workers_share_from_the_metrics() -> None:
    metrics = "\n".join(
        [
            'pdserve_gateway_worker_connections_total{worker="0"} 30.0',
            'pdserve_gateway_worker_connections_total{worker="1"} 10.0',
            'pdserve_gateway_worker_node_requests_total{node_id="fake-00",role="colocated",'
            'worker="1"} 4.0',
            'pdserve_gateway_worker_node_requests_total{node_id="fake-01",role="colocated",'
            'worker="1"} 5.0',
            'pdserve_gateway_worker_node_batches_total{worker="1"} 100.0',
            'pdserve_gateway_worker_node_deltas_total{worker="1"} 800.0',
            'pdserve_gateway_worker_completion_tokens_total{worker="1"} 2048.0',
            'pdserve_gateway_worker_inflight{worker="1"} 7.0',
            "pdserve_gateway_inflight 9.0",
        ]
    )
    counts = worker_counts(metrics)
    assert counts[0] == WorkerCounts(connections=30.0)
    assert counts[1] == WorkerCounts(10.0, 9.0, 2048.0, 100.0, 800.0, 7.0)  # requests summed
    before = WorkerCounts(4.0, 3.0, 1024.0, 40.0, 200.0, 5.0)
    window = WorkerWindow(1, 4242, before, counts[1].minus(before), before.inflight, 0.6)
    assert window.window == WorkerCounts(6.0, 6.0, 1024.0, 60.0, 600.0, 7.0)
    assert window.mean_batch == 10.0  # deltas per node message
    row = Row(2, 1, tokens=1, requests=1, frames=1, wall_s=2.0, cpu_s=1.0, node_cpu_s=0.0,
              per_worker=(window,), step_ms=10.0, worker_listen="shared")  # fmt: skip
    line = worker_table([row]).splitlines()[2]
    # 0.6 CPU s over 2 s of window; 0.6 s / 600 deltas = 1000 us per delta
    assert line == (
        "| 2 | 1 | 10 | shared | 1 | 4242 | 4 | 6 | 6 | 5 -> 7 | 1,024 | 60 | 10.0 | 0.30 | "
        "1000.0 |"
    )


def test_cpu_plan_gives_each_gateway_worker_a_core_of_its_own() -> None:
    # 8 cores x 2 threads, numbered as Linux does on x86 (siblings n and n + 8)
    siblings = {cpu: (cpu % 8, cpu % 8 + 8) for cpu in range(16)}
    cores = group_cores(list(range(16)), siblings)
    assert cores[:2] == [(0, 8), (1, 9)] and len(cores) == 8
    plan = plan_cpus(cores, gateway=4, nodes=1)
    assert plan.gateway == ((0, 8), (1, 9), (2, 10), (3, 11))
    assert plan.gateway_cpus == (0, 8, 1, 9, 2, 10, 3, 11)
    assert plan.worker_cpus(4) == "0,1,2,3" and plan.worker_cpus(2) == "0,1"  # a thread a core
    assert worker_cpus(plan.worker_cpus(4), range(16)) == (0, 1, 2, 3)  # what the gateway takes
    assert plan.nodes == ((4, 12),)
    assert plan.clients == (5, 13, 6, 14, 7, 15)
    every = [*plan.gateway_cpus, *(c for core in plan.nodes for c in core), *plan.clients]
    assert sorted(every) == list(range(16))  # each thread in exactly one set
    assert "gateway workers 0,8 1,9 2,10 3,11" in plan.describe()
    # two token sources: a core each
    assert plan_cpus(cores, gateway=2, nodes=2).nodes == ((2, 10), (3, 11))
    # no SMT, or an affinity mask that leaves one thread of a core: single-thread cores
    assert group_cores([0, 1, 2, 9], siblings) == [(0,), (1, 9), (2,)]
    flat = plan_cpus(group_cores(list(range(4)), {}), gateway=2, nodes=1)
    assert flat.gateway == ((0,), (1,)) and flat.nodes == ((2,),) and flat.clients == (3,)
    with pytest.raises(ValueError, match="needs 4 physical cores; this host has 2"):
        plan_cpus([(0,), (1,)], gateway=2, nodes=1)
    assert parse_cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)


def test_gateway_cpu_sizes_clients_to_the_workers() -> None:
    config = build_config(["--clients-per-worker", "2", "--pin"])
    assert config.pin and config.client_processes(4) == 8 and config.client_processes(1) == 2
    assert build_config(["--clients", "3"]).client_processes(4) == 3
    assert build_config(["--worker-cpus", "0,1"]).worker_cpus == "0,1"
    with pytest.raises(SystemExit):
        build_config(["--worker-cpus", "0,1", "--pin"])  # --pin plans the workers' CPUs
    with pytest.raises(SystemExit):
        build_config(["--clients-per-worker", "-1"])
    assert build_config(["--pin", "--idle-cpus", "16-17,20"]).idle_cpus == (16, 17, 20)
    with pytest.raises(SystemExit):
        build_config(["--idle-cpus", "16"])  # shapes the --pin plan only


def test_cpu_plan_gives_idle_cpus_to_no_one() -> None:
    cores = [(c,) for c in range(8)]
    plan = plan_cpus(cores, gateway=2, nodes=1, idle=(5, 6))
    assert plan.gateway == ((0,), (1,)) and plan.nodes == ((2,),)
    assert plan.clients == (3, 4, 7)
    smt = [(0, 4), (1, 5), (2, 6), (3, 7)]  # a CPU of a core idles the whole core
    assert plan_cpus(smt, gateway=1, nodes=1, idle=(5,)).clients == (3, 7)
    with pytest.raises(ValueError, match="needs 3 physical cores"):
        plan_cpus(cores[:4], gateway=1, nodes=1, idle=(0, 1))


def test_pinned_processes_inherit_the_cpu_set() -> None:
    before = os.sched_getaffinity(0)
    cpu = min(before)
    with pinned([cpu]):
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
            capture_output=True,
            text=True,
            check=True,
        )
    assert child.stdout.strip() == f"[{cpu}]"
    assert os.sched_getaffinity(0) == before  # restored


def test_fake_node_hand_encoding_is_protobufs() -> None:
    """The hand-encoded deltas parse as protobuf builds them: multi-byte varints (ids past 127
    and 16,383) and a rid whose length needs two bytes."""
    config = FakeNodeConfig("b:1", "a:2", (5, 300, 70_000, 128_255), tokens_per_message=3)
    source = StepSource(config)
    long_rid = "r" * 200
    source.open[long_rid] = FakeRequest(wanted=7, prompt_tokens=1)
    source.open["s"] = FakeRequest(wanted=3, prompt_tokens=1)
    source.step()
    assert _batch(source) == {long_rid: ([5, 300, 70_000], ""), "s": ([5, 300, 70_000], "length")}
    source.step()
    source.step()
    assert _batch(source) == {long_rid: ([128_255, 5, 300, 70_000], "length")}
