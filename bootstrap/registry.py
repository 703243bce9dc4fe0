"""The node registry: who is alive, with which KV layout, and how loaded.

A node is live from Register until it deregisters or misses heartbeats for the timeout; then its
record is removed (a late heartbeat gets NOT_FOUND and the node registers again). An id belongs
to one registration while it is live: a Register naming a live id is refused (ALREADY_EXISTS)
unless it carries that registration's secret, i.e. it is the same node registering again, so a
second process started with the same `--node-id`, or one impersonating it, cannot take over the
id and its rooms. Prefill and
decode nodes must agree on the KV layout (`LAYOUT_FIELDS`) or KV pages cannot move between them;
tensor-parallel size and rank may differ. Colocated nodes never exchange KV and are not checked.
"""

from __future__ import annotations

import hmac
import secrets
import uuid
from dataclasses import dataclass, field

from bootstrap.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from proto import bootstrap_pb2

LAYOUT_FIELDS = ("model_id", "num_layers", "num_kv_heads", "head_dim", "page_size", "dtype")
KV_ROLES = (bootstrap_pb2.PREFILL, bootstrap_pb2.DECODE)


def role_name(role: int) -> str:
    """'prefill', 'decode', 'colocated' (or 'role 7' for a value this build does not know)."""
    try:
        return bootstrap_pb2.Role.Name(role).lower()  # type: ignore[arg-type]
    except ValueError:
        return f"role {role}"


@dataclass
class NodeRecord:
    info: bootstrap_pb2.NodeInfo
    load: bootstrap_pb2.NodeLoad
    last_heartbeat: float  # time.monotonic() of Register or the latest Heartbeat
    # Handed to the node in RegisterResponse; its calls prove who is calling with it.
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def role(self) -> int:
        return self.info.role

    @property
    def label(self) -> str:
        """'prefill node p-1a2b': how log lines and failure reasons name this node."""
        return f"{role_name(self.role)} node {self.node_id}"

    def holds(self, secret: str) -> bool:
        return hmac.compare_digest(secret.encode(), self.secret.encode())

    def status(self, alive: bool = True) -> bootstrap_pb2.NodeStatus:
        return bootstrap_pb2.NodeStatus(node=self.info, load=self.load, alive=alive)


def check_required_fields(info: bootstrap_pb2.NodeInfo) -> None:
    if info.role not in bootstrap_pb2.Role.values():
        raise InvalidArgument(
            f"node.role {info.role} is not a known role: use PREFILL|DECODE|COLOCATED"
        )
    if info.role == bootstrap_pb2.ROLE_UNSPECIFIED:
        raise InvalidArgument("node.role is required: set PREFILL, DECODE or COLOCATED")
    if not info.grpc_address:
        raise InvalidArgument("node.grpc_address is required: set the host:port of the node API")


def layout_conflict(info: bootstrap_pb2.NodeInfo, other: NodeRecord) -> str | None:
    """Why `info` cannot exchange KV with `other`, or None when their layouts agree."""
    for name in LAYOUT_FIELDS:
        mine, theirs = getattr(info.layout, name), getattr(other.info.layout, name)
        if mine != theirs:
            return (
                f"KV layout mismatch: layout.{name} is {mine!r} but {other.label} "
                f"({other.info.grpc_address}) has {theirs!r}; start this node with the same "
                f"model, page size and dtype as the running ones"
            )
    return None


class NodeRegistry:
    """Live nodes by id. Pure state: the caller passes the clock and publishes the events."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeRecord] = {}

    def register(
        self,
        info: bootstrap_pb2.NodeInfo,
        now: float,
        secret: str = "",
        load: bootstrap_pb2.NodeLoad | None = None,
    ) -> tuple[NodeRecord, bool]:
        """Add a node (with its `load` at registration, if it sent one), or replace a live one
        whose `secret` the caller proved it holds; returns (record, replaced_a_live_one).
        AlreadyExists for a live id without its secret."""
        check_required_fields(info)
        record_info = bootstrap_pb2.NodeInfo()
        record_info.CopyFrom(info)
        if not record_info.node_id:
            record_info.node_id = f"{role_name(info.role)}-{uuid.uuid4().hex[:8]}"
        live = self.nodes.get(record_info.node_id)
        if live is not None and not (secret and live.holds(secret)):
            raise AlreadyExists(
                f"node id {live.node_id} is taken by a live {live.label} at "
                f"{live.info.grpc_address} (last heartbeat {now - live.last_heartbeat:.1f} s ago) "
                "and this Register does not carry its node secret: start this node with another "
                "--node-id (or none, to be given one); a restarted node may take its old id once "
                "the bootstrap declared the old registration dead (--heartbeat-timeout)"
            )
        if record_info.role in KV_ROLES:
            for other in self.nodes.values():
                if other.node_id != record_info.node_id and other.role in KV_ROLES:
                    reason = layout_conflict(record_info, other)
                    if reason is not None:
                        raise FailedPrecondition(reason)
        replaced = record_info.node_id in self.nodes
        record = NodeRecord(record_info, bootstrap_pb2.NodeLoad(), now)
        if load is not None:
            record.load.CopyFrom(load)
        self.nodes[record.node_id] = record
        return record, replaced

    def heartbeat(self, node_id: str, load: bootstrap_pb2.NodeLoad, now: float) -> bool:
        """Refresh a node's liveness and load; True when the load changed."""
        record = self.require(node_id)
        record.last_heartbeat = now
        if record.load == load:
            return False
        record.load = bootstrap_pb2.NodeLoad()
        record.load.CopyFrom(load)
        return True

    def require(self, node_id: str) -> NodeRecord:
        record = self.nodes.get(node_id)
        if record is None:
            raise NotFound(f"unknown node {node_id}: re-register")
        return record

    def get(self, node_id: str) -> NodeRecord | None:
        return self.nodes.get(node_id)

    def remove(self, node_id: str) -> NodeRecord | None:
        return self.nodes.pop(node_id, None)

    def live(self, role: int = bootstrap_pb2.ROLE_UNSPECIFIED) -> list[NodeRecord]:
        return [r for r in self.nodes.values() if role in (bootstrap_pb2.ROLE_UNSPECIFIED, r.role)]

    def silent(self, now: float, timeout_s: float) -> list[NodeRecord]:
        """Nodes whose last heartbeat is older than the timeout: to be declared dead."""
        return [r for r in self.nodes.values() if now - r.last_heartbeat > timeout_s]
