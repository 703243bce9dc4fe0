"""The pd-cluster flags the tools that start their own clusters share, and the `ClusterConfig`
they build (soak, tune_ratio, plan_capacity host)."""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.process.cluster import ClusterConfig


def add_cluster_args(group: Any, gateway_args: str = "", gateway_help: str = "") -> None:
    """`group`: a parser or an argument group."""
    group.add_argument("--transfer-backend", default="mooncake", choices=["mooncake", "nixl"])
    group.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M)")
    group.add_argument("--max-total-tokens", type=int, default=16384, help="KV tokens per node")
    group.add_argument("--node-args", default="", help="extra flags for every node (quoted)")
    help_ = gateway_help or "extra flags for the gateway"
    group.add_argument("--gateway-args", default=gateway_args, help=help_)


def cluster_config(
    args: argparse.Namespace, prefill: int, decode: int, **more: Any
) -> ClusterConfig:
    """A cluster on a free port from `add_cluster_args`' flags; `more` sets other fields."""
    from gateway.process.cluster import ClusterConfig

    fields: dict[str, Any] = {
        "node_args": tuple(shlex.split(args.node_args)),
        "gateway_args": tuple(shlex.split(args.gateway_args)),
    }
    fields.update(more)
    return ClusterConfig(
        prefill=prefill,
        decode=decode,
        backend=args.transfer_backend,
        model=args.model,
        port=0,
        max_total_tokens=args.max_total_tokens,
        **fields,
    )
