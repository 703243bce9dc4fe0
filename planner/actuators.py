"""How the planner moves a cluster to a split.

Actuators: `--dry-run` (decide only); `switch` (`--bootstrap HOST:PORT`), which switches the roles
of the live nodes in place, one at a time, each registered in its new role before the next (a node
keeps its weights and KV pool: bootstrap/admin.py, what `pdserve-admin switch-role` does);
`kubernetes`, which sets the replica counts of the prefill and decode Deployments (deploy/k8s)
through the official client's scale subresource; `local`, which starts the cluster itself
(`--cluster-args`, pd-cluster's flags) and stops and starts its node processes (a new process loads
its weights again).
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from bootstrap.admin import AdminError, NodeSummary, list_nodes, switch_role
from bootstrap.security import InternalAuth

from .splits import Split
from .window import PlannerError


@dataclass
class KubernetesActuator:
    """Sets the replicas of the prefill and decode Deployments (colocated: no prefill pods, the
    decode pods prefill themselves). `api` is the official client's AppsV1Api."""

    api: Any
    namespace: str
    prefill_deployment: str = "pdserve-prefill"
    decode_deployment: str = "pdserve-decode"

    def apply(self, target: Split) -> str:
        done = []
        for name, replicas in ((self.prefill_deployment, target.prefill),
                               (self.decode_deployment, target.decode)):  # fmt: skip
            body = {"spec": {"replicas": replicas}}
            self.api.patch_namespaced_deployment_scale(name, self.namespace, body)
            done.append(f"{self.namespace}/{name} replicas={replicas}")
        return "; ".join(done)


@dataclass
class LocalActuator:
    """The nodes of a local cluster (gateway/process/cluster.py's `Cluster`, which this process
    started): first stops the nodes of a role the target has too many of (each gets SIGTERM and
    finishes its in-flight work), then starts the missing ones with their peers' flags. Stopping
    first keeps the node count within the budget (a GPU freed before it is taken again)."""

    cluster: Any  # gateway.process.cluster.Cluster

    def apply(self, target: Split) -> str:
        want = {"prefill": target.prefill, "decode": target.decode}
        done = []
        for role, count in want.items():
            while len(self.cluster.live_nodes(role)) > count:
                done.append(f"stopped {self.cluster.remove_node(role).name}")
        for role, count in want.items():
            while len(self.cluster.live_nodes(role)) < count:
                done.append(f"started {self.cluster.add_node(role).name}")
        return "; ".join(done) or "nothing to change"


@dataclass(frozen=True)
class RoleChange:
    node_id: str
    role: str  # "prefill" | "decode"


def plan_role_changes(nodes: list[NodeSummary], target: Split) -> list[RoleChange]:
    """The fewest switches that give the live nodes `target`'s number of prefill nodes; the
    others decode (colocated x N: N decode nodes, which prefill their requests themselves when
    no prefill node is left, as colocated ones do). At least one node keeps decoding. The least
    busy nodes of the role in surplus switch first (the least to drain)."""
    live = [n for n in nodes if not n.draining and n.role in ("prefill", "decode", "colocated")]
    prefill = [n for n in live if n.role == "prefill"]
    decoding = [n for n in live if n.role != "prefill"]
    want = min(target.prefill, len(live) - 1)
    order = lambda n: (n.busy, n.node_id)  # noqa: E731
    if len(prefill) > want:
        return [RoleChange(n.node_id, "decode")
                for n in sorted(prefill, key=order)[: len(prefill) - want]]  # fmt: skip
    return [RoleChange(n.node_id, "prefill")
            for n in sorted(decoding, key=order)[: want - len(prefill)]]  # fmt: skip


@dataclass
class SwitchActuator:
    """Within a fixed budget of running nodes: switches their roles in place through the
    bootstrap (`plan_role_changes`), one node at a time, waiting until each is registered in
    its new role before the next, so at most one node is out of service at once. A switch
    that fails stops the rest; the next decision sees the split that resulted."""

    bootstrap: str
    budget: int
    auth: InternalAuth = field(default_factory=InternalAuth)
    drain_timeout_s: float | None = None  # None: each node's own --drain-timeout
    timeout_s: float = 120.0  # per node: the switch and its registration

    def apply(self, target: Split) -> str:
        return asyncio.run(self._apply(target))

    async def _apply(self, target: Split) -> str:
        try:
            nodes = await list_nodes(self.bootstrap, self.auth)
        except AdminError as exc:
            return f"failed: {exc}"
        done = []
        if len(nodes) != self.budget:
            done.append(f"{len(nodes)} live nodes for a budget of {self.budget}")
        for change in plan_role_changes(nodes, target):
            try:
                outcome = await switch_role(
                    self.bootstrap, change.node_id, change.role, self.auth,
                    self.drain_timeout_s, self.timeout_s,
                )  # fmt: skip
            except AdminError as exc:
                done.append(f"failed: {exc}")
                break
            done.append(
                f"switched {outcome.node_id} {outcome.from_role}->{outcome.role} in "
                f"{outcome.seconds:.2f} s ({outcome.aborted} aborted)"
            )
        return "; ".join(done) or "nothing to change"


def kubernetes_actuator(namespace: str, prefill: str, decode: str) -> KubernetesActuator:
    """The actuator on the cluster this process runs in, else the kubeconfig's."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise PlannerError(
            "--actuator kubernetes needs the kubernetes client: pip install -e '.[planner]'"
        ) from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return KubernetesActuator(client.AppsV1Api(), namespace, prefill, decode)


@dataclass
class LocalCluster:
    cluster: Any  # gateway.process.cluster.Cluster
    url: str
    nodes: int  # its prefill + decode nodes: the budget unless --budget says otherwise


def start_local_cluster(cluster_args: str) -> LocalCluster:
    """`--cluster-args` as pd-cluster would run them."""
    from gateway.process.cluster import Cluster, ClusterError, build_config
    from gateway.process.cluster import build_parser as cluster_parser

    config = build_config(cluster_parser().parse_args(shlex.split(cluster_args)))
    cluster = Cluster(config, out=sys.stderr)
    try:
        url = cluster.start(threading.Event())
    except ClusterError as exc:
        cluster.stop()
        raise PlannerError(f"--cluster-args: the cluster did not start: {exc}") from None
    print(f"[pd-planner] cluster ready: {url}", file=sys.stderr, flush=True)
    return LocalCluster(cluster, url, config.prefill + config.decode)
