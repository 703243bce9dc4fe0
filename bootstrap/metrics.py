"""Prometheus metrics of the bootstrap service (`bootstrap-server --metrics-port`).

Counters move in the service's handlers and sweeper; gauges are refreshed from the registry and
the room table after every change, on the service's event loop (so a scrape reads whole values).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bootstrap.registry import NodeRegistry, role_name
from bootstrap.rooms import RoomTable
from proto import bootstrap_pb2

_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0, 300.0,
)  # fmt: skip
_ROLES = (bootstrap_pb2.PREFILL, bootstrap_pb2.DECODE, bootstrap_pb2.COLOCATED)


def counter(r: CollectorRegistry, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    return Counter(name, doc, labels, registry=r)


def gauge(r: CollectorRegistry, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
    return Gauge(name, doc, labels, registry=r)


class BootstrapMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.live_nodes = gauge(
            r, "pdserve_bootstrap_live_nodes", "registered live nodes", ("role",)
        )
        self.rooms_open = gauge(r, "pdserve_bootstrap_rooms_open", "open rooms")
        self.rooms_unsettled = gauge(
            r,
            "pdserve_bootstrap_rooms_unsettled",
            "closed rooms whose prefill node may still write into the decode node's pages",
        )
        self.rooms_opened = counter(
            r, "pdserve_bootstrap_rooms_opened", "destinations posted by decode nodes"
        )
        self.rooms_closed = counter(
            r,
            "pdserve_bootstrap_rooms_closed",
            "rooms closed by the prefill node's final status",
            ("state",),
        )
        self.rooms_expired = counter(
            r, "pdserve_bootstrap_rooms_expired", "rooms open past --room-ttl"
        )
        self.rendezvous = Histogram(
            "pdserve_bootstrap_rendezvous_seconds",
            "destination posted by D -> handed to P's stream",
            buckets=_BUCKETS,
            registry=r,
        )
        self.heartbeats = counter(r, "pdserve_bootstrap_heartbeats", "heartbeats received")
        self.heartbeats_missed = counter(
            r,
            "pdserve_bootstrap_heartbeats_missed",
            "nodes declared dead because their heartbeats stopped",
        )
        self.node_failures = counter(
            r,
            "pdserve_bootstrap_rooms_failed_by_node_loss",
            "open rooms failed because one of their nodes died, left or restarted",
        )

    def refresh(self, registry: NodeRegistry, rooms: RoomTable) -> None:
        for role in _ROLES:
            self.live_nodes.labels(role_name(role)).set(len(registry.live(role)))
        self.rooms_open.set(len(rooms.rooms))
        self.rooms_unsettled.set(len(rooms.unsettled))
