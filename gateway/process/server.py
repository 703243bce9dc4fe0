"""`gateway-server`: the HTTP front door of a pdserve cluster (OpenAI-compatible + native API).

Flags -> frozen `GatewayConfig` -> tokenizer -> Starlette app on uvicorn (uvloop, httptools).
Nodes are not configured here: they are discovered from the bootstrap (`--bootstrap`). SIGINT /
SIGTERM: uvicorn stops accepting, lets open requests finish, then the app closes its channels.
`--workers N` (N > 1) runs N such processes on one port under a supervisor
(gateway/process/workers.py); `--worker-cpus LIST` pins each to a CPU (gateway/process/cpus.py),
or the one process without --workers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from bootstrap.security import (
    add_internal_auth_args,
    add_room_key_arg,
    internal_auth_from_args,
    room_tickets_from_args,
)
from bootstrap.telemetry import LogConfig, add_log_args, configure_logging
from engine.generation_defaults import load_generation_defaults
from gateway.config import (
    ADMIN,
    INFERENCE,
    SCOPES,
    WORKER_LISTEN,
    APIKey,
    ConnectionLimits,
    GatewayConfig,
    LimitsConfig,
    ModelInfo,
    RequestDefaults,
    ResponseStoreConfig,
    RoutingConfig,
)
from gateway.process.cpus import allowed_cpus, pin_this_process, worker_cpus
from gateway.routing.policies import POLICIES

if TYPE_CHECKING:
    from gateway.requests.text import TextCodec

logger = logging.getLogger("pdserve.gateway")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway-server", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--bootstrap", required=True, help="bootstrap-server address host:port")
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M)")
    parser.add_argument("--served-model-name", default=None, help="default: the directory name")
    parser.add_argument("--context-length", type=int, default=None, help="default: the model's")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes serving the port (SO_REUSEPORT), each following discovery itself; "
        "/metrics sums them; --max-inflight applies per worker",
    )
    parser.add_argument(
        "--worker-listen",
        choices=WORKER_LISTEN,
        default="reuseport",
        help="with --workers N: reuseport, a listener per worker and the kernel's hash picks "
        "one per connection; shared, one listener, each connection taken by the worker that "
        "accepts first (a busy worker accepts later)",
    )
    parser.add_argument(
        "--worker-cpus",
        default="",
        metavar="LIST",
        help="pin worker i to CPU LIST[i mod len(LIST)], LIST in Linux cpulist syntax "
        "(0-3 or 4,6,8,10; without --workers, the one process to LIST[0]); fewer CPUs than "
        "workers: they share them in turn; a replaced worker keeps its CPU (default: unpinned)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed chunk (the first token at once, the last chunk always); "
        "the text and token ids are the same for any value",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=20.0,
        help="on SIGTERM: /health answers 503 and new requests get 503 with Retry-After at "
        "once; in-flight requests get this many seconds to finish before the gateway exits "
        "(a second SIGTERM or SIGINT stops it at once; keep it below Kubernetes' 30 s grace)",
    )
    add_log_args(parser)
    g = parser.add_argument_group("routing")
    g.add_argument(
        "--prefill-policy",
        default="kv_aware",
        choices=sorted(POLICIES),
        help="kv_aware routes on the nodes' KV events (prefix_aware where none publish them)",
    )
    g.add_argument(
        "--decode-policy",
        default="kv_aware",
        choices=sorted(POLICIES),
        help="kv_aware routes on the nodes' KV events (least_load where none publish them); "
        "worker_affinity keeps gateway worker i on node i mod M (least_load when that one is "
        "draining, failing or full): with --workers N each node then sends fewer, larger "
        "per-step messages (less CPU per token in gateway and node), but load is only as even "
        "as the kernel's spread of client connections over the workers",
    )
    g.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=256,
        help="prompts of at most this many tokens beyond what the decode node's cache holds "
        "are prefilled by the decode node itself",
    )
    g.add_argument("--max-attempts", type=int, default=3, help="nodes tried before the first token")
    g.add_argument("--node-cooldown", type=float, default=5.0, help="seconds to skip a failed node")
    g.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="times a streaming choice may move to another decode node when its node dies or "
        "gives it up mid-stream (prompt + streamed tokens re-issued; 0: never)",
    )
    g.add_argument(
        "--decode-hold",
        type=float,
        default=0.0,
        help="seconds a request that finds every decode node at its running-request cap waits "
        "at the gateway for the first to have room, rather than in one node's queue; then it "
        "joins a queue (default 0: at once; late binding is not yet shown to pay, see "
        "gateway/dispatch/decode_line.py)",
    )
    g.add_argument(
        "--node-keepalive",
        type=float,
        default=10.0,
        help="seconds between pings of a node with open calls; one unanswered this long fails "
        "them (0: off)",
    )
    g.add_argument("--prefix-block-tokens", type=int, default=16)
    g.add_argument("--prefix-max-blocks", type=int, default=1 << 20)
    g.add_argument("--prefix-balance-slack", type=int, default=16, help="requests")
    g.add_argument(
        "--kv-compute-weight",
        type=float,
        default=1.0,
        help="kv_aware: cost per prompt token a node would compute (not in its cache)",
    )
    g.add_argument(
        "--prefill-kv-load-weight",
        type=float,
        default=1.0,
        help="kv_aware: cost per prompt token a prefill node has queued or computing",
    )
    g.add_argument(
        "--decode-kv-load-weight",
        type=float,
        default=0.01,
        help="kv_aware: cost per context token a decode node runs or has queued (its streams' "
        "histories cost memory bandwidth per step, not compute: keep it well below the compute "
        "weight, or follow-up turns leave the node holding their history)",
    )
    g = parser.add_argument_group("defaults for what a request leaves out")
    g.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: `auto` (the model's generation_config.json), `none` (the "
        "engine's), or a path to a generation_config.json or its directory",
    )
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="a chat request's max_tokens when it gives none (default: the generation config's "
        "max_new_tokens, else 1024); completions keep OpenAI's 16",
    )
    g = parser.add_argument_group("admission")
    g.add_argument("--max-inflight", type=int, default=1024, help="beyond it: 429")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20, help="beyond it: 413")
    g.add_argument(
        "--tokenizer-workers",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="threads that tokenize long prompts off the event loop (default: half the CPUs, "
        "so the event loop keeps a core)",
    )
    g.add_argument("--max-n", type=int, default=16, help="choices per request")
    g.add_argument("--max-stop", type=int, default=4, help="stop strings per request")
    g.add_argument("--max-stop-chars", type=int, default=256, help="characters per stop string")
    g = parser.add_argument_group("responses kept for previous_response_id (POST /v1/responses)")
    g.add_argument(
        "--response-store-size",
        type=int,
        default=1024,
        help="responses kept in this process's memory, the oldest evicted first (0: none; with "
        "--workers N > 1 none either: a worker's memory is its own, so `previous_response_id` "
        "answers 400 and clients send the whole conversation)",
    )
    g.add_argument(
        "--response-store-ttl",
        type=float,
        default=3600.0,
        help="seconds a kept response can be continued with `previous_response_id`",
    )
    g = parser.add_argument_group("slow and careless clients")
    g.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send a request's headers; then 408 and the connection closes",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's body after its headers; then 408",
    )
    g.add_argument(
        "--max-connections-per-client",
        type=int,
        default=256,
        help="open connections per client address; beyond it new ones are closed at once",
    )
    g.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=30.0,
        help="seconds a stream may wait on a client that does not read; then it is cut and its "
        "request aborted on the nodes",
    )
    g = parser.add_argument_group("API keys (401 without one, 403 without the route's scope)")
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a bearer key for the inference routes (repeatable)",
    )
    g.add_argument(
        "--admin-api-key",
        action="append",
        default=[],
        help="a bearer key for the admin routes (/metrics) only (repeatable); once one is "
        "set, /metrics needs it",
    )
    g.add_argument(
        "--api-keys-file",
        default=None,
        help=f"keys kept out of argv: one `KEY [SCOPE,...]` per line, scopes {'/'.join(SCOPES)} "
        f"(default {INFERENCE}); # starts a comment",
    )
    add_internal_auth_args(parser)
    add_room_key_arg(parser)
    return parser


def api_keys(args: argparse.Namespace) -> tuple[APIKey, ...]:
    keys = [APIKey(k) for k in args.api_key]
    keys += [APIKey(k, frozenset({ADMIN})) for k in args.admin_api_key]
    if args.api_keys_file:
        try:
            lines = Path(args.api_keys_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-keys-file {args.api_keys_file}: {exc.strerror}") from None
        for number, line in enumerate(lines, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2:
                raise ValueError(
                    f"--api-keys-file line {number}: expected `KEY [SCOPE,...]`, got "
                    f"{len(fields)} fields"
                )
            scopes = frozenset(fields[1].split(",")) if len(fields) == 2 else frozenset({INFERENCE})
            keys.append(APIKey(fields[0], scopes))
    return tuple(keys)


def build_config(args: argparse.Namespace, model_path: str) -> GatewayConfig:
    from engine.model_config import ModelConfig

    positions = ModelConfig.from_dir(model_path).max_position_embeddings
    context = args.context_length or positions
    if not 1 < context <= positions:
        raise ValueError(f"--context-length must be in [2, {positions}], got {context}")
    model = ModelInfo(model_path, args.served_model_name or Path(model_path).name, context)
    generation = load_generation_defaults(args.generation_config, model_path)
    chat_max = args.default_max_tokens or generation.get("max_new_tokens") or 1024
    limits = LimitsConfig(
        max_inflight=args.max_inflight,
        max_body_bytes=args.max_body_bytes,
        max_n=args.max_n,
        max_stop=args.max_stop,
        max_stop_chars=args.max_stop_chars,
        api_keys=api_keys(args),
        defaults=RequestDefaults(generation, int(chat_max)),
    )
    routing = RoutingConfig(
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        max_attempts=args.max_attempts,
        node_cooldown_s=args.node_cooldown,
        migration_limit=args.migration_limit,
        decode_hold_s=args.decode_hold,
        node_keepalive_s=args.node_keepalive,
        prefix_block_tokens=args.prefix_block_tokens,
        prefix_max_blocks=args.prefix_max_blocks,
        prefix_balance_slack=args.prefix_balance_slack,
        kv_compute_weight=args.kv_compute_weight,
        prefill_kv_load_weight=args.prefill_kv_load_weight,
        decode_kv_load_weight=args.decode_kv_load_weight,
    )
    return GatewayConfig(
        args.host,
        args.port,
        args.bootstrap,
        model,
        limits,
        routing,
        args.log_level,
        internal_auth_from_args(args),
        room_tickets_from_args(args),
        stream_interval=args.stream_interval,
        workers=args.workers,
        worker_listen=args.worker_listen,
        worker_cpus=worker_cpus(args.worker_cpus, allowed_cpus()) if args.worker_cpus else (),
        connections=ConnectionLimits(
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            max_connections_per_client=args.max_connections_per_client,
            stream_stall_timeout_s=args.stream_stall_timeout,
        ),
        tokenizer_workers=args.tokenizer_workers,
        drain_timeout_s=args.drain_timeout,
        response_store=ResponseStoreConfig(args.response_store_size, args.response_store_ttl),
    )


def serve(
    config: GatewayConfig,
    codec: TextCodec,
    sock: socket.socket | None = None,
    multiprocess_dir: str | None = None,
    on_started: Callable[[], None] | None = None,
    workers_serving: Callable[[], bool] | None = None,
) -> bool:
    """Serve until SIGINT/SIGTERM, on `sock` (a worker's) or on config.host:port; whether the
    server started at all. `workers_serving`: a worker's view of whether all of them serve
    (its /health is 503 until then)."""
    import uvicorn

    from gateway.api.app import Gateway, build_app, with_server_send
    from gateway.process.connections import guarded_protocol

    gateway = Gateway(config, codec, multiprocess_dir, workers_serving)

    class Server(uvicorn.Server):
        """uvicorn's server, draining on the first SIGTERM/SIGINT (`Gateway.drain`): readiness
        fails and new requests get 503 while the streams in flight finish; then it stops."""

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if self.started and on_started is not None:
                on_started()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if gateway.draining or not self.started:
                super().handle_exit(sig, frame)  # a second signal: stop now
                return
            gateway.draining = True  # from here on /health and new requests answer 503
            self.loop.call_soon_threadsafe(self._drain)

        def _drain(self) -> None:
            task = self.loop.create_task(gateway.drain(config.drain_timeout_s))
            task.add_done_callback(lambda _: setattr(self, "should_exit", True))

    app = build_app(gateway)
    logger.info(
        "gateway worker %d for %r on http://%s:%d (prefill policy %s, decode policy %s, "
        "stream interval %d)",
        config.worker_index,
        config.model.served_name,
        config.host,
        config.port,
        config.routing.prefill_policy,
        config.routing.decode_policy,
        config.stream_interval,
    )
    logger.info("%s", config.limits.defaults.describe())
    server = Server(
        uvicorn.Config(
            with_server_send(app),
            host=config.host,
            port=config.port,
            loop="uvloop",
            # httptools with timeouts and caps, large bodies handed over whole
            http=guarded_protocol(
                config.connections,
                config.limits.max_body_bytes,
                gateway.metrics.worker_connections.labels(str(config.worker_index)).inc,
            ),
            log_level=config.log_level,
            log_config=None,  # uvicorn's loggers go through ours (one format everywhere)
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    server.run(sockets=[sock] if sock is not None else None)
    return bool(server.started)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = LogConfig(args.log_level, args.log_format)
    configure_logging(log)
    try:
        from engine.model_fetch import resolve_model

        model_path = resolve_model(args.model)
        config = build_config(args, model_path)
        if config.workers > 1:
            from gateway.process.workers import Supervisor

            return Supervisor(config, log).run()
        if config.cpu is not None:  # before the tokenizer and the server start threads
            pin_this_process(config.cpu)
            logger.info("gateway-server (pid %d) pinned to CPU %d", os.getpid(), config.cpu)
        from gateway.requests.text import TextCodec

        codec = TextCodec.load(model_path)
    except (ValueError, FileNotFoundError) as exc:
        logger.error("gateway-server cannot start: %s", exc)
        return 2
    except OSError as exc:  # the supervisor could not bind the address
        logger.error("gateway-server cannot start: %s", exc)
        return 1
    return 0 if serve(config, codec) else 1


if __name__ == "__main__":
    sys.exit(main())
