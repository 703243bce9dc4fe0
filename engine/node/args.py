"""Command-line flags shared by every node server, turned into frozen configs at the edge."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from bootstrap.telemetry import LogConfig, add_log_args, add_metrics_port_arg
from bootstrap.telemetry import configure_logging as _configure_logging
from engine.config import EngineConfig
from engine.engine_loop import LoopConfig
from engine.eplb.placement import ExpertPlacement
from engine.models.linear_backends import LINEAR_KERNELS
from engine.node.experts import add_expert_args, expert_flags
from engine.node.kv_publisher import add_kv_events_args
from engine.node.multiplex import MAX_UNSENT_TOKENS
from kvtransfer import TRANSFER_BACKENDS
from kvtransfer.base import TransferConfig
from kvtransfer.cuda_batch_copy import COPY_METHODS

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int
    drain_timeout_s: float  # SIGTERM -> in-flight requests get this long, then are aborted
    metrics_port: int | None = None  # GET /metrics on this HTTP port (None: not served)


def add_node_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and memory")
    g.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M)")
    g.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument(
        "--linear-kernel",
        default="auto",
        choices=LINEAR_KERNELS,
        help="matmuls of the linear layers: oneDNN over weights packed at load (CPU), a skinny "
        "split-K Triton GEMM for decode batches (CUDA), torch's F.linear, or auto (oneDNN where "
        "it can run, Triton on a GPU with measured decode tiles, else F.linear); see "
        "docs/decode-kernels.md",
    )
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--max-total-tokens", type=int, default=None, help="KV capacity in tokens")
    g.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help="weights and KV pool together take this fraction of device memory (as SGLang's "
        "--mem-fraction-static): the pool gets what the weights leave of it",
    )
    g.add_argument("--context-length", type=int, default=None)
    g.add_argument(
        "--kv-staging-pages",
        type=int,
        default=0,
        help="KV pages set aside beside the pool (not counted in it) to move a request's "
        "scattered pages as one contiguous span: gathered on the prefill node, scattered on "
        "the decode node (engine/memory/staging.py); 0 = off. TP size 1 only",
    )
    g.add_argument(
        "--kv-staging-min-runs",
        type=int,
        default=16,
        help="with --kv-staging-pages: stage a write whose pages form more runs (transfer "
        "descriptors) than this",
    )
    g.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks (processes) of this node; see engine/tp/partition.py",
    )
    g.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="expert parallelism (MoE models): the routed experts sharded this many ways over "
        "the node's --tp-size ranks, whole experts per rank, tokens sent to them by all-to-all "
        "(a divisor of --tp-size and of the experts; 1: every rank holds each expert's rows)",
    )
    g = parser.add_argument_group("scheduling")
    g.add_argument("--chunked-prefill-size", type=int, default=2048)
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"])
    g.add_argument("--disable-prefix-cache", action="store_true")
    g.add_argument("--attention-backend", default="torch_native")
    g.add_argument(
        "--overlap-schedule",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="build the next step on the host while the GPU runs this one (engine/overlap.py); "
        "default: on for CUDA with --tp-size 1, off elsewhere",
    )
    g.add_argument(
        "--graph-step-prep",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CUDA-graph decode steps: one packed host-to-device copy per step, positions, "
        "table entries, attention plan and greedy sampling inside the graph "
        "(engine/step_prep.py)",
    )
    g.add_argument("--watchdog-timeout", type=float, default=300.0, help="seconds per step")
    g.add_argument("--decode-log-interval", type=int, default=40)
    g.add_argument(
        "--step-trace-dir",
        default=None,
        help="write one JSON line per engine step to DIR/<role>-<port>.jsonl "
        "(engine/step_trace.py; compare with a profile: plan_capacity.py steps)",
    )
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument(
        "--advertise-host",
        default=None,
        help="address other nodes and the gateway reach this node at, registered with "
        "bootstrap and used by the transfer engine (default: --host; required when --host "
        "listens on every interface)",
    )
    g.add_argument("--port", type=int, default=30001)
    g.add_argument(
        "--stream-buffer-tokens",
        type=int,
        default=MAX_UNSENT_TOKENS,
        help="tokens a request on a GenerateStream call may have unsent while its client does "
        "not read; past it the request is aborted (its pages freed) and the client gets "
        "RESOURCE_EXHAUSTED",
    )
    g.add_argument(
        "--drain-timeout",
        "--shutdown-grace",
        dest="drain_timeout",
        type=float,
        default=5.0,
        help="on SIGTERM the node drains: no new requests (gateways route around it), this many "
        "seconds for in-flight ones to finish, then the rest are aborted (the gateway moves "
        "streams that already started to another node) and it exits",
    )
    add_metrics_port_arg(g)
    add_log_args(g)
    add_kv_events_args(parser)
    add_expert_args(parser)


def configure_logging(args: argparse.Namespace) -> None:
    """`--log-level` / `--log-format` -> the process's one log format (bootstrap/telemetry.py)."""
    _configure_logging(LogConfig(args.log_level, args.log_format))


def engine_config(args: argparse.Namespace, model_path: str) -> EngineConfig:
    placement = expert_flags(args, model_path)
    max_tokens = args.max_total_tokens
    if max_tokens is None and args.mem_fraction is not None:
        # the staging pages live in the same memory: the pool gets what they leave
        staging_tokens = args.kv_staging_pages * args.page_size
        max_tokens = _tokens_for_fraction(args, model_path, placement) - staging_tokens
        if max_tokens < args.page_size:
            raise ValueError(
                f"--kv-staging-pages {args.kv_staging_pages} leaves no KV pool within "
                f"--mem-fraction {args.mem_fraction}; lower it or raise --mem-fraction"
            )
    return EngineConfig(
        model_path=model_path,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        chunked_prefill_size=args.chunked_prefill_size,
        max_total_tokens=max_tokens or 65536,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        attention_backend=args.attention_backend,
        enable_prefix_cache=not args.disable_prefix_cache,
        schedule_policy=args.schedule_policy,
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        overlap_schedule=args.overlap_schedule,
        graph_step_prep=args.graph_step_prep,
        linear_kernel=args.linear_kernel,
        kv_staging_pages=args.kv_staging_pages,
        kv_staging_min_runs=args.kv_staging_min_runs,
        expert_placement=placement,
    )


def _tokens_for_fraction(
    args: argparse.Namespace, model_path: str, placement: ExpertPlacement | None
) -> int:
    """KV tokens that fit in `--mem-fraction` of the device's memory beside this rank's share
    of the weights (a TP rank holds 1/tp of them; under EP its routed experts whole, 1/ep, or
    the placement's slots per rank)."""
    from engine.model_config import ModelConfig
    from engine.tp.partition import rank_parameters

    if not 0 < args.mem_fraction < 1:
        raise ValueError(f"--mem-fraction must be in (0, 1), got {args.mem_fraction}")
    if args.device.startswith("cuda"):
        import torch

        total = torch.cuda.mem_get_info(args.device)[1]
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mc = ModelConfig.from_dir(model_path)
    elem = 2 if args.dtype != "float32" else 4
    weight_bytes = rank_parameters(mc, args.tp_size, args.ep_size, placement) * elem
    per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * elem // args.tp_size
    budget = total * args.mem_fraction - weight_bytes
    if budget < per_token * args.page_size:
        raise ValueError(
            f"--mem-fraction {args.mem_fraction} leaves no room for KV after "
            f"{weight_bytes / 2**30:.1f} GiB of weights; raise it"
        )
    return int(budget // per_token)


def loop_config(args: argparse.Namespace, role: str) -> LoopConfig:
    """`role` (colocated, prefill, decode) names the node's step trace file."""
    trace_dir = args.step_trace_dir
    return LoopConfig(
        decode_log_interval=args.decode_log_interval,
        watchdog_timeout_s=args.watchdog_timeout,
        step_trace=Path(trace_dir) / f"{role}-{args.port}.jsonl" if trace_dir else None,
    )


def server_config(args: argparse.Namespace) -> ServerConfig:
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise ValueError(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    return ServerConfig(
        host=args.host,
        port=args.port,
        drain_timeout_s=args.drain_timeout,
        metrics_port=args.metrics_port,
    )


def add_disagg_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("disaggregation")
    g.add_argument("--bootstrap", default=None, help="bootstrap-server address host:port")
    g.add_argument(
        "--transfer-backend",
        default="mooncake",
        choices=sorted(TRANSFER_BACKENDS),
        help="cuda_ipc: both nodes on GPUs of one host (docs/architecture.md)",
    )
    g.add_argument("--transfer-protocol", default="tcp", help="mooncake: tcp or rdma")
    g.add_argument(
        "--cuda-ipc-copy",
        default="kernel",
        choices=COPY_METHODS,
        help="cuda_ipc: how whole pages are copied: its Triton kernel, or the driver's batched "
        "copy (cuMemcpyBatchAsync, CUDA 12.8+; batch-overlap hints copy engines); a driver "
        "without it falls back to the kernel with a warning",
    )
    g.add_argument("--transfer-devices", default="", help="mooncake RDMA devices, e.g. mlx5_0")
    g.add_argument("--node-id", default="", help="id to register with (default: assigned)")
    g.add_argument(
        "--bootstrap-timeout", type=float, default=30.0, help="seconds to wait for the peer"
    )
    g.add_argument(
        "--transfer-timeout",
        type=float,
        default=300.0,
        help="seconds without progress before a room's transfer is given up",
    )
    g.add_argument(
        "--kv-stream-layers",
        type=int,
        default=0,
        metavar="G",
        help="prefill role: write a chunk's KV in G layer groups, each as soon as its layers "
        "are computed, so the transfer overlaps the prefill (prefill_node/layer_stream.py); "
        "0 = after the chunk's whole forward. TP size 1, no --kv-staging-pages",
    )
    g.add_argument(
        "--decode-headroom", type=int, default=32, help="decode tokens reserved beside a prompt"
    )
    g.add_argument(
        "--inject-transfer-failures",
        type=float,
        default=0.0,
        metavar="RATE",
        help="testing only: make this fraction of KV writes fail",
    )
    g.add_argument(
        "--inject-aux-corruption",
        type=float,
        default=0.0,
        metavar="RATE",
        help="testing only: corrupt this fraction of first-token (aux) writes to decode nodes",
    )


def advertised_host(args: argparse.Namespace) -> str:
    """The address peers use for this node: --advertise-host, else --host unless a wildcard."""
    host = args.advertise_host or args.host
    if host in WILDCARD_HOSTS:
        raise ValueError(
            f"--host {args.host} listens on every interface: give --advertise-host, the "
            "address the other nodes and the gateway reach this node at"
        )
    return str(host)


def node_address(args: argparse.Namespace) -> str:
    """host:port of the node API as registered with bootstrap."""
    return f"{advertised_host(args)}:{args.port}"


def transfer_config(args: argparse.Namespace, role: str) -> TransferConfig:
    for flag in ("inject_transfer_failures", "inject_aux_corruption"):
        if not 0.0 <= getattr(args, flag) <= 1.0:
            name = "--" + flag.replace("_", "-")
            raise ValueError(f"{name} is a probability in [0, 1], got {getattr(args, flag)}")
    return TransferConfig(
        backend=args.transfer_backend,
        node_name=f"{role}-{advertised_host(args)}-{args.port}",
        host=advertised_host(args),
        protocol=args.transfer_protocol,
        device_names=args.transfer_devices,
        fail_rate=args.inject_transfer_failures,
        aux_corrupt_rate=args.inject_aux_corruption,
        ipc_copy=args.cuda_ipc_copy,
    )
