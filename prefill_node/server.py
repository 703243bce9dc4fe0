"""`prefill-server`: a prefill node. Registers with bootstrap, takes `Prefill(room, decode
node, tokens)` calls, runs chunked extend batches and writes the KV and the first token into
the decode node's pages (see prefill_role.py for the queues). It never decodes."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

import torch

from bootstrap.security import add_internal_auth_args, internal_auth_from_args
from engine.builder import Engine
from engine.engine_loop import EngineLoop
from engine.metrics import NodeMetrics, PrefillMetrics
from engine.node.args import (
    add_disagg_args,
    add_node_args,
    configure_logging,
    loop_config,
    node_address,
    server_config,
    transfer_config,
)
from engine.node.server import run_node_main, serve_registered
from engine.node.service import NodeService
from engine.node.transfer_setup import make_link, node_info, node_load, setup_transfer
from prefill_node.prefill_role import PrefillRole, PrefillRoleConfig
from proto import bootstrap_pb2

logger = logging.getLogger("pdserve.prefill")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefill-server", description=__doc__.splitlines()[0])
    add_node_args(parser)
    add_disagg_args(parser)
    add_internal_auth_args(parser)
    parser.set_defaults(port=30002)
    return parser


def kv_ready(device: torch.device) -> Callable[[], None]:
    """What the role waits on before sending a step's KV: the GPU's queued kernels (the
    transfer engine copies on streams of its own); nothing on the CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


async def _run(args: argparse.Namespace, engine: Engine, model_path: str) -> None:
    scheduler = engine.scheduler
    runner = scheduler.runner
    transfer = setup_transfer(transfer_config(args, "prefill"), runner)
    info = node_info(bootstrap_pb2.PREFILL, node_address(args), transfer, runner, args.node_id)
    load = lambda: node_load(scheduler, lambda: (len(role.inflight), len(role.bootstrap)))  # noqa: E731
    auth = internal_auth_from_args(args)
    link = make_link(args.bootstrap, info, lambda msg: role.deliver(msg), load, auth)
    metrics = NodeMetrics("prefill")
    role = PrefillRole(
        PrefillRoleConfig(args.bootstrap_timeout, args.transfer_timeout),
        link=link,
        engine=transfer.engine,
        aux=transfer.aux,
        kv=transfer.node_kv(runner),
        page_size=runner.config.page_size,
        metrics=PrefillMetrics(metrics.registry),
        kv_ready=kv_ready(runner.device),
    )
    engine_loop = EngineLoop(scheduler, loop_config(args, "prefill"), role, metrics)
    service = NodeService(engine_loop, "prefill", model_path, link)

    await serve_registered(
        engine_loop, service, server_config(args), link, transfer.engine.close, auth
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args)
    if not args.bootstrap:
        logger.error("prefill-server needs --bootstrap HOST:PORT")
        return 2
    return run_node_main(args, "prefill-server", _run)


if __name__ == "__main__":
    sys.exit(main())
