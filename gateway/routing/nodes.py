"""The gateway's view of the cluster: live nodes discovered from the bootstrap's WatchNodes.

`NodeDirectory.watch` follows the bootstrap's node events for as long as the gateway runs: a node
that JOINs is routable at once, one that LEAVEs (deregistered or declared dead) is dropped at
once, and LOAD events refresh the heartbeat load that `least_load` reads, and say when a node
is draining (it takes no new requests; `live` leaves it out). After the watch stream
reconnects (bootstrap restart) a reset marker arrives: every node is forgotten and the fresh
snapshot that follows rebuilds the table.

Besides the bootstrap's word, the gateway keeps its own: `inflight` (requests it has on the node
now) and `cooldown_until` (a node whose connection just failed is skipped for a while, until the
bootstrap notices it is dead). gRPC channels are kept per address and reused by a node that
comes back on the same address.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import grpc

from bootstrap.client import BootstrapClient
from bootstrap.security import InternalAuth
from proto import bootstrap_pb2, node_pb2_grpc

logger = logging.getLogger("pdserve.gateway.nodes")

PREFILL = bootstrap_pb2.PREFILL
DECODE = bootstrap_pb2.DECODE
COLOCATED = bootstrap_pb2.COLOCATED
ROLE_NAMES: dict[int, str] = {PREFILL: "prefill", DECODE: "decode", COLOCATED: "colocated"}


@dataclass(frozen=True)
class NodeTarget:
    """Where one request goes: a node's id and its gRPC stub (gateway/dispatch/pd_client.py)."""

    node_id: str
    stub: node_pb2_grpc.NodeStub


@dataclass
class LiveNode:
    node_id: str
    role: int
    address: str
    stub: node_pb2_grpc.NodeStub
    load: bootstrap_pb2.NodeLoad = field(default_factory=bootstrap_pb2.NodeLoad)
    inflight: int = 0  # requests this gateway has on the node right now
    cooldown_until: float = 0.0
    kv_events: bootstrap_pb2.KVEventsEndpoint | None = None  # None: it publishes none
    inflight_tokens: int = 0  # prompt tokens of this gateway's requests on the node now
    left_tokens: int = 0  # prompt tokens of its requests that ended since the last heartbeat
    left_requests: int = 0  # and how many requests those were
    # This gateway's requests that hold or wait for one of the node's running slots: those that
    # streamed a token from it, those it prefills itself and those the decode line released to
    # it (`Dispatcher.enter`, `.decoding`).
    decoding: int = 0

    @property
    def role_name(self) -> str:
        return ROLE_NAMES.get(self.role, "unknown")

    @property
    def target(self) -> NodeTarget:
        return NodeTarget(self.node_id, self.stub)

    @property
    def busy(self) -> int:
        """Requests on the node: the gateway's own count, or the heartbeat's (less this
        gateway's requests that ended since it came) if that is higher (other gateways); the
        heartbeat lags by up to an interval, the own count does not."""
        load = self.load
        reported = (
            load.running_requests
            + load.queued_requests
            + load.transfer_queue
            + load.bootstrap_queue
        )
        return max(self.inflight, reported - self.left_requests)

    @property
    def load_tokens(self) -> int:
        """Tokens the node works on or has queued (the heartbeat's, less this gateway's
        requests that ended since it came: it lags by up to an interval), or the prompt tokens
        this gateway sent it and that are still running, if more (`kv_aware`)."""
        load = self.load
        reported = load.running_tokens + load.queued_tokens - self.left_tokens
        return max(self.inflight_tokens, reported)

    @property
    def slots_taken(self) -> int:
        """Requests in or waiting for one of the node's running slots: the heartbeat's running
        and queued requests (less this gateway's that ended since it came), or this gateway's
        own (`decoding`), whichever is higher. Rooms still prefilling on a prefill node (the
        transfer and bootstrap queues) are left out, unless the decode line released them: they
        take a slot only when their KV lands, and counting them would cap how many requests the
        prefill nodes may work on."""
        load = self.load
        reported = load.running_requests + load.queued_requests - self.left_requests
        return max(self.decoding, reported)

    @property
    def at_cap(self) -> bool:
        """Its running slots are all taken (never when it reports no cap): a new request would
        wait for one of its streams to finish."""
        cap = self.load.max_running_requests
        return cap > 0 and self.slots_taken >= cap

    @property
    def full(self) -> bool:
        """Its last heartbeat had no free or evictable KV page: a new request would wait in its
        queue (`worker_affinity` sends it elsewhere)."""
        return self.load.total_pages > 0 and self.load.free_pages <= 0

    @property
    def kv_usage(self) -> float:
        total = self.load.total_pages
        return 1.0 - self.load.free_pages / total if total else 0.0

    def cooling(self, now: float) -> bool:
        return now < self.cooldown_until


def keepalive_options(interval_s: float) -> list[tuple[str, int]]:
    """gRPC channel options: a ping every `interval_s` while calls are open, the transport (and
    its calls, UNAVAILABLE) closed when one goes unanswered for `interval_s`. Without them a
    stream from a node whose link was cut waits for TCP to give up (many minutes). The nodes
    accept pings this often (engine/node/server.py, PING_POLICY)."""
    if interval_s <= 0:
        return []
    ms = max(int(interval_s * 1000), 1000)
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging a stream that is quiet
    ]


class NodeDirectory:
    def __init__(
        self,
        cooldown_s: float,
        on_change: Callable[[NodeDirectory], None] | None = None,
        auth: InternalAuth | None = None,
        keepalive_s: float = 0.0,
    ) -> None:
        self.cooldown_s = cooldown_s
        self.auth = auth or InternalAuth()  # token and TLS of the node channels
        self.channel_options = keepalive_options(keepalive_s)
        self.on_change = on_change
        # A node may have room for one more request: its load was refreshed or it joined
        # (the dispatcher's line of held requests looks again; gateway/dispatch/decode_line.py).
        self.on_room: Callable[[], None] | None = None
        self.nodes: dict[str, LiveNode] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def live(self, roles: Collection[int], excluded: Collection[str] = ()) -> list[LiveNode]:
        """Routable nodes of these roles, by id; nodes cooling down only if nothing else is left.
        A draining node (it got SIGTERM and finishes what it has) is never routable."""
        nodes = [
            n
            for n in self.nodes.values()
            if n.role in roles and n.node_id not in excluded and not n.load.draining
        ]
        now = time.monotonic()
        healthy = [n for n in nodes if not n.cooling(now)]
        return sorted(healthy or nodes, key=lambda n: n.node_id)

    def members(self, roles: Collection[int]) -> list[LiveNode]:
        """Every known node of these roles by id, routable or not (draining, cooling down)."""
        return sorted((n for n in self.nodes.values() if n.role in roles), key=lambda n: n.node_id)

    def count(self, role: int) -> int:
        return sum(1 for n in self.nodes.values() if n.role == role)

    def report_unreachable(self, node_id: str) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.cooldown_until = time.monotonic() + self.cooldown_s
            logger.warning(
                "%s node %s (%s) unreachable: skipped for %.1f s",
                node.role_name,
                node_id,
                node.address,
                self.cooldown_s,
            )

    def apply(self, event: bootstrap_pb2.NodeEvent) -> None:
        kind = event.kind
        info = event.status.node
        if kind == bootstrap_pb2.NodeEvent.KIND_UNSPECIFIED:
            logger.info("bootstrap watch reconnected: reloading the node table")
            self.nodes.clear()
        elif kind == bootstrap_pb2.NodeEvent.JOINED:
            self._join(info, event.status.load)
        elif kind == bootstrap_pb2.NodeEvent.LEFT:
            left = self.nodes.pop(info.node_id, None)
            if left is not None:
                logger.info("%s node %s left", left.role_name, left.node_id)
        elif kind == bootstrap_pb2.NodeEvent.LOAD:
            node = self.nodes.get(info.node_id)
            if node is not None:
                node.load = event.status.load
                node.left_tokens = 0
                node.left_requests = 0
        if self.on_room is not None and kind in (
            bootstrap_pb2.NodeEvent.JOINED,
            bootstrap_pb2.NodeEvent.LOAD,
        ):
            self.on_room()
        if self.on_change is not None and kind != bootstrap_pb2.NodeEvent.LOAD:
            self.on_change(self)

    def _join(self, info: bootstrap_pb2.NodeInfo, load: bootstrap_pb2.NodeLoad) -> None:
        if info.role not in ROLE_NAMES:
            return
        channel = self._channels.get(info.grpc_address)
        if channel is None:
            channel = self.auth.channel(info.grpc_address, self.channel_options)
            self._channels[info.grpc_address] = channel
        old = self.nodes.get(info.node_id)
        node = LiveNode(
            info.node_id, info.role, info.grpc_address, node_pb2_grpc.NodeStub(channel), load
        )
        if info.HasField("kv_events"):
            node.kv_events = info.kv_events
        if old is not None:
            node.inflight = old.inflight
            node.inflight_tokens = old.inflight_tokens
            node.decoding = old.decoding
        self.nodes[info.node_id] = node
        logger.info("%s node %s joined at %s", node.role_name, node.node_id, node.address)

    async def watch(self, client: BootstrapClient) -> None:
        """Follow the bootstrap's node events until cancelled."""
        async for event in client.watch_nodes():
            self.apply(event)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
