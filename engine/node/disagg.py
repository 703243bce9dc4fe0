"""What a disaggregated node runs, whichever its role: a transfer engine over its KV pool, a
bootstrap link, the role (prefill_node/ or decode_node/) on the engine thread, and the gRPC
server, registered with bootstrap once it listens."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry

from bootstrap.security import internal_auth_from_args
from engine.builder import Engine
from engine.engine_loop import EngineLoop, NodeRole
from engine.metrics import NodeMetrics
from engine.model_runner import ModelRunner
from engine.node.args import loop_config, node_address, server_config, transfer_config
from engine.node.bootstrap_link import NodeLink
from engine.node.kv_publisher import start_kv_events
from engine.node.server import serve_registered
from engine.node.service import NodeService
from engine.node.transfer_setup import (
    TransferSetup,
    make_link,
    node_info,
    node_load,
    setup_transfer,
)
from kvtransfer.room import RoomMessage
from proto import bootstrap_pb2


class PDRole(NodeRole, Protocol):
    def deliver(self, message: RoomMessage) -> None:
        """From the bootstrap link's thread: a room message for the engine thread."""
        ...

    def load_queues(self) -> tuple[int, int]:
        """(rooms in transfer, rooms waiting) for the heartbeat's load, from any thread."""
        ...


@dataclass(frozen=True)
class RoleParts:
    """What a node's role is built from."""

    args: argparse.Namespace  # the node's flags (the role's timeouts among them)
    link: NodeLink
    transfer: TransferSetup
    runner: ModelRunner
    registry: CollectorRegistry  # the node's metrics


RoleFactory = Callable[[RoleParts], PDRole]
ROLES = {"prefill": bootstrap_pb2.PREFILL, "decode": bootstrap_pb2.DECODE}


async def serve_disaggregated(
    args: argparse.Namespace, engine: Engine, model_path: str, kind: str, build_role: RoleFactory
) -> None:
    scheduler = engine.scheduler
    runner = scheduler.runner
    transfer = setup_transfer(transfer_config(args, kind), runner)
    publisher = start_kv_events(args, scheduler)
    endpoints = publisher.endpoints if publisher is not None else None
    info = node_info(ROLES[kind], node_address(args), transfer, runner, args.node_id, endpoints)
    role: PDRole  # built below, once the link it needs exists
    load = lambda: node_load(scheduler, role.load_queues())  # noqa: E731
    auth = internal_auth_from_args(args)
    link = make_link(args.bootstrap, info, lambda msg: role.deliver(msg), load, auth)
    metrics = NodeMetrics(kind)
    role = build_role(RoleParts(args, link, transfer, runner, metrics.registry))
    engine_loop = EngineLoop(scheduler, loop_config(args, kind), role, metrics)
    if publisher is not None:
        engine_loop.bind_kv_events(publisher.publish)
    service = NodeService(engine_loop, kind, model_path, link)

    def close() -> None:
        transfer.engine.close()
        if publisher is not None:
            publisher.close()

    await serve_registered(engine_loop, service, server_config(args), link, close, auth)
