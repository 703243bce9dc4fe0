"""`prefill-server`: a prefill node. Registers with bootstrap, takes `Prefill(room, decode
node, tokens)` calls, runs chunked extend batches and writes the KV and the first token into
the decode node's pages (see prefill_role.py for the queues). It never decodes."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

import torch

from engine.builder import Engine
from engine.layer_groups import split_layers
from engine.node.args import configure_logging
from engine.node.disagg import serve_disaggregated
from engine.node.roles import RoleParts
from engine.node.server import node_parser, run_node_main
from prefill_node.layer_stream import StreamConfig, check_streamable
from prefill_node.prefill_role import PrefillRole, PrefillRoleConfig

logger = logging.getLogger("pdserve.prefill")


def build_parser() -> argparse.ArgumentParser:
    parser = node_parser("prefill-server", __doc__.splitlines()[0])
    parser.set_defaults(port=30002)
    return parser


def kv_ready(device: torch.device) -> Callable[[], None]:
    """What the role waits on before sending a step's KV: the GPU's queued kernels (the
    transfer engine copies on streams of its own); nothing on the CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def stream_config(parts: RoleParts) -> StreamConfig | None:
    """`--kv-stream-layers G` as the role's config (None: 0, off); ValueError if it cannot run
    on this node."""
    args, runner = parts.args, parts.runner
    groups, num_layers = args.kv_stream_layers, runner.model_config.num_layers
    check_streamable(groups, num_layers, runner.config.tp_size, runner.config.kv_staging_pages)
    if not groups:
        return None
    engine = parts.transfer.engine
    return StreamConfig(
        groups=split_layers(num_layers, groups),
        layer_page_bytes=runner.kv_layout.layer_page_bytes,
        page_size=runner.config.page_size,
        stream_ordered=engine.stream_ordered,
        device=runner.device,
        poster=engine.concurrent_writes and not engine.stream_ordered,
    )


def build_role(parts: RoleParts) -> PrefillRole:
    args, runner = parts.args, parts.runner
    return PrefillRole(
        PrefillRoleConfig(args.bootstrap_timeout, args.transfer_timeout),
        link=parts.link,
        engine=parts.transfer.engine,
        aux=parts.transfer.aux,
        kv=parts.transfer.node_kv(runner),
        page_size=runner.config.page_size,
        metrics=parts.metrics.prefill_role(),
        kv_ready=kv_ready(runner.device),
        stager=runner.stager,
        stream=stream_config(parts),
    )


async def _run(args: argparse.Namespace, engine: Engine, model_path: str) -> None:
    await serve_disaggregated(args, engine, model_path, "prefill")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args)
    if not args.bootstrap:
        logger.error("prefill-server needs --bootstrap HOST:PORT")
        return 2
    return run_node_main(args, "prefill-server", _run)


if __name__ == "__main__":
    sys.exit(main())
