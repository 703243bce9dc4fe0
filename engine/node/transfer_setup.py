"""Wiring a node for disaggregation: register its KV pool and aux slots with the transfer
engine once, and describe them (with the KV layout) for bootstrap."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bootstrap.client import BootstrapClient
from bootstrap.security import InternalAuth
from engine.model_runner import ModelRunner
from engine.node.bootstrap_link import NodeLink
from engine.node.kv_publisher import KVEventsEndpoints
from engine.node.tp_transfer import RankTransferInfo, kv_region, rank_info, setup_tp_transfer
from engine.scheduler import Scheduler
from kvtransfer import create_engine
from kvtransfer.aux import AuxBuffer
from kvtransfer.base import KVTransferEngine, MemoryRegion, TransferConfig
from kvtransfer.head_routes import NodeKV, RankKV
from kvtransfer.room import RoomMessage
from proto import bootstrap_pb2


@dataclass
class TransferSetup:
    engine: KVTransferEngine  # a TPTransferEngine over every rank with tensor parallelism
    aux: AuxBuffer
    regions: list[MemoryRegion]  # rank 0's KV buffer and its aux slots
    ranks: list[RankTransferInfo]  # every TP rank's KV shard (rank 0's alone with TP=1)

    @property
    def kv_base(self) -> int:
        return self.regions[0].addr

    def node_kv(self, runner: ModelRunner) -> NodeKV:
        """This node's KV shards as its KV sender reads them."""
        head_page_bytes = runner.kv_layout.head_page_bytes
        ranks = tuple(
            RankKV(r.tp_rank, "", r.kv.addr, r.kv_heads, head_page_bytes) for r in self.ranks
        )
        return NodeKV(ranks, head_page_bytes, runner.model_config.num_kv_heads)


def setup_transfer(config: TransferConfig, runner: ModelRunner) -> TransferSetup:
    """Register the KV pool (every TP rank's shard with that rank's engine) and aux slots."""
    aux = AuxBuffer(runner.req_to_token.table.shape[0])
    aux_region = MemoryRegion("aux", aux.addr, aux.nbytes, "cpu")
    if runner.group.size > 1:
        tp_engine, ranks = setup_tp_transfer(config, runner, aux_region)
        return TransferSetup(tp_engine, aux, [ranks[0].kv, aux_region], ranks)
    engine = create_engine(config)
    regions = [kv_region(runner), aux_region]
    engine.register(regions)
    return TransferSetup(engine, aux, regions, [rank_info(runner, engine)])


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
    kv_events: KVEventsEndpoints | None = None,
) -> bootstrap_pb2.NodeInfo:
    layout = runner.kv_layout
    events = None
    if kv_events is not None:
        events = bootstrap_pb2.KVEventsEndpoint(
            publisher=kv_events.publisher,
            replay=kv_events.replay,
            topic=kv_events.topic.decode(),
            block_size=kv_events.block_size,
        )
    return bootstrap_pb2.NodeInfo(
        node_id=node_id,
        role=role,  # type: ignore[arg-type]
        grpc_address=grpc_address,
        transfer_backend=transfer.engine.config.backend,
        transfer_endpoint=transfer.engine.local_endpoint(),
        layout=bootstrap_pb2.KVLayout(
            model_id=model_id(runner.config.model_path),
            num_layers=layout.num_layers,
            num_kv_heads=runner.model_config.num_kv_heads,
            head_dim=layout.head_dim,
            page_size=layout.page_size,
            dtype=runner.config.dtype,
            tp_size=runner.config.tp_size,
            tp_rank=0,
            page_bytes=layout.page_bytes,
        ),
        regions=[_region_proto(r) for r in transfer.regions],
        aux_slot_bytes=transfer.aux.slot_bytes(),
        tp_ranks=[_rank_proto(r) for r in transfer.ranks] if len(transfer.ranks) > 1 else [],
        kv_events=events,
    )


def _region_proto(region: MemoryRegion) -> bootstrap_pb2.MemoryRegion:
    return bootstrap_pb2.MemoryRegion(
        name=region.name, addr=region.addr, length=region.length, device=region.device
    )


def _rank_proto(rank: RankTransferInfo) -> bootstrap_pb2.TPRankInfo:
    return bootstrap_pb2.TPRankInfo(
        tp_rank=rank.tp_rank,
        transfer_endpoint=rank.endpoint,
        kv=_region_proto(rank.kv),
        kv_head_start=rank.kv_heads.start,
        num_kv_heads=len(rank.kv_heads),
    )


def make_link(
    bootstrap_address: str,
    info: bootstrap_pb2.NodeInfo,
    deliver: Callable[[RoomMessage], None],
    load: Callable[[], bootstrap_pb2.NodeLoad],
    auth: InternalAuth | None = None,
) -> NodeLink:
    return NodeLink(BootstrapClient(bootstrap_address, auth=auth), info, deliver, load)


def node_load(scheduler: Scheduler, role_queues: tuple[int, int]) -> bootstrap_pb2.NodeLoad:
    """Heartbeat payload; read from another thread without locks (plain ints, may be stale).

    `role_queues`: the role's (rooms in transfer, rooms waiting), see its `load_queues`."""
    alloc = scheduler.kv.allocator
    transfer_q, bootstrap_q = role_queues
    running, waiting = list(scheduler.running), list(scheduler.waiting)  # copies: one C call
    return bootstrap_pb2.NodeLoad(
        running_requests=len(running),
        queued_requests=len(waiting),
        running_tokens=sum(r.seq_len for r in running),
        queued_tokens=sum(len(r.prompt_ids) - r.kv_len for r in waiting),
        free_pages=alloc.num_free + alloc.num_cached,
        total_pages=alloc.total,
        max_running_requests=scheduler.config.max_running_requests,
        transfer_queue=transfer_q,
        bootstrap_queue=bootstrap_q,
    )
