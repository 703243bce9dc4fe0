"""Wiring a node for disaggregation: register its KV pool and aux slots with the transfer
engine once, and describe them (with the KV layout) for bootstrap."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bootstrap.client import BootstrapClient
from bootstrap.node_link import NodeLink
from bootstrap.security import InternalAuth
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler
from kvtransfer import KVTransferEngine, MemoryRegion, TransferConfig, create_engine
from kvtransfer.aux import AuxBuffer
from kvtransfer.room import RoomMessage
from proto import bootstrap_pb2


@dataclass
class TransferSetup:
    engine: KVTransferEngine
    aux: AuxBuffer
    regions: list[MemoryRegion]

    @property
    def kv_base(self) -> int:
        return self.regions[0].addr


def setup_transfer(config: TransferConfig, runner: ModelRunner) -> TransferSetup:
    engine = create_engine(config)
    buffer = runner.kv_cache.buffer
    device = "cpu" if buffer.device.type == "cpu" else f"cuda:{buffer.device.index or 0}"
    aux = AuxBuffer(runner.req_to_token.table.shape[0])
    regions = [
        MemoryRegion("kv", buffer.data_ptr(), buffer.numel() * buffer.element_size(), device),
        MemoryRegion("aux", aux.addr, aux.nbytes, "cpu"),
    ]
    engine.register(regions)
    return TransferSetup(engine, aux, regions)


def model_id(model_path: str) -> str:
    """Nodes serve the same model when their config.json files are identical."""
    config = Path(model_path) / "config.json"
    digest = hashlib.sha1(config.read_bytes()).hexdigest()[:12] if config.is_file() else "none"
    return f"{Path(model_path).name}-{digest}"


def node_info(
    role: int,
    grpc_address: str,
    transfer: TransferSetup,
    runner: ModelRunner,
    node_id: str = "",
) -> bootstrap_pb2.NodeInfo:
    layout = runner.kv_layout
    return bootstrap_pb2.NodeInfo(
        node_id=node_id,
        role=role,  # type: ignore[arg-type]
        grpc_address=grpc_address,
        transfer_backend=transfer.engine.config.backend,
        transfer_endpoint=transfer.engine.local_endpoint(),
        layout=bootstrap_pb2.KVLayout(
            model_id=model_id(runner.config.model_path),
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            page_size=layout.page_size,
            dtype=runner.config.dtype,
            tp_size=1,
            tp_rank=0,
            page_bytes=layout.page_bytes,
        ),
        regions=[
            bootstrap_pb2.MemoryRegion(name=r.name, addr=r.addr, length=r.length, device=r.device)
            for r in transfer.regions
        ],
        aux_slot_bytes=transfer.aux.slot_bytes(),
    )


def make_link(
    bootstrap_address: str,
    info: bootstrap_pb2.NodeInfo,
    deliver: Callable[[RoomMessage], None],
    load: Callable[[], bootstrap_pb2.NodeLoad],
    auth: InternalAuth | None = None,
) -> NodeLink:
    return NodeLink(BootstrapClient(bootstrap_address, auth=auth), info, deliver, load)


def node_load(
    scheduler: Scheduler, role_queues: Callable[[], tuple[int, int]]
) -> bootstrap_pb2.NodeLoad:
    """Heartbeat payload; read from another thread without locks (plain ints, may be stale)."""
    alloc = scheduler.kv.allocator
    transfer_q, bootstrap_q = role_queues()
    return bootstrap_pb2.NodeLoad(
        running_requests=len(scheduler.running),
        queued_requests=len(scheduler.waiting),
        free_pages=alloc.num_free + alloc.num_cached,
        total_pages=alloc.total,
        transfer_queue=transfer_q,
        bootstrap_queue=bootstrap_q,
    )
