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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

# What prometheus_client reads, at its import, to record into files instead of memory.
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, multiprocess_dir: str | None = None) -> None:
        """`multiprocess_dir`: this process is one of several workers sharing the directory."""
        if multiprocess_dir is not None and values.ValueClass is values.MutexValue:
            raise RuntimeError(
                f"gateway worker metrics: set {MULTIPROCESS_ENV}={multiprocess_dir} before "
                "prometheus_client is imported (the worker supervisor does)"
            )
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_gateway_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.inflight = Gauge(
            "pdserve_gateway_inflight", "HTTP requests in progress", registry=r,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.rejected = Counter(
            "pdserve_gateway_rejected", "requests refused by admission control", ["reason"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "pdserve_gateway_prompt_tokens", "prompt tokens of finished choices", registry=r
        )
        self.completion_tokens = Counter(
            "pdserve_gateway_completion_tokens", "generated tokens", registry=r
        )
        # The offered load as it arrives (pd-planner): a choice's prompt and token budget are
        # counted when it is admitted, long before its tokens are (at its end).
        self.admitted_choices = Counter(
            "pdserve_gateway_admitted_choices", "choices admitted (sent towards the nodes)",
            registry=r,
        )  # fmt: skip
        self.admitted_prompt_tokens = Counter(
            "pdserve_gateway_admitted_prompt_tokens", "prompt tokens of admitted choices",
            registry=r,
        )  # fmt: skip
        self.admitted_max_tokens = Counter(
            "pdserve_gateway_admitted_max_tokens",
            "token budgets (max_tokens) of admitted choices", registry=r,
        )  # fmt: skip
        self.finished_max_tokens = Counter(
            "pdserve_gateway_finished_max_tokens",
            "token budgets of finished choices (completion_tokens / this: how much of their "
            "max_tokens outputs use)", registry=r,
        )  # fmt: skip
        self.node_requests = Counter(
            "pdserve_gateway_node_requests", "choices sent to a node", ["role", "node_id"],
            registry=r,
        )  # fmt: skip
        self.worker_node_requests = Counter(
            "pdserve_gateway_worker_node_requests",
            "choices each gateway worker sent to a node (worker_affinity: one node per worker)",
            ["worker", "role", "node_id"], registry=r,
        )  # fmt: skip
        # Per gateway worker (`worker`: its index): how the load spread over the workers and
        # how large the node messages it received were (deltas / batches: requests per step).
        self.worker_connections = Counter(
            "pdserve_gateway_worker_connections",
            "TCP connections this gateway worker accepted (--workers: the kernel's spread)",
            ["worker"], registry=r,
        )  # fmt: skip
        self.worker_inflight = Gauge(
            "pdserve_gateway_worker_inflight",
            "HTTP requests this gateway worker has in progress",
            ["worker"], registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.worker_completion_tokens = Counter(
            "pdserve_gateway_worker_completion_tokens",
            "generated tokens of the choices this gateway worker finished",
            ["worker"], registry=r,
        )  # fmt: skip
        self.worker_node_batches = Counter(
            "pdserve_gateway_worker_node_batches",
            "per-step messages (StreamBatch) this gateway worker received from the nodes",
            ["worker"], registry=r,
        )  # fmt: skip
        self.worker_node_deltas = Counter(
            "pdserve_gateway_worker_node_deltas",
            "request deltas in those messages (deltas / batches: the mean batch a worker sees)",
            ["worker"], registry=r,
        )  # fmt: skip
        self.node_cached_tokens = Counter(
            "pdserve_gateway_node_cached_tokens",
            "prompt tokens served from a node's prefix cache",
            ["role", "node_id"],
            registry=r,
        )
        self.node_prompt_tokens = Counter(
            "pdserve_gateway_node_prompt_tokens",
            "prompt tokens of the choices whose prefill a node did (its hit rate: "
            "node_cached_tokens / node_prompt_tokens)",
            ["role", "node_id"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "pdserve_gateway_cached_tokens",
            "prompt tokens not computed thanks to a prefix cache (cluster hit rate: "
            "cached_tokens / prompt_tokens)",
            registry=r,
        )
        self.kv_index_blocks = Gauge(
            "pdserve_gateway_kv_index_blocks",
            "blocks the prefix index holds for a node (from its KV events)",
            ["node_id"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self.kv_event_lag = Histogram(
            "pdserve_gateway_kv_event_lag_seconds",
            "from a node publishing a KV-event batch to the index applying it",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.kv_event_gaps = Counter(
            "pdserve_gateway_kv_event_gaps", "KV-event sequence gaps seen", registry=r
        )
        self.kv_event_resyncs = Counter(
            "pdserve_gateway_kv_event_resyncs",
            "prefix-index resyncs of a node, by how (replay, snapshot)",
            ["kind"], registry=r,
        )  # fmt: skip
        self.kv_event_errors = Counter(
            "pdserve_gateway_kv_event_errors",
            "KV-event frames refused (malformed, out of order), each followed by a resync",
            ["reason"], registry=r,
        )  # fmt: skip
        self.local_prefills = Counter(
            "pdserve_gateway_local_prefills",
            "choices the decode node prefilled itself (short prompt or no prefill node)",
            registry=r,
        )
        # Late binding (gateway/dispatch/decode_line.py): requests waiting for a decode node below
        # its cap, how long each waited, and how many gave up waiting and joined a node's queue.
        self.decode_held = Gauge(
            "pdserve_gateway_decode_held",
            "requests waiting at the gateway for a decode node below its running-request cap",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.decode_hold = Histogram(
            "pdserve_gateway_decode_hold_seconds",
            "how long a request waited at the gateway for a decode node with room",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode_hold_expired = Counter(
            "pdserve_gateway_decode_hold_expired",
            "held requests that waited --decode-hold and were sent to a node's queue",
            registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "pdserve_gateway_retries", "choices moved to another node before their first token",
            ["reason"], registry=r,
        )  # fmt: skip
        self.migrations = Counter(
            "pdserve_gateway_migrations",
            "streaming choices moved to another node after their first token",
            ["reason"], registry=r,
        )  # fmt: skip
        self.migration_gap = Histogram(
            "pdserve_gateway_migration_gap_seconds",
            "a moved stream's wait: its node failed -> the first token from its new node",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.failures = Counter(
            "pdserve_gateway_failures", "choices that failed after their first token", registry=r
        )
        self.live_nodes = Gauge(
            "pdserve_gateway_live_nodes", "nodes known from bootstrap", ["role"], registry=r,
            multiprocess_mode="livemax",
        )  # fmt: skip
        self.ttft = Histogram(
            "pdserve_gateway_time_to_first_token_seconds", "time to first token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "pdserve_gateway_inter_token_latency_seconds",
            "time between two token chunks of one choice",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "pdserve_gateway_e2e_seconds", "request latency", buckets=_LATENCY_BUCKETS, registry=r
        )

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.multiprocess_dir)
        return generate_latest(merged)
