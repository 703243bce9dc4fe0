"""Processes die under steady load (issue 8, item 1): real processes, real SIGKILL and SIGSTOP.

A 2P2D cluster (bootstrap, prefill-0/1, decode-0/1, gateway; tests/fault_cluster.py) serves the
load tester's streamed requests at a steady rate while, in turn, one prefill node is killed, one
decode node is killed, one prefill node is frozen past the heartbeat timeout, the bootstrap is
killed and started again on its address, and the gateway is killed and started again. Each case
checks, from what the clients got:

- no request is lost: each one either gives exactly the reference text (greedy, computed on the
  healthy cluster) or ends with a clear error (the gateway's HTTP error or SSE error event with
  a message; a broken or refused connection while the gateway itself is down);
- no request hangs: the longest one ends within the bound the configured timeouts give
  (`HANG_BOUND_S`);
- new requests succeed: every request sent more than `NEW_REQUESTS_S` after the fault (after
  the restart for the gateway; `RESUME_S` after the bootstrap's restart, once the nodes
  re-registered) succeeds, and there are such requests;
- no page leaks: every surviving node settles idle with no page in use and a clean integrity
  check (free + used + cached == total).

Each case adds a row to the fault table (printed at the end of the module, and written to
`fault-table.md` in the pytest temp dir): requests in flight at the fault, lost (must be 0),
pages leaked (must be 0), recovery time measured from the outcomes. The killed node is started
again by the next case. Slow (a few minutes per backend): marked `faults`, `make test-faults`.
The backends: mooncake and nixl on the CPU; cuda_ipc (killed peer: its copies into or out of a
dead process's GPU memory) only where a CUDA GPU is visible, its nodes with `--device cuda`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from gateway.dispatch.pd_client import PREFILL_ANSWER_GRACE_S
from proto import node_pb2
from tests.fault_cluster import (
    FaultCluster,
    Outcome,
    Row,
    SteadyLoad,
    Timeouts,
    Verdict,
    cluster_fixture,
    gateway_error,
    gateway_gone,
    judge,
    prompts,
    reference_texts,
    write_table,
)

pytestmark = pytest.mark.faults

# cuda_ipc copies GPU to GPU only (a CPU KV pool is refused): its nodes run on the GPU and its
# cases are skipped where none is visible (`make test-faults` on the device machine runs them).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_ipc needs a CUDA GPU")
BACKENDS = ["mooncake", "nixl", pytest.param("cuda_ipc", marks=needs_cuda)]
TIMEOUTS = Timeouts()
RATE = 5.0  # requests per second
MAX_TOKENS = 32  # long enough that several requests are in flight at a fault
PROMPTS = prompts(count=32, length=96, seed=8)  # 3 prefill chunks of 32 each
WARMUP_S = 2.0
NEW_REQUESTS_S = 5.0  # after a node's fault, requests sent later must succeed
RESUME_S = 10.0  # after the bootstrap is back
AFTER_S = 3.0  # load goes on this long after those windows
FREEZE_S = 2.5 * TIMEOUTS.heartbeat_timeout_s
BOOTSTRAP_DOWN_S = 1.0
MAX_ATTEMPTS = 3  # the gateway's default: nodes tried before the first token
# Per attempt: a dead peer is known after the heartbeat timeout; at worst a wait for KV (or for
# a destination) runs its whole timeout; after D gave up, the gateway waits for P's answer at
# most its grace. Plus slack for a loaded 2-core machine.
HANG_BOUND_S = (
    MAX_ATTEMPTS
    * (
        max(TIMEOUTS.transfer_s, TIMEOUTS.bootstrap_s)
        + TIMEOUTS.heartbeat_timeout_s
        + PREFILL_ANSWER_GRACE_S
    )
    + 5.0
)
NODES: dict[str, tuple[str, list[str]]] = {
    "prefill-0": ("prefill-server", []),
    "prefill-1": ("prefill-server", []),
    "decode-0": ("decode-server", []),
    "decode-1": ("decode-server", []),
}
GATEWAY_ARGS = (
    "--local-prefill-max-tokens", "0",  # every prompt through a prefill node
    "--prefill-policy", "round_robin",
    "--decode-policy", "round_robin",
    "--max-attempts", str(MAX_ATTEMPTS),
)  # fmt: skip


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Row]]:
    rows: list[Row] = []
    yield rows
    write_table(rows, tmp_path_factory.getbasetemp() / "fault-table-under-load.md")


cluster = cluster_fixture("faults", NODES, GATEWAY_ARGS, TIMEOUTS, BACKENDS)


@pytest.fixture(scope="module")
def reference(cluster: FaultCluster) -> list[str]:
    return reference_texts(cluster.url, cluster.model_name, PROMPTS, MAX_TOKENS)


# ---- one run ----------------------------------------------------------------------------------


@dataclass
class Fault:
    at: float  # when it was injected (load clock)
    since: float  # new requests must succeed from `since + window` on
    note: str = ""


def run_fault(
    cluster: FaultCluster,
    reference: list[str],
    table: list[Row],
    name: str,
    inject: Callable[[SteadyLoad], Fault],
    window_s: float,
    clear: Callable[[Outcome], bool] = gateway_error,
) -> Verdict:
    cluster.ensure()
    restarts_gateway = name.startswith("gateway")
    retries_before = cluster.gateway_metric("pdserve_gateway_retries_total")
    moved_before = cluster.gateway_metric("pdserve_gateway_migrations_total")
    gap_before = migration_gap(cluster)
    with SteadyLoad(cluster.url, cluster.model_name, PROMPTS, RATE, MAX_TOKENS) as load:
        time.sleep(WARMUP_S)
        fault = inject(load)
        end = fault.since + window_s + AFTER_S
        time.sleep(max(end - load.now(), 0.0))
        outcomes = load.stop()
    verdict = judge(outcomes, reference, fault.at, clear)
    survivors = [n for n in cluster.node_names() if cluster.procs[n].alive]
    leaked = cluster.leaked_pages(survivors)
    retries = cluster.gateway_metric("pdserve_gateway_retries_total") - retries_before
    moved = cluster.gateway_metric("pdserve_gateway_migrations_total") - moved_before
    gap = migration_gap(cluster)
    moves = gap[1] - gap_before[1]
    if moves and not restarts_gateway:
        fault.note += f"; moved streams waited {(gap[0] - gap_before[0]) / moves:.2f} s on average"
    table.append(
        Row(
            fault=name,
            backend=cluster.backend,
            sent=len(outcomes),
            in_flight=verdict.in_flight,
            correct=len(verdict.correct),
            failed=len(verdict.failed),
            lost=len(verdict.lost),
            retries="-" if restarts_gateway else str(int(retries)),
            leaked=sum(leaked.values()),
            recovery_s=verdict.recovery_s(fault.since),
            longest_s=verdict.longest_s(),
            note=fault.note,
            migrations="-" if restarts_gateway else str(int(moved)),
        )
    )

    assert not verdict.lost, f"lost requests: {verdict.lost[:5]}"
    assert sum(leaked.values()) == 0, f"pages leaked: {leaked}"
    early = [o for o in verdict.failed if o.done < fault.at]
    assert not early, f"requests failed before the fault: {early[:3]}"
    assert verdict.longest_s() <= HANG_BOUND_S, f"a request took {verdict.longest_s():.1f} s"
    recovery = verdict.recovery_s(fault.since)
    assert recovery <= window_s, (
        f"requests sent {recovery:.1f} s after the fault still failed: "
        f"{[(o.sent - fault.since, o.error, o.detail) for o in verdict.failed[-3:]]}"
    )
    assert verdict.succeeded_after(fault.since + window_s) > 0, "no request after the window"
    return verdict


def migration_gap(cluster: FaultCluster) -> tuple[float, float]:
    """(sum, count) of the gateway's migration gaps: failure -> first token from the new node."""
    name = "pdserve_gateway_migration_gap_seconds"
    if not cluster.procs["gateway"].alive:
        return 0.0, 0.0
    return cluster.gateway_metric(name + "_sum"), cluster.gateway_metric(name + "_count")


def kill_while_busy(cluster: FaultCluster, name: str) -> Callable[[SteadyLoad], Fault]:
    """SIGKILL the node as soon as it holds a request (so one dies with it)."""

    def inject(load: SteadyLoad) -> Fault:
        server = cluster[name]
        deadline = time.monotonic() + 10.0
        while True:
            node_load = server.stub.GetLoad(node_pb2.GetLoadRequest(), timeout=10)
            held = node_load.running_requests + node_load.queued_requests
            if held or time.monotonic() > deadline:
                break
        at = load.now()
        cluster.kill(name)
        return Fault(at, at, f"{held} request(s) on the node when killed")

    return inject


# ---- the cases --------------------------------------------------------------------------------


def test_prefill_killed(cluster: FaultCluster, reference: list[str], table: list[Row]) -> None:
    """SIGKILL prefill-1: its requests move to prefill-0 (retries before the first token) or
    fail clearly; the rest complete correctly; no leak on the three survivors."""
    run_fault(
        cluster,
        reference,
        table,
        "prefill SIGKILL",
        kill_while_busy(cluster, "prefill-1"),
        NEW_REQUESTS_S,
    )


def test_decode_killed(cluster: FaultCluster, reference: list[str], table: list[Row]) -> None:
    """SIGKILL decode-1: streams it was sending move to decode-0 (migration: prompt + streamed
    tokens re-issued) and requests before their first token are retried there, so none fails
    and every text equals the uninterrupted run's; no leak on the survivors."""
    verdict = run_fault(
        cluster,
        reference,
        table,
        "decode SIGKILL",
        kill_while_busy(cluster, "decode-1"),
        NEW_REQUESTS_S,
    )
    assert not verdict.failed, [(o.error, o.detail) for o in verdict.failed[:3]]


def test_prefill_frozen_past_heartbeat(
    cluster: FaultCluster, reference: list[str], table: list[Row]
) -> None:
    """SIGSTOP prefill-0 for 2.5 heartbeat timeouts, then SIGCONT: bootstrap declares it dead,
    its rooms fail towards D (which keeps their pages until P confirms it stopped), requests
    move to prefill-1; the thawed node re-registers and serves again; no leak anywhere."""
    victim = cluster["prefill-0"]
    victim_id = cluster.node_id("prefill-0")
    b_log = cluster["bootstrap"].log_path
    b_offset = b_log.stat().st_size

    def inject(load: SteadyLoad) -> Fault:
        at = load.now()
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            time.sleep(FREEZE_S)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        return Fault(at, at, f"frozen {FREEZE_S:.1f} s")

    run_fault(cluster, reference, table, "prefill SIGSTOP", inject, NEW_REQUESTS_S)
    with b_log.open("rb") as log:
        log.seek(b_offset)
        since = log.read().decode(errors="replace")
    assert f"prefill node {victim_id} missed heartbeats" in since, "never declared dead"
    cluster.wait_gateway_sees_all()  # it re-registered


def test_bootstrap_killed_and_restarted(
    cluster: FaultCluster, reference: list[str], table: list[Row]
) -> None:
    """SIGKILL the bootstrap, start it again on its address: rooms it held fail clearly (or are
    retried), nodes re-register on their next heartbeat, the gateway reloads its node table, and
    every request sent `RESUME_S` after the restart succeeds."""

    def inject(load: SteadyLoad) -> Fault:
        at = load.now()
        cluster.kill("bootstrap")
        time.sleep(BOOTSTRAP_DOWN_S)
        cluster.start_bootstrap()
        back = load.now()
        cluster.wait_gateway_sees_all(timeout=RESUME_S)
        rejoined = load.now() - back
        return Fault(
            at,
            back,
            f"down {back - at:.1f} s; all 4 nodes routed again {rejoined:.1f} s after restart",
        )

    run_fault(cluster, reference, table, "bootstrap SIGKILL + restart", inject, RESUME_S)


def test_gateway_killed_and_restarted(
    cluster: FaultCluster, reference: list[str], table: list[Row]
) -> None:
    """SIGKILL the gateway, start it again on its port: its open streams break, requests while
    it is down are refused; the nodes abort what it had sent them (no leak), and every request
    sent `NEW_REQUESTS_S` after it answers again succeeds."""

    def inject(load: SteadyLoad) -> Fault:
        at = load.now()
        cluster.kill("gateway")
        start_s = cluster.start_gateway()
        back = load.now()
        return Fault(at, back, f"restart took {start_s:.1f} s (process start to /health 200)")

    run_fault(
        cluster, reference, table, "gateway SIGKILL + restart", inject, NEW_REQUESTS_S, gateway_gone
    )
