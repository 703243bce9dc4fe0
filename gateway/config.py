"""The gateway's frozen configuration, built once from the command line (see server.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from bootstrap.security import InternalAuth, RoomTickets
from engine.generation_defaults import GenerationDefaults

# API key scopes. A route belongs to one scope; a key may call the routes of its scopes only
# (403 otherwise). `inference`: the OpenAI and native generation routes and /v1/models.
# `admin`: /metrics. /health is open (load balancers probe it without keys).
INFERENCE = "inference"
ADMIN = "admin"
SCOPES = (INFERENCE, ADMIN)
MAX_STREAM_INTERVAL = 4096  # tokens per streamed chunk
MAX_WORKERS = 256  # gateway processes on one port
WORKER_LISTEN = ("reuseport", "shared")  # how they share it (gateway/process/workers.py)


def cpu_of_worker(cpus: Sequence[int], index: int) -> int | None:
    """Worker `index`'s CPU (--worker-cpus, gateway/process/cpus.py): `cpus[index % len(cpus)]`;
    None when nothing is pinned."""
    return cpus[index % len(cpus)] if cpus else None


@dataclass(frozen=True)
class APIKey:
    key: str = field(repr=False)  # never logged
    scopes: frozenset[str] = frozenset({INFERENCE})

    def __post_init__(self) -> None:
        unknown = sorted(self.scopes - set(SCOPES))
        if unknown:
            raise ValueError(f"API key scope {unknown[0]!r} is unknown: use {' or '.join(SCOPES)}")
        if not self.key or not self.key.isprintable() or " " in self.key:
            raise ValueError("an API key must be non-empty printable text without spaces")


@dataclass(frozen=True)
class RequestDefaults:
    """What a request gets for the fields it leaves out (--generation-config,
    --default-max-tokens)."""

    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # from the model
    chat_max_tokens: int = 1024  # a chat request without max_tokens / max_completion_tokens

    def __post_init__(self) -> None:
        if self.chat_max_tokens < 1:
            raise ValueError(f"--default-max-tokens must be >= 1, got {self.chat_max_tokens}")

    def describe(self) -> str:
        chat = f"chat max_tokens {self.chat_max_tokens} when a request gives none"
        return f"{self.generation.describe()}; {chat}"


@dataclass(frozen=True)
class ModelInfo:
    path: str  # HF directory: the tokenizer and chat template come from here
    served_name: str  # the `model` clients must send
    context_length: int  # prompt + completion tokens; longer requests get 400


@dataclass(frozen=True)
class LimitsConfig:
    max_inflight: int  # HTTP requests in progress; beyond it: 429 + Retry-After
    max_body_bytes: int  # beyond it: 413
    max_n: int  # choices per request
    max_stop: int  # stop strings per request
    max_stop_chars: int  # characters of one stop string
    # Empty: no authentication. Admin routes need an admin key once one is configured
    # (before that they stay open, e.g. for a Prometheus scraper without a key).
    api_keys: tuple[APIKey, ...] = ()
    defaults: RequestDefaults = field(default_factory=RequestDefaults)

    def __post_init__(self) -> None:
        for name in ("max_inflight", "max_body_bytes", "max_n", "max_stop", "max_stop_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


@dataclass(frozen=True)
class RoutingConfig:
    prefill_policy: str  # round_robin | least_load | prefix_aware | kv_aware | worker_affinity
    decode_policy: str
    # Prompts of at most this many tokens are prefilled by the decode node itself.
    local_prefill_max_tokens: int
    max_attempts: int  # tries on different nodes while no token has been sent
    node_cooldown_s: float  # a node whose connection failed is skipped this long
    prefix_block_tokens: int  # prefix_aware hashes prompts in blocks of this many tokens
    prefix_max_blocks: int  # remembered prefix blocks (LRU)
    prefix_balance_slack: int  # prefix_aware ignores a match this much busier than the idlest
    # kv_aware: cost = compute weight x prompt tokens to compute + load weight x load tokens.
    # A prefill node's load is prompt tokens queued for compute (the same unit as the compute
    # term); a decode node's is the context of its running streams, which costs memory
    # bandwidth per step, not compute once: a session's history (thousands of tokens) would
    # outweigh the cache hit, so the decode side weighs it lightly.
    kv_compute_weight: float = 1.0
    prefill_kv_load_weight: float = 1.0
    decode_kv_load_weight: float = 0.01
    # HTTP/2 pings on the node channels while calls are open (0: off): a node that stops
    # answering (link cut, host down, process frozen) fails its calls within about twice this.
    node_keepalive_s: float = 10.0
    # Times a choice may move to another decode node after its first token was streamed (its
    # node died or gave it up): prompt + streamed tokens are re-issued elsewhere (0: never).
    migration_limit: int = 3
    # A request that finds every decode node at its running-request cap waits at the gateway
    # this long for one to have room (gateway/dispatch/decode_line.py), then joins a node's queue
    # (0: it joins one at once; the default until a run shows that the line pays).
    decode_hold_s: float = 0.0

    def kv_load_weight(self, side: str) -> float:
        """The `kv_aware` load weight of one side (`prefill` or `decode`)."""
        return self.prefill_kv_load_weight if side == "prefill" else self.decode_kv_load_weight

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("--max-attempts must be >= 1")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.decode_hold_s < 0:
            raise ValueError(f"--decode-hold must be >= 0 s, got {self.decode_hold_s}")
        if self.node_keepalive_s < 0:
            raise ValueError(f"--node-keepalive must be >= 0 s, got {self.node_keepalive_s}")
        if self.prefix_block_tokens < 1:
            raise ValueError("--prefix-block-tokens must be >= 1")
        for name in ("kv_compute_weight", "prefill_kv_load_weight", "decode_kv_load_weight"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ConnectionLimits:
    """What a slow or careless client may hold (gateway/process/connections.py)."""

    header_timeout_s: float = 10.0  # from the connection (or request) start to its last header
    body_timeout_s: float = 30.0  # from the last header to the last body byte
    max_connections_per_client: int = 256  # open connections of one client address
    stream_stall_timeout_s: float = 30.0  # a stream the client does not read this long ends

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "stream_stall_timeout_s"):
            if not getattr(self, name) > 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"{flag} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_connections_per_client < 1:
            raise ValueError(
                f"--max-connections-per-client must be >= 1, got {self.max_connections_per_client}"
            )


@dataclass(frozen=True)
class ResponseStoreConfig:
    """The responses kept for `previous_response_id` (gateway/api/response_store.py)."""

    size: int = 1024  # responses kept, the oldest evicted first (0: none kept)
    ttl_s: float = 3600.0  # a response is forgotten this long after it was made

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError(f"--response-store-size must be >= 0 (0: keep none), got {self.size}")
        if not self.ttl_s > 0:
            raise ValueError(f"--response-store-ttl must be > 0 seconds, got {self.ttl_s}")


@dataclass(frozen=True)
class GatewayConfig:
    host: str
    port: int
    bootstrap: str  # bootstrap-server host:port: where nodes are discovered
    model: ModelInfo
    limits: LimitsConfig
    routing: RoutingConfig
    log_level: str = "info"
    internal_auth: InternalAuth = field(default_factory=InternalAuth)  # gRPC to the cluster
    room_tickets: RoomTickets | None = None  # --room-key-file: signs each room's assignment
    # A streamed choice sends a chunk every this many tokens (its first token at once, its last
    # chunk always): fewer frames, fewer detokenizer calls, the same text and token ids.
    stream_interval: int = 1
    workers: int = 1  # processes serving the port (gateway/process/workers.py)
    # Which of them this process is (0..workers-1; the supervisor sets it per worker): the
    # `worker_affinity` policy and the `worker` label of per-worker metrics read it.
    worker_index: int = 0
    # How the workers share the port (gateway/process/workers.py): "reuseport", a listener each
    # and the kernel's hash picks one per connection; "shared", one listener whose connections the
    # worker free first takes.
    worker_listen: str = "reuseport"
    # --worker-cpus: worker i runs on worker_cpus[i % len] (gateway/process/cpus.py); empty:
    # unpinned.
    worker_cpus: tuple[int, ...] = ()
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    tokenizer_workers: int = 1  # threads tokenizing long prompts (gateway/requests/tokenize.py)
    # SIGTERM: /health fails and new requests get 503 at once; in-flight ones get this long.
    drain_timeout_s: float = 20.0
    response_store: ResponseStoreConfig = field(default_factory=ResponseStoreConfig)

    @property
    def cpu(self) -> int | None:
        """The CPU this worker runs on (--worker-cpus), None when unpinned."""
        return cpu_of_worker(self.worker_cpus, self.worker_index)

    def __post_init__(self) -> None:
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(
                f"--stream-interval must be in [1, {MAX_STREAM_INTERVAL}] tokens, got "
                f"{self.stream_interval}: 1 sends every token as it comes"
            )
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout must be >= 0 s, got {self.drain_timeout_s}")
        if self.tokenizer_workers < 1:
            raise ValueError(f"--tokenizer-workers must be >= 1, got {self.tokenizer_workers}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(
                f"--workers must be in [1, {MAX_WORKERS}] processes, got {self.workers}: "
                "about one per CPU core the gateway may use"
            )
        if self.worker_listen not in WORKER_LISTEN:
            raise ValueError(
                f"--worker-listen must be one of {', '.join(WORKER_LISTEN)}, got "
                f"{self.worker_listen!r}"
            )
        if not 0 <= self.worker_index < self.workers:
            raise ValueError(
                f"worker index {self.worker_index} is outside [0, {self.workers}): the "
                "supervisor numbers its workers 0..--workers-1"
            )
