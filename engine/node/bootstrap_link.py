"""A node's side of bootstrap: registration, the peer table, and the room rendezvous.

`NodeLink` lives on the node's asyncio loop and implements `kvtransfer.room.RoomLink` for the
node role on the engine thread: the role's calls are scheduled onto the loop and return at
once; what bootstrap pushes (destinations for P, room statuses for D) and the answers to the
role's calls are put into the role's thread-safe inbox as typed room messages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, fields
from typing import Any

import grpc

from bootstrap.client import BootstrapClient, NodeSession
from kvtransfer.base import MemoryRegion, PeerInfo, PeerRank
from kvtransfer.room import (
    FailRoomAnswer,
    LinkReset,
    RoomDestination,
    RoomMessage,
    RoomState,
    RoomStatus,
)
from proto import bootstrap_pb2

logger = logging.getLogger("pdserve.link")

FLUSH_S = 5.0  # before deregistering: room calls still on their way get this long

# Room states on the wire and inside the node (proto's unused WAITING_FOR_DEST reads as FAILED).
_STATE_FROM_WIRE = {
    bootstrap_pb2.DONE: RoomState.DONE,
    bootstrap_pb2.FAILED: RoomState.FAILED,
    bootstrap_pb2.TRANSFERRING: RoomState.TRANSFERRING,
}
_STATE_TO_WIRE = {state: wire for wire, state in _STATE_FROM_WIRE.items()}


def peer_from_proto(info: bootstrap_pb2.NodeInfo) -> PeerInfo:
    regions = {
        r.name: MemoryRegion(r.name, r.addr, r.length, r.device or "cpu") for r in info.regions
    }
    ranks = tuple(
        PeerRank(
            r.tp_rank,
            r.transfer_endpoint,
            MemoryRegion("kv", r.kv.addr, r.kv.length, r.kv.device or "cpu"),
            range(r.kv_head_start, r.kv_head_start + r.num_kv_heads),
        )
        for r in info.tp_ranks
    )
    return PeerInfo(info.node_id, info.transfer_endpoint, regions, ranks)


def _values(msg: Any, cls: type) -> dict[str, Any]:
    """The fields of dataclass `cls`, read off the proto message `msg` of the same names."""
    return {f.name: getattr(msg, f.name) for f in fields(cls)}


def destination_from_proto(msg: bootstrap_pb2.RoomDestination) -> RoomDestination:
    return RoomDestination(**{**_values(msg, RoomDestination), "page_ids": tuple(msg.page_ids)})


def destination_to_proto(dest: RoomDestination) -> bootstrap_pb2.RoomDestination:
    return bootstrap_pb2.RoomDestination(**asdict(dest))


def status_from_proto(msg: bootstrap_pb2.RoomStatus) -> RoomStatus:
    state = _STATE_FROM_WIRE.get(msg.state, RoomState.FAILED)
    return RoomStatus(**{**_values(msg, RoomStatus), "state": state})


def status_to_proto(status: RoomStatus) -> bootstrap_pb2.RoomStatus:
    return bootstrap_pb2.RoomStatus(**{**asdict(status), "state": _STATE_TO_WIRE[status.state]})


class NodeLink:
    def __init__(
        self,
        client: BootstrapClient,
        node: bootstrap_pb2.NodeInfo,
        deliver: Callable[[RoomMessage], None],
        load: Callable[[], bootstrap_pb2.NodeLoad],
    ) -> None:
        self.client = client
        self.session = NodeSession(client, node, load, on_reregistered=self._reregistered)
        self.deliver = deliver  # into the node role's inbox; thread-safe
        self.role: int = node.role
        self._peers: dict[str, PeerInfo] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []  # the peer table's watch
        self._role_stream: asyncio.Task[None] | None = None  # P: destinations, D: statuses
        self._posts: set[concurrent.futures.Future[None]] = set()  # room calls on their way

    @property
    def node_id(self) -> str:
        return self.session.node_id

    @property
    def epoch(self) -> int:
        return self.session.registrations

    def lease_ok(self) -> bool:
        # Bootstrap saw us alive no earlier than `last_ack`; stop writing well before it can
        # declare us dead (20% margin for writes already started).
        age = time.monotonic() - self.session.last_ack
        return age < 0.8 * self.session.heartbeat_timeout_s

    async def start(self) -> str:
        self._loop = asyncio.get_running_loop()
        node_id = await self.session.start()
        self._tasks.append(asyncio.create_task(self._watch_nodes()))
        self._open_role_stream()
        return node_id

    def _open_role_stream(self) -> None:
        if self.role == bootstrap_pb2.PREFILL:
            self._role_stream = asyncio.create_task(self._watch_destinations())
        elif self.role == bootstrap_pb2.DECODE:
            self._role_stream = asyncio.create_task(self._watch_statuses())

    async def _close_role_stream(self) -> None:
        if self._role_stream is not None:
            self._role_stream.cancel()
            await asyncio.gather(self._role_stream, return_exceptions=True)
            self._role_stream = None

    async def drain(self) -> None:
        await self.session.drain()

    async def undrain(self) -> None:
        """A drain given up (a role switch that could not finish): routable again."""
        await self.session.drain(False)

    async def leave(self) -> None:
        """Deregister (a role switch): the gateways and peers drop this node, its role's room
        stream closes; `rejoin` registers it again."""
        await self.flush()
        await self._close_role_stream()
        await self.session.stop(deregister=True)

    async def rejoin(self, role: int) -> str:
        """Register again under the same node id as `role` (bootstrap_pb2.Role), and open that
        role's room stream. Retries while the bootstrap is unreachable; RegistrationRefused."""
        self.role = role
        self.session.node.role = role  # type: ignore[assignment]
        self.session.draining = False
        node_id = await self.session.start(give_up_after_s=None)
        self._open_role_stream()
        return node_id

    async def stop(self) -> None:
        await self.flush()
        await self._close_role_stream()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.session.stop(deregister=True)
        await self.client.close()

    # ---- RoomLink (called from the engine thread) ------------------------------------------
    def peer(self, node_id: str) -> PeerInfo | None:
        return self._peers.get(node_id)

    async def lookup_peer(self, node_id: str) -> PeerInfo | None:
        """The peer, asking bootstrap directly when the watched table has not seen it yet."""
        if node_id not in self._peers:
            for status in await self.client.list_nodes():
                if status.alive:
                    self._peers[status.node.node_id] = peer_from_proto(status.node)
        return self._peers.get(node_id)

    def post_destination(self, dest: RoomDestination) -> None:
        self._spawn(self._post_destination(dest))

    def post_status(self, status: RoomStatus) -> None:
        self._spawn(self._post_status(status))

    def fail_room(self, room: int, reason: str) -> None:
        self._spawn(self._fail_room(room, reason))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None, "NodeLink.start() must run first"
        posted = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._posts.add(posted)
        posted.add_done_callback(self._posts.discard)

    async def flush(self, timeout_s: float = FLUSH_S) -> None:
        """Wait (at most `timeout_s`) for the room calls the role made to reach the bootstrap:
        a prefill node's DONE posted just before it deregisters must not be lost (the room
        would fail on the decode node although its KV arrived)."""
        pending = [asyncio.wrap_future(f) for f in list(self._posts)]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)

    # ---- on the event loop -------------------------------------------------------------
    async def _post_destination(self, dest: RoomDestination) -> None:
        msg = destination_to_proto(dest)
        try:
            await self.client.post_destination(msg)
        except grpc.aio.AioRpcError as exc:
            # Bootstrap refused the room: nobody will write into these pages.
            reason = f"bootstrap refused the destination: {exc.details()}"
            self.deliver(
                RoomStatus(
                    dest.room, dest.prefill_node_id, dest.decode_node_id, RoomState.FAILED, reason
                )
            )

    async def _post_status(self, status: RoomStatus) -> None:
        msg = status_to_proto(status)
        try:
            await self.client.post_room_status(msg)
        except grpc.aio.AioRpcError as exc:
            logger.warning(
                "room %d: posting %s failed: %s", status.room, status.state.name, exc.details()
            )

    async def _fail_room(self, room: int, reason: str) -> None:
        try:
            safe = await self.client.fail_room(room, self.node_id, reason)
        except grpc.aio.AioRpcError as exc:
            logger.warning("room %d: FailRoom failed: %s", room, exc.details())
            self.deliver(FailRoomAnswer(room, safe_to_free=False, error=str(exc.details())))
            return
        self.deliver(FailRoomAnswer(room, safe_to_free=safe))

    async def _watch_nodes(self) -> None:
        async for event in self.client.watch_nodes():
            if event.kind == bootstrap_pb2.NodeEvent.KIND_UNSPECIFIED:
                self._peers.clear()
            elif event.kind == bootstrap_pb2.NodeEvent.LEFT:
                self._peers.pop(event.status.node.node_id, None)
            elif event.kind == bootstrap_pb2.NodeEvent.JOINED:
                info = event.status.node
                self._peers[info.node_id] = peer_from_proto(info)

    async def _watch_destinations(self) -> None:
        async for msg in self.client.watch_destinations(self.node_id):
            self.deliver(destination_from_proto(msg))

    async def _watch_statuses(self) -> None:
        async for msg in self.client.watch_room_status(self.node_id):
            self.deliver(status_from_proto(msg))

    async def _reregistered(self, node_id: str) -> None:
        logger.warning("node %s re-registered: rooms bootstrap knew are gone", node_id)
        self.deliver(LinkReset(self.epoch))
