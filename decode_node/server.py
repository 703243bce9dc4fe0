"""`decode-server`: a decode node.

`--mode colocated` (default): prefills locally, no peers needed: the baseline and the right
choice for tiny setups. `--mode disaggregated --bootstrap HOST:PORT`: registers with bootstrap
and takes requests that carry a bootstrap room, whose KV a prefill node writes into its pages;
requests without a room are still prefilled locally, so one binary serves both ways.
"""

from __future__ import annotations

import argparse
import logging
import sys

from bootstrap.security import internal_auth_from_args
from decode_node.decode_role import DecodeRole, DecodeRoleConfig
from engine.builder import Engine
from engine.engine_loop import EngineLoop
from engine.metrics import NodeMetrics
from engine.node.args import configure_logging, loop_config, server_config
from engine.node.disagg import serve_disaggregated
from engine.node.experts import expert_recording
from engine.node.kv_publisher import start_kv_events
from engine.node.roles import RoleParts
from engine.node.server import node_parser, run_node_main, serve_node
from engine.node.service import NodeService

logger = logging.getLogger("pdserve.decode")


def build_parser() -> argparse.ArgumentParser:
    parser = node_parser("decode-server", __doc__.splitlines()[0])
    parser.add_argument("--mode", default="colocated", choices=["colocated", "disaggregated"])
    return parser


async def _run(args: argparse.Namespace, engine: Engine, model_path: str) -> None:
    scheduler = engine.scheduler
    if args.mode == "colocated":
        metrics = NodeMetrics("colocated")
        engine_loop = EngineLoop(scheduler, loop_config(args, "colocated"), metrics=metrics)
        # Registered nowhere: its events are for a router that is given the endpoints.
        publisher = start_kv_events(args, scheduler)
        if publisher is not None:
            engine_loop.bind_kv_events(publisher.publish)
        experts = expert_recording(args, scheduler.runner, metrics, model_path)
        service = NodeService(
            engine_loop,
            "colocated",
            model_path,
            max_unsent_tokens=args.stream_buffer_tokens,
            experts=experts,
        )
        engine_loop.start()
        try:
            await serve_node(
                engine_loop, service, server_config(args), auth=internal_auth_from_args(args)
            )
        finally:
            if publisher is not None:
                publisher.close()
        return
    await serve_disaggregated(args, engine, model_path, "decode")


def build_role(parts: RoleParts) -> DecodeRole:
    return DecodeRole(
        DecodeRoleConfig(parts.args.decode_headroom, parts.args.transfer_timeout),
        link=parts.link,
        aux=parts.transfer.aux,
        page_size=parts.runner.config.page_size,
        metrics=parts.metrics.decode_role(),
        stager=parts.runner.stager,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args)
    if args.mode == "disaggregated" and not args.bootstrap:
        logger.error("--mode disaggregated needs --bootstrap HOST:PORT")
        return 2
    return run_node_main(args, "decode-server", _run)


if __name__ == "__main__":
    sys.exit(main())
