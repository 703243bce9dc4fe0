"""Role switching without a restart (engine/node/role_switch.py), with real processes.

A bootstrap, one prefill node, two decode nodes (Mooncake over TCP on 127.0.0.1) and a gateway,
with the tiny random-weight llama and the default model's tokenizer. Under a steady stream of
greedy requests through the gateway, `pdserve-admin switch-role` (run as a process) turns
decode-1 into a prefill node, then back into a decode node (a prefill node switched). Each
time:

- no request is lost: every request sent before, during and after the switch completes with
  the text the unswitched cluster gave its prompt (the drain aborts what outlives its short
  --drain-timeout, and the gateway moves those streams to the other decode node);
- no page leaks: every node ends with no page in use and a clean integrity check;
- the gateway routes by the new role: requests sent afterwards go through the switched node in
  that role (its role's room counter moves), and `pdserve-admin list-nodes` lists it so;
- the node counts the switch (`pdserve_node_role_switches_total{from,to}`) and its
  `pdserve_node_info` names the new role; it kept its node id.

Then the colocated role, and the admin command's refusals.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.ports import free_port
from proto import node_pb2
from tests.fault_cluster import (
    FaultCluster,
    SteadyLoad,
    cluster_fixture,
    judge,
    prompts,
    reference_texts,
)

MAX_TOKENS = 48
PROMPTS = prompts(count=6, length=40, seed=20)
RATE = 4.0  # requests per second
METRICS_PORTS = {name: free_port() for name in ("prefill-0", "decode-0", "decode-1")}
# decode-1 gives its streams 0.1 s when it drains for a switch: longer ones are aborted and move.
NODES: dict[str, tuple[str, list[str]]] = {
    "prefill-0": ("prefill-server", ["--metrics-port", str(METRICS_PORTS["prefill-0"])]),
    "decode-0": ("decode-server", ["--metrics-port", str(METRICS_PORTS["decode-0"])]),
    "decode-1": (
        "decode-server",
        ["--metrics-port", str(METRICS_PORTS["decode-1"]), "--drain-timeout", "0.1"],
    ),
}
GATEWAY_ARGS = (
    "--local-prefill-max-tokens", "0",  # every prompt goes through a prefill node
    "--decode-policy", "round_robin",
    "--prefill-policy", "round_robin",  # a second prefill node gets every other prompt
)  # fmt: skip


cluster = cluster_fixture("role-switch", NODES, GATEWAY_ARGS)


@pytest.fixture(scope="module")
def reference(cluster: FaultCluster) -> list[str]:
    return reference_texts(cluster.url, cluster.model_name, PROMPTS, MAX_TOKENS)


def admin(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bootstrap.admin", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def node_metric(name: str, metric: str, **labels: str) -> float:
    """A sample of node `name`'s /metrics (0 when absent)."""
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORTS[name]}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def listed_roles(cluster: FaultCluster) -> dict[str, str]:
    """node id -> role, as `pdserve-admin list-nodes` prints them."""
    result = admin("list-nodes", "--bootstrap", cluster.bootstrap_address)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["node", "role", "address"]
    return {line.split()[0]: line.split()[1] for line in lines[1:]}


def switch_under_load(
    cluster: FaultCluster, reference: list[str], role: str, must_hold: bool
) -> str:
    """Switch decode-1 to `role` while requests stream (once it holds one, if `must_hold`;
    a prefill node's requests last milliseconds, so else after 2 s at most); checks nothing
    was lost or leaked. Returns what pdserve-admin printed."""
    node_id = cluster.node_id("decode-1")
    moved_before = cluster.gateway_metric("pdserve_gateway_migrations_total")
    with SteadyLoad(cluster.url, cluster.model_name, PROMPTS, RATE, MAX_TOKENS) as load:
        deadline = time.monotonic() + (30 if must_hold else 2)
        while not _holds_requests(cluster, "decode-1"):  # switch with work on it
            if time.monotonic() > deadline:
                assert not must_hold, "decode-1 never got a request"
                break
            time.sleep(0.02)
        switched_at = load.now()
        result = admin("switch-role", node_id, role, "--bootstrap", cluster.bootstrap_address)
        assert result.returncode == 0, result.stdout + result.stderr
        time.sleep(2.0)  # keep the load on after the switch
        outcomes = load.stop()
    moved = cluster.gateway_metric("pdserve_gateway_migrations_total") - moved_before
    print(f"\n{result.stdout.strip()}; {len(outcomes)} requests, {moved:.0f} streams moved")
    verdict = judge(outcomes, reference, switched_at, clear_errors=lambda o: False)
    assert not verdict.lost, verdict.lost[:3]
    assert len(verdict.correct) == len(outcomes) >= 8
    assert sum(1 for o in outcomes if o.sent > switched_at) >= 4
    leaked = cluster.leaked_pages(cluster.node_names())
    assert leaked == dict.fromkeys(cluster.node_names(), 0)
    health = cluster["decode-1"].stub.Health(node_pb2.HealthRequest(), timeout=10)
    assert (health.role, health.node_id) == (role, node_id)
    assert listed_roles(cluster)[node_id] == role
    return result.stdout


def _holds_requests(cluster: FaultCluster, name: str) -> bool:
    load = cluster[name].stub.GetLoad(node_pb2.GetLoadRequest(), timeout=10)
    return load.running_requests + load.queued_requests > 0


def complete(cluster: FaultCluster, index: int) -> str:
    payload = {"model": cluster.model_name, "prompt": list(PROMPTS[index]),
               "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    response = httpx.post(cluster.url + "/v1/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def assert_serves_rooms(cluster: FaultCluster, reference: list[str], rooms_metric: str) -> None:
    """Four prompts come back as the reference, and decode-1 finished a room of its new role."""
    before = node_metric("decode-1", rooms_metric, outcome="done")
    for index in range(4):
        assert complete(cluster, index) == reference[index]
    assert node_metric("decode-1", rooms_metric, outcome="done") >= before + 1


def assert_switch_counted(printed: str, old: str, new: str) -> None:
    """pdserve-admin printed `old -> new`; decode-1 counted that switch once and its
    `pdserve_node_info` names `new` alone."""
    assert f"{old} -> {new}" in printed
    switch = {"from": old, "to": new}
    assert node_metric("decode-1", "pdserve_node_role_switches_total", **switch) == 1
    assert node_metric("decode-1", "pdserve_node_info", role=new) == 1
    assert node_metric("decode-1", "pdserve_node_info", role=old) == 0


def test_a_decode_node_switches_to_prefill_under_load(
    cluster: FaultCluster, reference: list[str]
) -> None:
    printed = switch_under_load(cluster, reference, "prefill", must_hold=True)
    assert_switch_counted(printed, "decode", "prefill")
    # Routed as a prefill node now: round robin over two prefill nodes gives it half the prompts.
    assert_serves_rooms(cluster, reference, "pdserve_prefill_rooms_total")


def test_a_prefill_node_switches_back_to_decode_under_load(
    cluster: FaultCluster, reference: list[str]
) -> None:
    printed = switch_under_load(cluster, reference, "decode", must_hold=False)
    assert_switch_counted(printed, "prefill", "decode")
    assert_serves_rooms(cluster, reference, "pdserve_decode_rooms_total")


def test_a_node_serves_colocated_and_comes_back(
    cluster: FaultCluster, reference: list[str]
) -> None:
    """Colocated: registered as such, it takes whole requests (no room) and prefills them
    itself; the gateway counts it and routes to it."""
    node_id = cluster.node_id("decode-1")
    bootstrap = cluster.bootstrap_address
    result = admin("switch-role", node_id, "colocated", "--bootstrap", bootstrap)
    assert result.returncode == 0, result.stderr
    try:
        assert listed_roles(cluster)[node_id] == "colocated"
        health = httpx.get(cluster.url + "/health", timeout=10).json()
        assert (health["prefill"], health["decode"], health["colocated"]) == (1, 1, 1)
        before = node_metric("decode-1", "pdserve_node_prefill_tokens_total")
        for index in range(4):
            assert complete(cluster, index) == reference[index]
        assert node_metric("decode-1", "pdserve_node_prefill_tokens_total") > before
    finally:
        result = admin("switch-role", node_id, "decode", "--bootstrap", bootstrap)
    assert result.returncode == 0, result.stderr
    assert cluster.leaked_pages(["decode-1"]) == {"decode-1": 0}


def test_admin_refusals_say_what_to_do(cluster: FaultCluster) -> None:
    bootstrap = cluster.bootstrap_address
    node_id = cluster.node_id("decode-0")
    same = admin("switch-role", node_id, "decode", "--bootstrap", bootstrap)
    assert same.returncode == 0 and "already serves the decode role" in same.stdout
    unknown = admin("switch-role", "nobody", "prefill", "--bootstrap", bootstrap)
    assert unknown.returncode == 2 and "list-nodes" in unknown.stderr
    gone = admin("list-nodes", "--bootstrap", f"127.0.0.1:{free_port()}")
    assert gone.returncode == 3 and "is it running?" in gone.stderr
    # 2P1D: decode-0 is the last node that decodes; it stays one.
    other = cluster.node_id("decode-1")
    assert admin("switch-role", other, "prefill", "--bootstrap", bootstrap).returncode == 0
    try:
        last = admin("switch-role", node_id, "prefill", "--bootstrap", bootstrap)
        assert last.returncode == 1 and "the last node that decodes" in last.stderr
        assert "--force" in last.stderr
    finally:
        assert admin("switch-role", other, "decode", "--bootstrap", bootstrap).returncode == 0
    stub = cluster["decode-0"].stub
    for request, said in [
        (node_pb2.SwitchRoleRequest(role="verifier"), "use one of prefill, decode, colocated"),
        (node_pb2.SwitchRoleRequest(role="prefill", drain_timeout_s=-1), "must be >= 0"),
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            stub.SwitchRole(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert said in str(refused.value.details())
    assert stub.Health(node_pb2.HealthRequest(), timeout=10).role == "decode"  # unchanged


def test_the_planner_switches_roles_through_the_bootstrap(
    cluster: FaultCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pd-planner --actuator switch on recorded prefill-heavy windows (1P2D -> 2P1D): the
    least busy decode node becomes a prefill node in place, and the decision says so."""
    from planner.cli import main
    from tests.test_pd_planner import _prefill_heavy, _profile_file

    before = listed_roles(cluster)
    assert sorted(before.values()) == ["decode", "decode", "prefill"]
    # --sim-warmup 0: from an empty cluster, the arithmetic of test_pd_planner's record
    argv = ["--replay", str(_prefill_heavy(tmp_path / "rec.jsonl")),
            "--profile", str(_profile_file(tmp_path)), "--budget", "3", "--slo-ttft-ms", "3000",
            "--slo-tpot-ms", "100", "--sim-seconds", "20", "--actuator", "switch",
            "--bootstrap", cluster.bootstrap_address, "--sim-warmup", "0"]  # fmt: skip
    assert main(argv) == 0
    decisions = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["action"] for d in decisions] == ["switch", "hold", "hold"]
    first = decisions[0]
    assert first["acted"] and first["target"] == "2P1D"
    after = listed_roles(cluster)
    (moved,) = [n for n in before if before[n] != after[n]]
    assert (before[moved], after[moved]) == ("decode", "prefill")
    assert first["actuator"].startswith(f"switched {moved} decode->prefill in ")
    # Back to 1P2D for whoever comes next.
    result = admin("switch-role", moved, "decode", "--bootstrap", cluster.bootstrap_address)
    assert result.returncode == 0, result.stderr
