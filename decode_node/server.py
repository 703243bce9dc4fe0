"""`decode-server`: a decode node. With no prefill peers it prefills locally (colocated mode).

Life of the process: parse flags -> build frozen configs -> load the model -> start the engine
thread -> serve the node gRPC API (grpc.aio on uvloop) -> on SIGTERM/SIGINT stop accepting,
give in-flight requests `--shutdown-grace` seconds, abort the rest, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import grpc

from engine.builder import build_engine, resolve_model
from engine.engine_loop import EngineLoop
from engine.model_config import ModelConfigError
from engine.node_service import NodeService
from engine.server_args import (
    ServerConfig,
    add_node_args,
    configure_logging,
    engine_config,
    loop_config,
    server_config,
)
from proto import node_pb2_grpc

logger = logging.getLogger("pdserve.decode")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decode-server", description=__doc__.splitlines()[0])
    add_node_args(parser)
    parser.add_argument(
        "--mode", default="colocated", choices=["colocated"], help="colocated: prefill locally"
    )
    return parser


async def serve(engine_loop: EngineLoop, service: NodeService, config: ServerConfig) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    node_pb2_grpc.add_NodeServicer_to_server(service, server)
    address = f"{config.host}:{config.port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address}: the port is in use or the host is not local")
    await server.start()
    logger.info("serving the node API on %s (role %s)", address, service.role)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info(
        "shutting down: no new requests, %.1f s grace for in-flight", config.shutdown_grace_s
    )
    await server.stop(config.shutdown_grace_s)
    engine_loop.stop()
    logger.info("stopped")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        model_path = resolve_model(args.model)
        cfg = engine_config(args, model_path, weight_bytes=0)
        engine = build_engine(cfg)
    except (ValueError, FileNotFoundError, ModelConfigError) as exc:
        logger.error("cannot start: %s", exc)
        return 2
    engine_loop = EngineLoop(engine.scheduler, loop_config(args))
    engine_loop.start()
    service = NodeService(engine_loop, role=args.mode, model_name=model_path)
    _install_uvloop()
    try:
        asyncio.run(serve(engine_loop, service, server_config(args)))
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
