"""KV transfer from every tensor-parallel rank of a node.

Each rank registers its own KV shard with its own transfer engine (a rank's memory is not
addressable from another process). Rank 0 (which runs the scheduler and the node role) holds a
`TPTransferEngine`: its own writes go straight to its local engine; the other ranks' writes are
broadcast to them as typed messages (engine/tp/messages.py) and tracked under one `TPHandle`,
whose state all ranks agree on by a MIN-reduction (FAILED < PENDING < DONE: a write is only as
far along as its slowest rank). `RankTransferAgent` is the other ranks' side.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch

from engine.model_runner import ModelRunner
from engine.tp import messages
from engine.tp.group import TPGroup
from engine.tp.messages import MessageKind
from kvtransfer import base, create_engine
from kvtransfer.head_routes import WritePlan

logger = logging.getLogger("pdserve.kvtransfer")

_ORDER = {base.TransferState.FAILED: 0, base.TransferState.PENDING: 1, base.TransferState.DONE: 2}
_BY_ORDER = {v: k for k, v in _ORDER.items()}


@dataclass(frozen=True)
class RankTransferInfo:
    """One rank's KV shard as its engine registered it (gathered on rank 0 for bootstrap)."""

    tp_rank: int
    endpoint: bytes
    kv: base.MemoryRegion
    kv_heads: range

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "tp_rank": self.tp_rank,
                "endpoint": self.endpoint.hex(),
                "kv": asdict(self.kv),
                "kv_heads": [self.kv_heads.start, self.kv_heads.stop],
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RankTransferInfo:
        raw = json.loads(data)
        return cls(
            raw["tp_rank"],
            bytes.fromhex(raw["endpoint"]),
            base.MemoryRegion(**raw["kv"]),
            range(*raw["kv_heads"]),
        )


def kv_region(runner: ModelRunner) -> base.MemoryRegion:
    buffer = runner.kv_cache.storage  # the pool and its staging pages
    device = "cpu" if buffer.device.type == "cpu" else f"cuda:{buffer.device.index or 0}"
    return base.MemoryRegion(
        "kv", buffer.data_ptr(), buffer.numel() * buffer.element_size(), device
    )


def rank_info(runner: ModelRunner, engine: base.KVTransferEngine) -> RankTransferInfo:
    return RankTransferInfo(
        runner.group.rank,
        engine.local_endpoint(),
        kv_region(runner),
        runner.shard.kv_heads,
    )


def rank_engine(config: base.TransferConfig, tp_rank: int) -> base.KVTransferEngine:
    """Each rank's engine needs its own name (NIXL agent names are unique)."""
    return create_engine(replace(config, node_name=f"{config.node_name}-tp{tp_rank}"))


class TPHandle(base.TransferHandle):
    def __init__(self, handle_id: int) -> None:
        self.handle_id = handle_id


class TPTransferEngine(base.KVTransferEngine):
    """Rank 0's engine over the whole node (see the module docstring)."""

    name = "tp"
    cheap_poll = False  # a poll of the other ranks' writes is a collective over the node

    def __init__(self, local: base.KVTransferEngine, group: TPGroup) -> None:
        super().__init__(local.config)
        self.local = local
        self.group = group
        self._ids = itertools.count(1)
        self._connected: dict[str, bytes] = {}  # peer id -> endpoint every rank connected to

    def start_ranks(self) -> None:
        """Have every other rank create its engine and register its KV shard (each then
        sends its `RankTransferInfo` to `all_gather_bytes`)."""
        config = json.dumps(asdict(self.config)).encode()
        messages.send(self.group, MessageKind.TRANSFER_SETUP, [messages.bytes_to_array(config)])

    def register(self, regions: Sequence[base.MemoryRegion]) -> None:
        self.local.register(regions)

    def local_endpoint(self) -> bytes:
        return self.local.local_endpoint()

    def connect(self, peer: base.PeerInfo) -> None:
        """Connect every rank to `peer` (one rank of the peer node); once per endpoint."""
        if self._connected.get(peer.node_id) == peer.endpoint:
            return
        self.local.connect(peer)
        messages.send(self.group, MessageKind.TRANSFER_CONNECT, _encode_peer(peer))
        if self.group.min_int(1) == 0:
            raise base.TransferError(
                f"a tensor-parallel rank of this node cannot reach {peer.node_id}"
            )
        self._connected[peer.node_id] = peer.endpoint

    def write(self, peer_id: str, ranges: Sequence[base.TransferRange]) -> base.TransferHandle:
        return self.local.write(peer_id, ranges)

    def write_remote(self, plan: WritePlan) -> TPHandle:
        """Start the other ranks' part of `plan` (rank 0's part is the caller's)."""
        handle = TPHandle(next(self._ids))
        payload = _encode_plan(handle.handle_id, {r: p for r, p in plan.items() if r != 0})
        messages.send(self.group, MessageKind.TRANSFER_WRITE, [payload])
        return handle

    def poll(self, handle: base.TransferHandle) -> base.TransferState:
        if not isinstance(handle, TPHandle):
            return self.local.poll(handle)
        ids = torch.tensor([handle.handle_id], dtype=torch.int64)
        messages.send(self.group, MessageKind.TRANSFER_POLL, [ids])
        return _BY_ORDER[self.group.min_int(_ORDER[base.TransferState.DONE])]

    def release(self, handle: base.TransferHandle) -> None:
        if not isinstance(handle, TPHandle):
            self.local.release(handle)
            return
        ids = torch.tensor([handle.handle_id], dtype=torch.int64)
        messages.send(self.group, MessageKind.TRANSFER_RELEASE, [ids])

    def close(self) -> None:
        self.local.close()  # the other ranks close theirs when the node stops them


def setup_tp_transfer(
    config: base.TransferConfig, runner: ModelRunner, aux: base.MemoryRegion
) -> tuple[TPTransferEngine, list[RankTransferInfo]]:
    """Rank 0: every rank's engine with its KV shard registered (rank 0 also the aux slots)."""
    local = rank_engine(config, 0)
    local.register([kv_region(runner), aux])
    engine = TPTransferEngine(local, runner.group)
    engine.start_ranks()
    gathered = runner.group.all_gather_bytes(rank_info(runner, local).to_bytes())
    return engine, [RankTransferInfo.from_bytes(b) for b in gathered]


class RankTransferAgent:
    """A rank other than 0: runs rank 0's transfer messages on its own engine."""

    KINDS = frozenset(
        {
            MessageKind.TRANSFER_SETUP,
            MessageKind.TRANSFER_CONNECT,
            MessageKind.TRANSFER_WRITE,
            MessageKind.TRANSFER_POLL,
            MessageKind.TRANSFER_RELEASE,
        }
    )

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.group = runner.group
        self.engine: base.KVTransferEngine | None = None
        self._handles: dict[int, list[base.TransferHandle]] = {}
        self._failed: set[int] = set()

    def handle(self, kind: MessageKind, arrays: list[torch.Tensor]) -> None:
        if kind is MessageKind.TRANSFER_SETUP:
            self._setup(base.TransferConfig(**json.loads(messages.array_to_bytes(arrays[0]))))
        elif kind is MessageKind.TRANSFER_CONNECT:
            self.group.min_int(self._connect(_decode_peer(arrays)))
        elif kind is MessageKind.TRANSFER_WRITE:
            self._write(*_decode_plan(arrays[0], self.group.rank))
        elif kind is MessageKind.TRANSFER_POLL:
            self.group.min_int(_ORDER[self._poll(int(arrays[0][0]))])
        elif kind is MessageKind.TRANSFER_RELEASE:
            self._handles.pop(int(arrays[0][0]), None)
            self._failed.discard(int(arrays[0][0]))

    def _setup(self, config: base.TransferConfig) -> None:
        engine = rank_engine(config, self.group.rank)
        engine.register([kv_region(self.runner)])
        self.engine = engine
        self.group.all_gather_bytes(rank_info(self.runner, engine).to_bytes())

    def _connect(self, peer: base.PeerInfo) -> int:
        assert self.engine is not None, "TRANSFER_SETUP comes first"
        try:
            self.engine.connect(peer)
        except base.TransferError as exc:
            logger.error("tp rank %d cannot reach %s: %s", self.group.rank, peer.node_id, exc)
            return 0
        return 1

    def _write(self, handle_id: int, writes: dict[str, list[base.TransferRange]]) -> None:
        assert self.engine is not None, "TRANSFER_SETUP comes first"
        if self.runner.device.type == "cuda":
            # This rank's KV wait: rank 0 synchronized its own GPU before sending the plan, but
            # this rank's kernels of the step may still be queued (the transfer engines copy on
            # streams of their own).
            torch.cuda.synchronize(self.runner.device)
        handles = self._handles.setdefault(handle_id, [])
        for peer_id, ranges in writes.items():
            try:
                handles.append(self.engine.write(peer_id, ranges))
            except base.TransferError as exc:
                logger.error("tp rank %d: KV write failed: %s", self.group.rank, exc)
                self._failed.add(handle_id)

    def _poll(self, handle_id: int) -> base.TransferState:
        assert self.engine is not None or handle_id not in self._handles
        pending = []
        for handle in self._handles.get(handle_id, []):
            assert self.engine is not None
            state = self.engine.poll(handle)
            if state is base.TransferState.PENDING:
                pending.append(handle)
                continue
            if state is base.TransferState.FAILED:
                self._failed.add(handle_id)
            self.engine.release(handle)
        self._handles[handle_id] = pending
        if pending:
            return base.TransferState.PENDING
        return base.TransferState.FAILED if handle_id in self._failed else base.TransferState.DONE

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


# ---- wire format (int64 arrays; strings as bytes) --------------------------------------------
def _encode_peer(peer: base.PeerInfo) -> list[torch.Tensor]:
    kv = peer.regions["kv"]
    return [
        messages.bytes_to_array(peer.node_id.encode()),
        messages.bytes_to_array(peer.endpoint),
        torch.tensor([kv.addr, kv.length], dtype=torch.int64),
        messages.bytes_to_array(kv.device.encode()),
    ]


def _decode_peer(arrays: list[torch.Tensor]) -> base.PeerInfo:
    node_id, endpoint, kv, device = arrays
    region = base.MemoryRegion(
        "kv", int(kv[0]), int(kv[1]), messages.array_to_bytes(device).decode()
    )
    return base.PeerInfo(
        messages.array_to_bytes(node_id).decode(), messages.array_to_bytes(endpoint), {"kv": region}
    )


def _encode_plan(handle_id: int, plan: WritePlan) -> torch.Tensor:
    """[id, groups, then per group: rank, peer id length, ranges, peer id bytes, ranges...]"""
    out = [handle_id, sum(len(by_peer) for by_peer in plan.values())]
    for rank, by_peer in plan.items():
        for peer_id, ranges in by_peer.items():
            name = peer_id.encode()
            out += [rank, len(name), len(ranges), *name]
            for r in ranges:
                out += [r.src_addr, r.dst_addr, r.length]
    return torch.tensor(out, dtype=torch.int64)


def _decode_plan(
    payload: torch.Tensor, my_rank: int
) -> tuple[int, dict[str, list[base.TransferRange]]]:
    values = payload.tolist()
    handle_id, groups, pos = values[0], values[1], 2
    mine: dict[str, list[base.TransferRange]] = {}
    for _ in range(groups):
        rank, name_len, count = values[pos : pos + 3]
        pos += 3
        peer_id = bytes(values[pos : pos + name_len]).decode()
        pos += name_len
        flat = values[pos : pos + 3 * count]
        pos += 3 * count
        if rank == my_rank:
            mine.setdefault(peer_id, []).extend(
                base.TransferRange(*flat[i : i + 3]) for i in range(0, len(flat), 3)
            )
    return handle_id, mine
