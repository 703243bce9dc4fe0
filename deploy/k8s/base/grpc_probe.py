"""Kubernetes exec probe for the pdserve gRPC servers (mounted into the pods from a ConfigMap).

The servers offer no `grpc.health.v1` service, so the kubelet's native gRPC probe cannot check
them; this script calls the real RPCs instead, with the servers' own token and TLS flags:
- `node`: `Node/Health` on a prefill- or decode-server; healthy when it answers `ok` (false once
  the engine hit a fatal error, `engine/node/service.py`).
- `bootstrap`: `Bootstrap/ListNodes` on the bootstrap-server; healthy when it answers.
Exit 0 healthy, 1 unhealthy (the reason on stderr). Needs the pdserve package (the image has it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from bootstrap.security import InternalAuth, add_internal_auth_args, internal_auth_from_args
from proto import bootstrap_pb2, bootstrap_pb2_grpc, node_pb2, node_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpc_probe.py", description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=["node", "bootstrap"])
    parser.add_argument("--address", required=True, help="host:port of the server's gRPC API")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds for the call")
    add_internal_auth_args(parser)  # the servers' own token and TLS flags
    return parser


async def check(target: str, address: str, auth: InternalAuth, timeout: float) -> str:
    """'' when healthy, else why not."""
    async with auth.channel(address) as channel:
        try:
            if target == "bootstrap":
                await bootstrap_pb2_grpc.BootstrapStub(channel).ListNodes(
                    bootstrap_pb2.ListNodesRequest(), timeout=timeout
                )
                return ""
            reply = await node_pb2_grpc.NodeStub(channel).Health(
                node_pb2.HealthRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            return f"{target} at {address}: {exc.code().name}: {exc.details()}"
    return "" if reply.ok else f"{reply.role} node {reply.node_id or address}: engine failed"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = asyncio.run(
        check(args.target, args.address, internal_auth_from_args(args), args.timeout)
    )
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
