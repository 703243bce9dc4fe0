"""The Bootstrap gRPC servicer (`proto/bootstrap.proto`) over the registry and the room table.

Everything runs on the one grpc.aio event loop, so the state needs no locks: each handler reads
and changes it without awaiting in between, and awaits only to write to a stream. A sweeper task
declares silent nodes dead and expires old rooms. A node that dies, deregisters or re-registers
under a live id (it restarted) has its rooms failed towards the other side; see `rooms.py`.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import grpc

from bootstrap.checks import check_destination, verify_caller
from bootstrap.errors import BootstrapError, InvalidArgument
from bootstrap.metrics import BootstrapMetrics
from bootstrap.registry import NodeRecord, NodeRegistry
from bootstrap.rooms import RoomPhase, RoomTable
from bootstrap.security import NODE_ID_HEADER, NODE_SECRET_HEADER, RoomTickets, metadata_value
from bootstrap.streams import Broadcast, Outbox
from bootstrap.telemetry import current_room
from proto import bootstrap_pb2, bootstrap_pb2_grpc

logger = logging.getLogger("pdserve.bootstrap")

NodeEvent = bootstrap_pb2.NodeEvent
T = TypeVar("T")
Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


@dataclass(frozen=True)
class BootstrapConfig:
    heartbeat_timeout_s: float = 5.0  # silent this long -> dead
    heartbeat_interval_s: float = 1.0  # told to nodes in RegisterResponse
    room_ttl_s: float = 600.0
    watch_backlog: int = 10_000  # node events a WatchNodes client may fall behind by
    # Check that a node's calls come from that node (its RegisterResponse.node_secret): only
    # the room's decode node posts its destination, only its prefill node its status, and a
    # node heartbeats, deregisters and watches only as itself. On with an internal token.
    verify_node_identity: bool = False
    # With a room key (--room-key-file): a destination must carry the gateway's ticket for
    # (room, prefill node, decode node), so only the decode node the room was assigned to opens it.
    tickets: RoomTickets | None = None

    @property
    def sweep_interval_s(self) -> float:
        return min(max(min(self.heartbeat_timeout_s, self.room_ttl_s) / 5, 0.05), 1.0)


def _refusals_to_status(handler: Handler) -> Handler:
    """A `BootstrapError` from the state becomes the gRPC status it names, with its message.

    The metrics' gauges are refreshed after the handler, whatever it changed.
    """

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except BootstrapError as exc:
            logger.warning("%s refused (%s): %s", handler.__name__, exc.code.name, exc)
            await context.abort(exc.code, str(exc))
        finally:
            self.metrics.refresh(self.registry, self.rooms)

    return cast(Handler, wrapper)


class BootstrapService(bootstrap_pb2_grpc.BootstrapServicer):
    def __init__(
        self,
        config: BootstrapConfig,
        clock: Callable[[], float] = time.monotonic,
        metrics: BootstrapMetrics | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics or BootstrapMetrics()
        self.registry = NodeRegistry()
        self.rooms = RoomTable(replay_window_s=config.heartbeat_timeout_s)
        self.node_events: Broadcast[bootstrap_pb2.NodeEvent] = Broadcast(config.watch_backlog)
        # Open WatchDestinations streams per prefill node: while one is up, the node's process
        # is alive (a frozen process keeps its TCP connections), so it may still write KV.
        self.destination_streams: collections.Counter[str] = collections.Counter()

    def _process_gone(self, node_id: str) -> bool:
        return self.destination_streams[node_id] == 0

    # ---- nodes -------------------------------------------------------------------------------

    @_refusals_to_status
    async def Register(self, request: bootstrap_pb2.RegisterRequest, context: Any) -> Any:
        # The secret of a live registration under this id, if the caller holds one: it is
        # that node registering again (the registry refuses the id to anyone else).
        metadata = context.invocation_metadata()
        caller = metadata_value(metadata, NODE_ID_HEADER)
        secret = (
            metadata_value(metadata, NODE_SECRET_HEADER) if caller == request.node.node_id else ""
        )
        load = request.load if request.HasField("load") else None
        record, replaced = self.registry.register(request.node, self.clock(), secret, load)
        if replaced:
            failed = self.rooms.fail_node(
                record.node_id,
                f"{record.label} re-registered (restarted): its open rooms are lost",
                process_gone=self._process_gone(record.node_id),
            )
            logger.warning("%s re-registered; %d open rooms failed", record.label, len(failed))
        logger.info("%s registered at %s", record.label, record.info.grpc_address)
        self.node_events.publish(NodeEvent(kind=NodeEvent.JOINED, status=record.status()))
        return bootstrap_pb2.RegisterResponse(
            node_id=record.node_id,
            node_secret=record.secret,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            heartbeat_timeout_s=self.config.heartbeat_timeout_s,
        )

    @_refusals_to_status
    async def Deregister(self, request: bootstrap_pb2.DeregisterRequest, context: Any) -> Any:
        record = self.registry.get(request.node_id)
        if record is None:
            logger.info("deregister of unknown node %s: nothing to do", request.node_id)
        else:
            self._verify_caller(context, request.node_id, f"Deregister of {record.label}")
            self._remove_node(record, f"{record.label} deregistered (left)")
        return bootstrap_pb2.DeregisterResponse()

    @_refusals_to_status
    async def Heartbeat(self, request: bootstrap_pb2.HeartbeatRequest, context: Any) -> Any:
        self.metrics.heartbeats.inc()
        self.registry.require(request.node_id)  # NOT_FOUND first: the node re-registers
        self._verify_caller(context, request.node_id, f"Heartbeat of node {request.node_id}")
        was_draining = self.registry.require(request.node_id).load.draining
        if self.registry.heartbeat(request.node_id, request.load, self.clock()):
            status = self.registry.require(request.node_id).status()
            if request.load.draining and not was_draining:
                logger.info("%s is draining: gateways stop routing to it", status.node.node_id)
            self.node_events.publish(NodeEvent(kind=NodeEvent.LOAD, status=status))
        return bootstrap_pb2.HeartbeatResponse()

    async def ListNodes(self, request: bootstrap_pb2.ListNodesRequest, context: Any) -> Any:
        nodes = [record.status() for record in self.registry.live(request.role)]
        return bootstrap_pb2.ListNodesResponse(nodes=nodes)

    async def WatchNodes(self, request: bootstrap_pb2.WatchNodesRequest, context: Any) -> None:
        watcher = self.node_events.subscribe()
        snapshot = [record.status() for record in self.registry.live()]  # same tick: no gap
        try:
            await context.send_initial_metadata(())  # tells the client the stream is up
            for status in snapshot:
                await context.write(NodeEvent(kind=NodeEvent.JOINED, status=status))
            while (event := await watcher.queue.get()) is not None:
                await context.write(event)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"WatchNodes client fell {self.config.watch_backlog} events behind: "
                f"watch again for a fresh snapshot",
            )
        finally:
            self.node_events.unsubscribe(watcher)

    def _remove_node(self, record: NodeRecord, reason: str) -> None:
        self.registry.remove(record.node_id)
        failed = self.rooms.fail_node(
            record.node_id, reason, process_gone=self._process_gone(record.node_id)
        )
        self.metrics.node_failures.inc(len(failed))
        self.node_events.publish(NodeEvent(kind=NodeEvent.LEFT, status=record.status(alive=False)))
        logger.warning("%s removed (%s); %d open rooms failed", record.label, reason, len(failed))

    # ---- rooms -------------------------------------------------------------------------------

    @_refusals_to_status
    async def PostDestination(self, request: bootstrap_pb2.RoomDestination, context: Any) -> Any:
        current_room.set(request.room)
        self._verify_caller(
            context, request.decode_node_id, f"room {request.room}: its destination"
        )
        check_destination(request, self.registry, self.config.tickets)
        self.rooms.open(request, self.clock())
        self.metrics.rooms_opened.inc()
        return bootstrap_pb2.PostAck()

    @_refusals_to_status
    async def PostRoomStatus(self, request: bootstrap_pb2.RoomStatus, context: Any) -> Any:
        current_room.set(request.room)
        self._verify_caller(context, request.prefill_node_id, f"room {request.room}: its status")
        room = self.rooms.post_status(request)
        if room is not None and request.state in (bootstrap_pb2.DONE, bootstrap_pb2.FAILED):
            self.metrics.rooms_closed.labels(bootstrap_pb2.RoomState.Name(request.state)).inc()
        return bootstrap_pb2.PostAck()

    @_refusals_to_status
    async def FailRoom(self, request: bootstrap_pb2.FailRoomRequest, context: Any) -> Any:
        current_room.set(request.room)
        self._verify_caller(context, request.node_id, f"room {request.room}: FailRoom")
        reason = request.reason or f"node {request.node_id} gave the room up"
        safe = self.rooms.fail(request.room, request.node_id, reason)
        return bootstrap_pb2.FailRoomResponse(safe_to_free=safe)

    @_refusals_to_status
    async def WatchDestinations(
        self, request: bootstrap_pb2.WatchDestinationsRequest, context: Any
    ) -> None:
        node_id = request.prefill_node_id
        self._verify_watcher(context, node_id, "prefill_node_id", "destinations")
        outbox = self.rooms.destination_outbox(node_id)
        self.destination_streams[node_id] += 1
        try:
            await self._pump(context, node_id, "destinations", outbox, self._take_destination)
        finally:
            self.destination_streams[node_id] -= 1
            if self._process_gone(node_id):
                del self.destination_streams[node_id]
                if self.registry.get(node_id) is None:
                    self.rooms.writer_gone(node_id)

    def _take_destination(self, destination: bootstrap_pb2.RoomDestination) -> bool:
        """`RoomTable.take_destination`, timing the rendezvous (D's post -> P's stream)."""
        room = self.rooms.rooms.get(destination.room)
        queued = room is not None and room.phase is RoomPhase.QUEUED
        admitted = self.rooms.take_destination(destination)
        if queued and room is not None and room.phase is RoomPhase.DELIVERED:
            self.metrics.rendezvous.observe(self.clock() - room.opened_at)
        return admitted

    @_refusals_to_status
    async def WatchRoomStatus(
        self, request: bootstrap_pb2.WatchRoomStatusRequest, context: Any
    ) -> None:
        node_id = request.decode_node_id
        self._verify_watcher(context, node_id, "decode_node_id", "room statuses")
        outbox = self.rooms.status_outbox(node_id)
        await self._pump(context, node_id, "room statuses", outbox, lambda status: True)

    async def _pump(
        self,
        context: Any,
        node_id: str,
        what: str,
        outbox: Outbox[T],
        admit: Callable[[T], bool],
    ) -> None:
        """Write the outbox to the stream until the client leaves or a newer stream takes over."""
        token = outbox.subscribe(self.clock())
        logger.info("node %s watches its %s (%d queued)", node_id, what, len(outbox.pending))
        try:
            await context.send_initial_metadata(())  # tells the client the stream is up
            while (item := await outbox.next(token)) is not None:
                if admit(item):
                    await context.write(item)
                    outbox.written(item, self.clock())
                else:
                    outbox.skipped(item)
            await context.abort(
                grpc.StatusCode.ABORTED,
                f"a newer stream for the {what} of node {node_id} took over: "
                f"watch from one place per node id",
            )
        finally:
            outbox.unsubscribe(token)
            self.rooms.forget_outboxes(node_id)
            logger.info("node %s stopped watching its %s", node_id, what)

    def _verify_caller(self, context: Any, node_id: str, what: str) -> None:
        if self.config.verify_node_identity:
            verify_caller(context.invocation_metadata(), self.registry, node_id, what)

    def _verify_watcher(self, context: Any, node_id: str, field: str, what: str) -> None:
        """A stream of the node's `what` is opened only by the node itself."""
        if not node_id:
            raise InvalidArgument(f"{field} is required to watch {what}")
        self._verify_caller(context, node_id, f"the {what} of node {node_id}")

    # ---- sweeping ----------------------------------------------------------------------------

    def sweep(self) -> None:
        now = self.clock()
        timeout = self.config.heartbeat_timeout_s
        for record in self.registry.silent(now, timeout):
            silent_s = now - record.last_heartbeat
            self.metrics.heartbeats_missed.inc()
            self._remove_node(
                record, f"{record.label} missed heartbeats for {silent_s:.1f} s (dead)"
            )
        ttl = self.config.room_ttl_s
        self.metrics.rooms_expired.inc(
            sum(
                1
                for room in self.rooms.rooms.values()
                if now - room.opened_at > ttl and room.phase is not RoomPhase.CANCELLING
            )
        )
        self.rooms.expire(now, ttl)
        self.rooms.prune_outboxes(now)
        self.metrics.refresh(self.registry, self.rooms)

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                self.sweep()
            except Exception:  # a bug here must not stop liveness checks for good
                logger.exception("sweep failed; retrying in %g s", self.config.sweep_interval_s)
