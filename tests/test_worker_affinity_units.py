"""The `worker_affinity` routing policy on a table of fake candidates (no processes): gateway
worker i keeps to node i mod M of the side's nodes in id order, and goes to the least-loaded
other candidate only when that node cannot take the request (draining, cooling down, failed for
this request, full); load alone never moves it. Its worker index reaches it through the config.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.config import GatewayConfig, LimitsConfig, ModelInfo
from gateway.routing.nodes import COLOCATED, DECODE, PREFILL, LiveNode, NodeDirectory
from gateway.routing.policies import Router, WorkerAffinity, make_policy
from proto import bootstrap_pb2
from tests.helpers import routing_config

ROUTING = routing_config("worker_affinity", "worker_affinity", 4)
LONG = list(range(10))  # past local_prefill_max_tokens: a prefill node is chosen too
NODES = ("d-0", "d-1", "d-2", "d-3")
# Requests each node has; the least loaded is d-2, then d-1.
INFLIGHT = {"d-0": 5, "d-1": 3, "d-2": 1, "d-3": 7}


def _node(node_id: str, role: int, inflight: int = 0) -> LiveNode:
    return LiveNode(node_id, role, "127.0.0.1:1", stub=None, inflight=inflight)  # type: ignore[arg-type]


def _directory(role: int = DECODE) -> NodeDirectory:
    directory = NodeDirectory(cooldown_s=5.0)
    for node_id in reversed(NODES):  # not in id order: the policy sorts
        directory.nodes[node_id] = _node(node_id, role, INFLIGHT[node_id])
    return directory


def _refuse(directory: NodeDirectory, node_id: str, how: str) -> set[str]:
    """Make `node_id` unable to take a request in one of the ways a node can; the excluded set."""
    node = directory.nodes[node_id]
    if how == "draining":
        node.load = bootstrap_pb2.NodeLoad(draining=True)
    elif how == "cooling":
        directory.report_unreachable(node_id)
    elif how == "full":
        node.load = bootstrap_pb2.NodeLoad(free_pages=0, total_pages=64)
    elif how == "busy":  # many requests but pages left: not a refusal
        node.inflight = 1000
        node.load = bootstrap_pb2.NodeLoad(running_requests=900, free_pages=1, total_pages=64)
    elif how == "excluded":
        return {node_id}
    return set()


@pytest.mark.parametrize("role", [DECODE, COLOCATED], ids=["decode", "colocated"])
@pytest.mark.parametrize("worker", [0, 1, 2, 3, 4, 7])
def test_each_worker_keeps_to_its_node(role: int, worker: int) -> None:
    router = Router(_directory(role), ROUTING, worker_index=worker)
    for _ in range(5):  # every request, whatever the load
        assert router.choose([1, 2]).decode.node_id == NODES[worker % 4]


@pytest.mark.parametrize(
    ("worker", "refusal", "expected"),
    [
        (1, "draining", "d-2"),  # d-1 refuses: the least loaded of the others
        (1, "cooling", "d-2"),
        (1, "excluded", "d-2"),  # it already failed for this request
        (1, "full", "d-2"),
        (2, "draining", "d-1"),  # d-2 itself is the least loaded: the next one
        (2, "full", "d-1"),  # a full node is not the spill target either
        (1, "busy", "d-1"),  # load alone never moves a worker off its node
        (3, "busy", "d-3"),
    ],
)
def test_spill_only_when_the_preferred_node_cannot_take_it(
    worker: int, refusal: str, expected: str
) -> None:
    directory = _directory()
    excluded = _refuse(directory, NODES[worker], refusal)
    router = Router(directory, ROUTING, worker_index=worker)
    assert router.choose([1, 2], excluded).decode.node_id == expected


def test_a_refusing_node_moves_only_its_own_workers() -> None:
    """The pins are over every node of the side, routable or not: d-0 draining sends worker 0's
    requests elsewhere and leaves workers 1-3 where they were (no reshuffle of every pin)."""
    directory = _directory()
    _refuse(directory, "d-0", "draining")
    for worker in (1, 2, 3, 5):
        router = Router(directory, ROUTING, worker_index=worker)
        assert router.choose([1, 2]).decode.node_id == NODES[worker % 4]
    assert Router(directory, ROUTING, worker_index=0).choose([1, 2]).decode.node_id == "d-2"


def test_the_last_node_is_taken_even_when_it_refuses() -> None:
    directory = _directory()
    for node_id in NODES:  # all cooling: live() offers them all, the pin stands
        directory.report_unreachable(node_id)
    assert Router(directory, ROUTING, worker_index=1).choose([1, 2]).decode.node_id == "d-1"
    directory = _directory()
    for node_id in NODES:
        _refuse(directory, node_id, "full")
    assert Router(directory, ROUTING, worker_index=3).choose([1, 2]).decode.node_id == "d-2"
    alone = _directory()
    for node_id in ("d-0", "d-2", "d-3"):
        del alone.nodes[node_id]
    _refuse(alone, "d-1", "full")
    assert Router(alone, ROUTING, worker_index=0).choose([1, 2]).decode.node_id == "d-1"


def test_prefill_side_pins_by_worker_too() -> None:
    directory = _directory()
    for index in range(2):
        node_id = f"p-{index}"
        directory.nodes[node_id] = _node(node_id, PREFILL)
    for worker in range(4):
        route = Router(directory, ROUTING, worker_index=worker).choose(LONG)
        assert route.decode.node_id == NODES[worker]
        assert route.prefill is not None and route.prefill.node_id == f"p-{worker % 2}"


def test_without_members_the_candidates_are_the_list() -> None:
    nodes = [_node(n, DECODE) for n in NODES]
    policy = make_policy("worker_affinity", ROUTING, side="decode", worker_index=6)
    assert isinstance(policy, WorkerAffinity)
    assert policy.pick(nodes, [1]).node_id == "d-2"
    assert policy.pick(nodes[:3], [1]).node_id == "d-0"  # 6 mod 3


def test_the_worker_index_is_checked_against_the_workers() -> None:
    limits = LimitsConfig(
        max_inflight=8, max_body_bytes=1 << 20, max_n=4, max_stop=4, max_stop_chars=64
    )
    config = GatewayConfig("h", 1, "b:1", ModelInfo("m", "m", 8), limits, ROUTING, workers=4)
    assert replace(config, worker_index=3).worker_index == 3
    with pytest.raises(ValueError, match=r"worker index 4 is outside \[0, 4\)"):
        replace(config, worker_index=4)
