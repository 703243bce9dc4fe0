"""Flags the tools share: a frozen config from the flags of its fields' names, and the pd-cluster
flags of the tools that start their own clusters (soak, tune_ratio, plan_capacity host)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from gateway.process.cluster import ClusterConfig

T = TypeVar("T")


def config_from_args(cls: type[T], args: argparse.Namespace, **more: Any) -> T:
    """`cls` (a dataclass) with each field that has a flag of its name taken from `args`;
    `more` gives the others (renamed or parsed)."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(args).items() if k in names} | more)


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
