"""What the soak test samples from each process of a running cluster, every few seconds.

- From /proc, summed over the process's session (a server runs in its own session, so its
  helpers count too): `rss_mib` (VmRSS), `open_fds` (entries of /proc/<pid>/fd), `threads`.
- From a node's gRPC `GetLoad`: `kv_used` and `kv_cached` (fractions of the node's KV pages
  held by requests and by the prefix cache), `running` and `queued` requests.
- From each process's Prometheus text: `errors`, a cumulative count of what went wrong there
  (see ERROR_SERIES), and a few queue gauges that must stay bounded (`rooms_open`,
  `rooms_unsettled` on bootstrap, `quarantine` on a decode node, `inflight` on the gateway).

A probe that fails (a process gone, a scrape timing out) records nothing for that quantity at
that time and counts a `probe_failures` sample instead; the soak's report shows them.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from gateway.process.launcher import session_pids
from proto import node_pb2, node_pb2_grpc

# Cumulative error counters per process kind: (sample name, label that must match or None).
ERROR_SERIES: dict[str, tuple[tuple[str, tuple[str, str] | None], ...]] = {
    "gateway": (("pdserve_gateway_failures_total", None),),  # plus every non-2xx status
    "prefill": (
        ("pdserve_prefill_transfer_failures_total", None),
        ("pdserve_node_requests_finished_total", ("reason", "abort")),
    ),
    "decode": (
        ("pdserve_decode_transfer_failures_total", None),
        ("pdserve_node_requests_finished_total", ("reason", "abort")),
    ),
    "bootstrap": (
        ("pdserve_bootstrap_rooms_expired_total", None),
        ("pdserve_bootstrap_heartbeats_missed_total", None),
        ("pdserve_bootstrap_rooms_failed_by_node_loss_total", None),
    ),
}
# Gauges that must stay bounded, per process kind: quantity name -> sample name.
QUEUE_GAUGES: dict[str, dict[str, str]] = {
    "gateway": {"inflight": "pdserve_gateway_inflight"},
    "decode": {"quarantine": "pdserve_decode_quarantine"},
    "bootstrap": {
        "rooms_open": "pdserve_bootstrap_rooms_open",
        "rooms_unsettled": "pdserve_bootstrap_rooms_unsettled",
    },
}


@dataclass(frozen=True)
class Target:
    """One process of the cluster, as the soak test sees it."""

    name: str  # "gateway", "bootstrap", "prefill-0", "decode-1"
    pid: int  # its session id too (servers are started with start_new_session)
    metrics_url: str
    node_address: str = ""  # gRPC host:port of a prefill/decode node

    @property
    def kind(self) -> str:
        return self.name.split("-", 1)[0]


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the soak started
    process: str
    quantity: str
    value: float


def proc_usage(pids: Iterable[int]) -> dict[str, float]:
    """rss_mib, open_fds and threads summed over the given processes."""
    rss_kib = fds = threads = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key == "VmRSS":
                rss_kib += int(value.split()[0])
            elif key == "Threads":
                threads += int(value)
    return {"rss_mib": rss_kib / 1024, "open_fds": float(fds), "threads": float(threads)}


def metric_values(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> sample name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def metric_quantities(kind: str, text: str) -> dict[str, float]:
    """`errors` and the bounded queue gauges of one process kind from its /metrics text."""
    values = metric_values(text)
    errors = 0.0
    for name, label in ERROR_SERIES.get(kind, ()):
        for labels, value in values.get(name, []):
            if label is None or labels.get(label[0]) == label[1]:
                errors += value
    if kind == "gateway":
        for labels, value in values.get("pdserve_gateway_requests_total", []):
            if not labels.get("status", "").startswith("2"):
                errors += value
    out = {"errors": errors}
    for quantity, name in QUEUE_GAUGES.get(kind, {}).items():
        out[quantity] = sum(v for _, v in values.get(name, []))
    return out


def node_load(stub: node_pb2_grpc.NodeStub, timeout_s: float) -> dict[str, float]:
    load = stub.GetLoad(node_pb2.GetLoadRequest(), timeout=timeout_s)
    total = max(load.total_pages, 1)
    used = load.total_pages - load.free_pages - load.cached_pages
    return {
        "kv_used": used / total,
        "kv_cached": load.cached_pages / total,
        "running": float(load.running_requests),
        "queued": float(load.queued_requests),
    }


class Prober:
    """Samples every target; keeps one gRPC channel per node for the whole run."""

    def __init__(self, targets: list[Target], timeout_s: float = 5.0) -> None:
        self.targets = targets
        self.timeout_s = timeout_s
        self._channels = {
            t.name: grpc.insecure_channel(t.node_address) for t in targets if t.node_address
        }

    def sample(self, t: float) -> list[Sample]:
        out: list[Sample] = []
        for target in self.targets:
            values, failures = self._probe(target)
            out += [Sample(t, target.name, q, v) for q, v in values.items()]
            out.append(Sample(t, target.name, "probe_failures", float(failures)))
        return out

    def _probe(self, target: Target) -> tuple[dict[str, float], int]:
        values = proc_usage(session_pids(target.pid))
        failures = 0
        try:
            with urllib.request.urlopen(target.metrics_url, timeout=self.timeout_s) as response:
                values.update(metric_quantities(target.kind, response.read().decode()))
        except (OSError, ValueError):
            failures += 1
        channel = self._channels.get(target.name)
        if channel is not None:
            try:
                values.update(node_load(node_pb2_grpc.NodeStub(channel), self.timeout_s))
            except grpc.RpcError:
                failures += 1
        return values, failures

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
