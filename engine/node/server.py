"""Serving one node process: the node gRPC API over an engine loop, plus its bootstrap link.

Shared by `decode-server` and `prefill-server`; their entry points build the configs, the
node role and the link, and hand them here. On SIGTERM/SIGINT the node drains: it refuses new
requests and tells bootstrap (heartbeat `draining`: gateways stop routing to it), gives in-flight
requests `--drain-timeout` to finish, aborts the rest (the gateway moves streams that already
started to another node), checks that no page is in use, deregisters and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc

from bootstrap.security import InternalAuth, add_internal_auth_args
from bootstrap.telemetry import serve_metrics
from engine.builder import Engine, build_engine
from engine.engine_loop import EngineLoop
from engine.model_config import ModelConfigError
from engine.model_fetch import resolve_model
from engine.node.args import ServerConfig, add_disagg_args, add_node_args, engine_config
from engine.node.bootstrap_link import NodeLink
from engine.node.service import NodeService
from engine.node.tp_transfer import RankTransferAgent
from proto import node_pb2_grpc

logger = logging.getLogger("pdserve.node")

ABORT_WAIT_S = 2.0  # after the drain timeout: aborted requests end within a step or two


# Clients (the gateway: --node-keepalive) ping open calls to find a node that stopped answering.
# gRPC servers by default answer pings more often than every 5 minutes on a quiet stream (D
# waiting for a long prefill) with GOAWAY "too_many_pings", which would fail every call on the
# connection: accept one a second.
PING_POLICY = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


async def serve_node(
    engine_loop: EngineLoop,
    service: NodeService,
    config: ServerConfig,
    on_started: Callable[[], Awaitable[None]] | None = None,
    on_stopping: Callable[[], Awaitable[None]] | None = None,
    auth: InternalAuth | None = None,
    on_draining: Callable[[], Awaitable[None]] | None = None,
) -> None:
    auth = auth or InternalAuth()
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), *PING_POLICY], interceptors=auth.server_interceptors()
    )
    node_pb2_grpc.add_NodeServicer_to_server(service, server)
    address = f"{config.host}:{config.port}"
    if auth.add_port(server, address) == 0:
        raise OSError(f"cannot listen on {address}: the port is in use or the host is not local")
    metrics = serve_metrics(engine_loop.metrics.registry, config.host, config.metrics_port)
    try:
        await _serve(server, engine_loop, service, config, on_started, on_stopping, on_draining)
    finally:
        if metrics is not None:
            metrics.close()


async def _serve(
    server: grpc.aio.Server,
    engine_loop: EngineLoop,
    service: NodeService,
    config: ServerConfig,
    on_started: Callable[[], Awaitable[None]] | None,
    on_stopping: Callable[[], Awaitable[None]] | None,
    on_draining: Callable[[], Awaitable[None]] | None,
) -> None:
    address = f"{config.host}:{config.port}"
    await server.start()
    if on_started is not None:
        await on_started()
    logger.info("serving the node API on %s (role %s)", address, service.role)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await drain(service, config.drain_timeout_s, on_draining)
    await server.stop(1.0)  # nothing is in flight any more
    if on_stopping is not None:
        await on_stopping()
    engine_loop.stop()
    if service.experts is not None:
        service.experts.write_at_exit()
    logger.info("stopped")


async def drain(
    service: NodeService,
    timeout_s: float,
    on_draining: Callable[[], Awaitable[None]] | None,
    why: str = "shutting down",
) -> int:
    """Refuse new requests, tell the bootstrap, let in-flight ones finish for `timeout_s`, then
    abort the rest: their streams end with Finished(abort), and the gateway moves those that
    already streamed to another node (migration). Returns how many were aborted. `why` (SIGTERM:
    shutting down; a role switch) is what refused requests are told."""
    service.start_draining(why)
    if on_draining is not None:
        await on_draining()
    logger.info(
        "draining (%s): no new requests; %d in flight get %.1f s (--drain-timeout) to finish",
        why,
        service.inflight,
        timeout_s,
    )
    await _until_idle(service, timeout_s)
    aborted = 0
    if service.inflight:
        aborted = service.abort_all("the node is draining and its --drain-timeout ran out")
        logger.info("aborted %d in-flight requests (the gateway moves their streams)", aborted)
        await _until_idle(service, ABORT_WAIT_S)
    try:
        used = await asyncio.wait_for(service.pages_in_use(), ABORT_WAIT_S)
    except asyncio.TimeoutError:  # not a failed check: the engine loop is inside a long step
        logger.warning(
            "drained; pages in use not checked: the engine loop did not answer within %.0f s "
            "(a long step under way)",
            ABORT_WAIT_S,
        )
        return aborted
    except AssertionError as exc:
        logger.error("drained, but the KV integrity check failed: %r", exc)
        return aborted
    if used:
        logger.warning("drained with %d pages still in use (quarantined rooms)", used)
    else:
        logger.info("drained: no request in flight, no page in use")
    return aborted


async def _until_idle(service: NodeService, timeout_s: float) -> None:
    """Return once no request is in flight on `service`, or after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while service.inflight and loop.time() < deadline:
        await asyncio.sleep(0.05)


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def serve_registered(
    engine_loop: EngineLoop,
    service: NodeService,
    config: ServerConfig,
    link: NodeLink,
    close_transfer: Callable[[], None],
    auth: InternalAuth | None = None,
) -> None:
    """Serve a disaggregated node: register once listening, deregister and close at the end."""

    async def started() -> None:
        node_id = await link.start()
        logger.info("registered with bootstrap as %s node %s", service.role, node_id)

    engine_loop.start()
    try:
        await serve_node(engine_loop, service, config, started, link.stop, auth, link.drain)
    finally:
        close_transfer()


def node_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The flags both node servers take: the model's and the engine's, disaggregation's and
    the internal auth's; a server adds its own."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_node_args(parser)
    add_disagg_args(parser)
    add_internal_auth_args(parser)
    return parser


def run_node_main(
    args: argparse.Namespace,
    name: str,
    run: Callable[[argparse.Namespace, Engine, str], Coroutine[Any, Any, None]],
) -> int:
    """The common `main` of the node servers: load the model, then run `run` on uvloop."""
    try:
        model_path = resolve_model(args.model)
        # A TP node's other ranks run its KV transfers too (engine/node/tp_transfer.py).
        engine = build_engine(engine_config(args, model_path), RankTransferAgent)
    except (ValueError, FileNotFoundError, ModelConfigError) as exc:
        logger.error("%s cannot start: %s", name, exc)
        return 2
    install_uvloop()
    try:
        asyncio.run(run(args, engine, model_path))
    except Exception as exc:
        logger.error("%s failed: %s", name, exc)
        return 1
    return 0
