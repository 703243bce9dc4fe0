"""`bootstrap-server`: the node registry and room rendezvous of a pdserve deployment.

Life of the process: parse flags -> build frozen configs -> serve the Bootstrap gRPC API
(grpc.aio on uvloop) with a sweeper for dead nodes and expired rooms -> on SIGTERM/SIGINT stop
serving and exit 0. All state is in memory: after a restart nodes get NOT_FOUND on their next
heartbeat and register again (see `bootstrap/client.py`); rooms that were open are gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from dataclasses import dataclass, field

import grpc

from bootstrap.metrics import BootstrapMetrics
from bootstrap.security import (
    InternalAuth,
    add_internal_auth_args,
    add_room_key_arg,
    internal_auth_from_args,
    room_tickets_from_args,
)
from bootstrap.service import BootstrapConfig, BootstrapService
from bootstrap.telemetry import (
    LogConfig,
    add_log_args,
    add_metrics_port_arg,
    configure_logging,
    serve_metrics,
)
from proto import bootstrap_pb2_grpc

logger = logging.getLogger("pdserve.bootstrap")

STOP_GRACE_S = 0.5  # open watch streams never finish by themselves: cut them after this


@dataclass(frozen=True)
class ListenConfig:
    host: str
    port: int
    metrics_port: int | None = None  # GET /metrics on this HTTP port (None: not served)
    auth: InternalAuth = field(default_factory=InternalAuth)  # token, TLS (security.py)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bootstrap-server", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8998, help="port to listen on")
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=5.0,
        help="seconds of silence before a node is dead",
    )
    parser.add_argument(
        "--heartbeat-interval", type=float, default=1.0, help="seconds between node heartbeats"
    )
    parser.add_argument(
        "--room-ttl", type=float, default=600.0, help="seconds a room may stay open"
    )
    add_metrics_port_arg(parser)
    add_log_args(parser)
    add_internal_auth_args(parser)
    add_room_key_arg(parser)
    return parser


def build_configs(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[ListenConfig, BootstrapConfig]:
    for flag in ("heartbeat_timeout", "heartbeat_interval", "room_ttl"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.heartbeat_interval >= args.heartbeat_timeout:
        parser.error(
            f"--heartbeat-interval ({args.heartbeat_interval}) must be below --heartbeat-timeout "
            f"({args.heartbeat_timeout}), or live nodes would be declared dead between heartbeats"
        )
    try:
        auth = internal_auth_from_args(args)
        tickets = room_tickets_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if auth.tls is not None and auth.tls.cert is None:
        parser.error("a TLS server needs --tls-cert and --tls-key (--tls-ca alone is for clients)")
    service = BootstrapConfig(
        heartbeat_timeout_s=args.heartbeat_timeout,
        heartbeat_interval_s=args.heartbeat_interval,
        room_ttl_s=args.room_ttl,
        # A cluster that keeps outsiders out also keeps each node to its own rooms.
        verify_node_identity=bool(auth.token),
        tickets=tickets,
    )
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        parser.error(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    return ListenConfig(args.host, args.port, args.metrics_port, auth), service


async def serve(listen: ListenConfig, config: BootstrapConfig) -> None:
    metrics = BootstrapMetrics()
    service = BootstrapService(config, metrics=metrics)
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0)], interceptors=listen.auth.server_interceptors()
    )
    bootstrap_pb2_grpc.add_BootstrapServicer_to_server(service, server)
    address = f"{listen.host}:{listen.port}"
    if listen.auth.add_port(server, address) == 0:
        raise OSError(f"cannot listen on {address}: the port is in use or the host is not local")
    metrics_server = serve_metrics(metrics.registry, listen.host, listen.metrics_port)
    await server.start()
    sweeper = asyncio.create_task(service.run_sweeper(), name="bootstrap-sweeper")
    logger.info(
        "bootstrap serving on %s (%s; heartbeat every %g s, dead after %g s, room ttl %g s)",
        address,
        listen.auth.describe(),
        config.heartbeat_interval_s,
        config.heartbeat_timeout_s,
        config.room_ttl_s,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down: %d nodes, %d open rooms dropped", *_sizes(service))
    sweeper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sweeper
    await server.stop(STOP_GRACE_S)
    if metrics_server is not None:
        metrics_server.close()
    logger.info("stopped")


def _sizes(service: BootstrapService) -> tuple[int, int]:
    return len(service.registry.nodes), len(service.rooms.rooms)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(LogConfig(args.log_level, args.log_format))
    listen, config = build_configs(parser, args)
    _install_uvloop()
    try:
        asyncio.run(serve(listen, config))
    except OSError as exc:
        logger.error("%s", exc)
        return 2
    return 0


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


if __name__ == "__main__":
    sys.exit(main())
