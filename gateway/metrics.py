"""The gateway's Prometheus metrics (GET /metrics, text exposition format).

Per-node counters carry `role` and `node_id` labels, so an operator (and the routing tests) can
see where traffic went and how much of it hit a prefill node's prefix cache.
`pdserve_gateway_worker_node_requests` splits the per-node request count by the gateway worker
that routed it (`worker`: its index, 0 for a single process; a series of its own, so that the
per-node series keep their labels): it shows whether `worker_affinity` kept each worker on its
node. The other `pdserve_gateway_worker_*` series show how the load spread over the workers:
connections accepted, requests in progress, tokens finished, and the nodes' per-step messages
received with the request deltas in them (deltas / messages is the mean batch a worker sees: a
worker holding fewer streams gets smaller messages and pays the per-message cost more often).

With `--workers N` every worker records into prometheus_client's multiprocess files (one mmap
file per process and metric kind, in a directory the supervisor makes; gateway/process/workers.py)
and `render` merges all of them: counters and histograms are totals over the workers (a restarted
worker's predecessor still counts), `inflight` is the sum over the live workers and
`live_nodes` their maximum (each worker follows discovery itself; they agree once all saw an
event).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

# What prometheus_client reads, at its import, to record into files instead of memory.
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST
# How a gauge's per-worker values merge (prometheus_client's multiprocess modes).
GaugeMode = Literal["livesum", "livemax"]


class GatewayMetrics:
    def __init__(self, multiprocess_dir: str | None = None) -> None:
        """`multiprocess_dir`: this process is one of several workers sharing the directory."""
        if multiprocess_dir is not None and values.ValueClass is values.MutexValue:
            raise RuntimeError(
                f"gateway worker metrics: set {MULTIPROCESS_ENV}={multiprocess_dir} before "
                "prometheus_client is imported (the worker supervisor does)"
            )
        self.multiprocess_dir = multiprocess_dir
        self.registry = r = CollectorRegistry()

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: Sequence[str] = (), *, mode: GaugeMode) -> Gauge:
            return Gauge(name, doc, labels, registry=r, multiprocess_mode=mode)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=r)

        self.requests = counter(
            "pdserve_gateway_requests", "HTTP requests answered", ("endpoint", "status")
        )
        self.inflight = gauge(
            "pdserve_gateway_inflight", "HTTP requests in progress", mode="livesum"
        )
        self.rejected = counter(
            "pdserve_gateway_rejected", "requests refused by admission control", ("reason",)
        )
        self.prompt_tokens = counter(
            "pdserve_gateway_prompt_tokens", "prompt tokens of finished choices"
        )
        self.completion_tokens = counter("pdserve_gateway_completion_tokens", "generated tokens")
        # The offered load as it arrives (pd-planner): a choice's prompt and token budget are
        # counted when it is admitted, long before its tokens are (at its end).
        self.admitted_choices = counter(
            "pdserve_gateway_admitted_choices", "choices admitted (sent towards the nodes)"
        )
        self.admitted_prompt_tokens = counter(
            "pdserve_gateway_admitted_prompt_tokens", "prompt tokens of admitted choices"
        )
        self.admitted_max_tokens = counter(
            "pdserve_gateway_admitted_max_tokens", "token budgets (max_tokens) of admitted choices"
        )
        self.finished_max_tokens = counter(
            "pdserve_gateway_finished_max_tokens",
            "token budgets of finished choices (completion_tokens / this: how much of their "
            "max_tokens outputs use)",
        )
        self.node_requests = counter(
            "pdserve_gateway_node_requests", "choices sent to a node", ("role", "node_id")
        )
        self.worker_node_requests = counter(
            "pdserve_gateway_worker_node_requests",
            "choices each gateway worker sent to a node (worker_affinity: one node per worker)",
            ("worker", "role", "node_id"),
        )
        # Per gateway worker (`worker`: its index): how the load spread over the workers and
        # how large the node messages it received were (deltas / batches: requests per step).
        self.worker_connections = counter(
            "pdserve_gateway_worker_connections",
            "TCP connections this gateway worker accepted (--workers: the kernel's spread)",
            ("worker",),
        )
        self.worker_inflight = gauge(
            "pdserve_gateway_worker_inflight",
            "HTTP requests this gateway worker has in progress",
            ("worker",),
            mode="livesum",
        )
        self.worker_completion_tokens = counter(
            "pdserve_gateway_worker_completion_tokens",
            "generated tokens of the choices this gateway worker finished",
            ("worker",),
        )
        self.worker_node_batches = counter(
            "pdserve_gateway_worker_node_batches",
            "per-step messages (StreamBatch) this gateway worker received from the nodes",
            ("worker",),
        )
        self.worker_node_deltas = counter(
            "pdserve_gateway_worker_node_deltas",
            "request deltas in those messages (deltas / batches: the mean batch a worker sees)",
            ("worker",),
        )
        self.node_cached_tokens = counter(
            "pdserve_gateway_node_cached_tokens",
            "prompt tokens served from a node's prefix cache",
            ("role", "node_id"),
        )
        self.node_prompt_tokens = counter(
            "pdserve_gateway_node_prompt_tokens",
            "prompt tokens of the choices whose prefill a node did (its hit rate: "
            "node_cached_tokens / node_prompt_tokens)",
            ("role", "node_id"),
        )
        self.cached_tokens = counter(
            "pdserve_gateway_cached_tokens",
            "prompt tokens not computed thanks to a prefix cache (cluster hit rate: "
            "cached_tokens / prompt_tokens)",
        )
        self.kv_index_blocks = gauge(
            "pdserve_gateway_kv_index_blocks",
            "blocks the prefix index holds for a node (from its KV events)",
            ("node_id",),
            mode="livemax",
        )
        self.kv_event_lag = histogram(
            "pdserve_gateway_kv_event_lag_seconds",
            "from a node publishing a KV-event batch to the index applying it",
        )
        self.kv_event_gaps = counter("pdserve_gateway_kv_event_gaps", "KV-event sequence gaps seen")
        self.kv_event_resyncs = counter(
            "pdserve_gateway_kv_event_resyncs",
            "prefix-index resyncs of a node, by how (replay, snapshot)",
            ("kind",),
        )
        self.kv_event_errors = counter(
            "pdserve_gateway_kv_event_errors",
            "KV-event frames refused (malformed, out of order), each followed by a resync",
            ("reason",),
        )
        self.local_prefills = counter(
            "pdserve_gateway_local_prefills",
            "choices the decode node prefilled itself (short prompt or no prefill node)",
        )
        # Late binding (gateway/dispatch/decode_line.py): requests waiting for a decode node below
        # its cap, how long each waited, and how many gave up waiting and joined a node's queue.
        self.decode_held = gauge(
            "pdserve_gateway_decode_held",
            "requests waiting at the gateway for a decode node below its running-request cap",
            mode="livesum",
        )
        self.decode_hold = histogram(
            "pdserve_gateway_decode_hold_seconds",
            "how long a request waited at the gateway for a decode node with room",
        )
        self.decode_hold_expired = counter(
            "pdserve_gateway_decode_hold_expired",
            "held requests that waited --decode-hold and were sent to a node's queue",
        )
        self.retries = counter(
            "pdserve_gateway_retries",
            "choices moved to another node before their first token",
            ("reason",),
        )
        self.migrations = counter(
            "pdserve_gateway_migrations",
            "streaming choices moved to another node after their first token",
            ("reason",),
        )
        self.migration_gap = histogram(
            "pdserve_gateway_migration_gap_seconds",
            "a moved stream's wait: its node failed -> the first token from its new node",
        )
        self.failures = counter(
            "pdserve_gateway_failures", "choices that failed after their first token"
        )
        self.live_nodes = gauge(
            "pdserve_gateway_live_nodes", "nodes known from bootstrap", ("role",), mode="livemax"
        )
        self.ttft = histogram("pdserve_gateway_time_to_first_token_seconds", "time to first token")
        self.itl = histogram(
            "pdserve_gateway_inter_token_latency_seconds",
            "time between two token chunks of one choice",
        )
        self.e2e = histogram("pdserve_gateway_e2e_seconds", "request latency")

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.multiprocess_dir)
        return generate_latest(merged)
