"""What a disaggregated node runs, whichever its role: a transfer engine over its KV pool, a
bootstrap link, the role (roles.py: prefill_node/ or decode_node/) on the engine thread, and
the gRPC server, registered with bootstrap once it listens. The role may change while the node
runs (`SwitchRole`, role_switch.py); everything else here stays."""

from __future__ import annotations

import argparse

from bootstrap.security import internal_auth_from_args
from engine.builder import Engine
from engine.engine_loop import EngineLoop
from engine.metrics import NodeMetrics
from engine.node.args import loop_config, node_address, server_config, transfer_config
from engine.node.experts import expert_recording
from engine.node.kv_publisher import start_kv_events
from engine.node.role_switch import RoleSwitcher
from engine.node.roles import RoleParts, ServedRole, role_kind
from engine.node.server import serve_registered
from engine.node.service import NodeService
from engine.node.transfer_setup import make_link, node_info, node_load, setup_transfer


async def serve_disaggregated(
    args: argparse.Namespace, engine: Engine, model_path: str, kind: str
) -> None:
    """Serve as `kind` ("prefill" | "decode") until SIGTERM; switchable to any role."""
    scheduler = engine.scheduler
    runner = scheduler.runner
    served = ServedRole(role_kind(kind))
    transfer = setup_transfer(transfer_config(args, kind), runner)
    publisher = start_kv_events(args, scheduler)
    endpoints = publisher.endpoints if publisher is not None else None
    info = node_info(served.kind.wire, node_address(args), transfer, runner, args.node_id,
                     endpoints)  # fmt: skip
    load = lambda: node_load(scheduler, served.load_queues())  # noqa: E731
    auth = internal_auth_from_args(args)
    link = make_link(args.bootstrap, info, served.deliver, load, auth)
    metrics = NodeMetrics(kind)
    parts = RoleParts(args, link, transfer, runner, metrics)
    served.role = served.kind.build(parts)
    engine_loop = EngineLoop(scheduler, loop_config(args, kind), served.role, metrics)
    if publisher is not None:
        engine_loop.bind_kv_events(publisher.publish)
    experts = expert_recording(args, runner, metrics, model_path)
    service = NodeService(engine_loop, kind, model_path, link, args.stream_buffer_tokens, experts)
    config = server_config(args)
    service.switcher = RoleSwitcher(
        served, parts, engine_loop, service, link, metrics, config.drain_timeout_s
    )

    def close() -> None:
        transfer.engine.close()
        if publisher is not None:
            publisher.close()

    await serve_registered(engine_loop, service, config, link, close, auth)
