"""Async client of the bootstrap service, for prefill/decode nodes and the gateway.

`BootstrapClient` wraps the RPCs; its watch_* iterators reconnect with backoff for as long as
they are iterated, so a bootstrap restart looks like a pause. Destinations and room statuses are
delivered at least once: after a reconnect the bootstrap replays what it sent recently, so a node
may see a room it already has, or no longer holds, again (ignore it). After a reconnect
`watch_nodes` first yields a reset marker (`NodeEvent` with kind KIND_UNSPECIFIED): forget the
nodes you know, a fresh snapshot of JOINED events follows. One destination / status stream per
node id: opening a second one ends the first with ABORTED, which its iterator raises.

`NodeSession` keeps one node registered: it registers (retrying while the bootstrap is
unreachable), heartbeats its load, and registers again under the same id when a heartbeat gets
NOT_FOUND (the bootstrap restarted, or declared the node dead); rooms the bootstrap knew are gone
then, so `on_reregistered` is where the node fails its in-flight rooms locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from bootstrap.security import NODE_ID_HEADER, NODE_SECRET_HEADER, InternalAuth
from proto import bootstrap_pb2, bootstrap_pb2_grpc

logger = logging.getLogger("pdserve.bootstrap.client")

T = TypeVar("T")

# Refusals that retrying the same request cannot fix (ABORTED: another stream took this one's
# place, see `streams.Outbox`; reopening would only take it back).
_FINAL_CODES = {
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.UNAUTHENTICATED,
}


class RegistrationRefused(Exception):
    """The bootstrap refused this node (bad field, KV layout mismatch): fix the node's config."""


class BootstrapUnreachable(Exception):
    """No answer from the bootstrap within the allowed time: is `bootstrap-server` running?"""


@dataclass(frozen=True)
class RetryPolicy:
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    rpc_timeout_s: float = 5.0

    def next_backoff(self, delay: float) -> float:
        return min(max(delay * 2, self.initial_backoff_s), self.max_backoff_s)


class BootstrapClient:
    def __init__(
        self, address: str, policy: RetryPolicy | None = None, auth: InternalAuth | None = None
    ) -> None:
        self.address = address
        self.policy = policy or RetryPolicy()
        # The node credential (see `identify`); sent with every call about a node or room.
        self._identity: tuple[tuple[str, str], ...] = ()
        self._last_refusal = ""  # why the bootstrap last refused a Register we retry
        backoff_ms = int(self.policy.initial_backoff_s * 1000)
        self.channel = (auth or InternalAuth()).channel(
            address,
            options=[
                ("grpc.initial_reconnect_backoff_ms", backoff_ms),
                ("grpc.min_reconnect_backoff_ms", backoff_ms),
                ("grpc.max_reconnect_backoff_ms", int(self.policy.max_backoff_s * 1000)),
            ],
        )
        self.stub = bootstrap_pb2_grpc.BootstrapStub(self.channel)

    def identify(self, node_id: str, secret: str) -> None:
        """Call as this node from now on (the credential its RegisterResponse carried)."""
        self._identity = ((NODE_ID_HEADER, node_id), (NODE_SECRET_HEADER, secret))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> BootstrapClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def register(
        self,
        node: bootstrap_pb2.NodeInfo,
        give_up_after_s: float | None = 30.0,
        load: bootstrap_pb2.NodeLoad | None = None,
    ) -> bootstrap_pb2.RegisterResponse:
        """Register, retrying while unreachable; RegistrationRefused / BootstrapUnreachable.
        `load`: the node's load now (the JOINED event carries it)."""
        request = bootstrap_pb2.RegisterRequest(node=node, load=load)
        try:
            return await asyncio.wait_for(self._register_until_answered(request), give_up_after_s)
        except asyncio.TimeoutError:
            why = self._last_refusal or "is bootstrap-server up?"
            raise BootstrapUnreachable(
                f"bootstrap at {self.address} did not accept the registration of node "
                f"{node.node_id or '(new)'} within {give_up_after_s} s: {why}"
            ) from None

    async def _register_until_answered(
        self, request: bootstrap_pb2.RegisterRequest
    ) -> bootstrap_pb2.RegisterResponse:
        delay = 0.0
        while True:
            try:
                return await self.stub.Register(
                    request, timeout=self.policy.rpc_timeout_s, metadata=self._identity
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _FINAL_CODES:
                    raise RegistrationRefused(exc.details()) from exc
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    self._last_refusal = exc.details() or ""
                delay = self.policy.next_backoff(delay)
                # ALREADY_EXISTS: our id is still live (e.g. our previous process not yet
                # declared dead); it frees up within the heartbeat timeout.
                logger.warning(
                    "register at %s: %s %s; retrying in %.1f s",
                    self.address,
                    exc.code(),
                    exc.details() if exc.code() == grpc.StatusCode.ALREADY_EXISTS else "",
                    delay,
                )
            await asyncio.sleep(delay)

    async def deregister(self, node_id: str) -> None:
        request = bootstrap_pb2.DeregisterRequest(node_id=node_id)
        await self.stub.Deregister(
            request, timeout=self.policy.rpc_timeout_s, metadata=self._identity
        )

    async def heartbeat(self, node_id: str, load: bootstrap_pb2.NodeLoad) -> None:
        request = bootstrap_pb2.HeartbeatRequest(node_id=node_id, load=load)
        await self.stub.Heartbeat(
            request, timeout=self.policy.rpc_timeout_s, metadata=self._identity
        )

    async def list_nodes(
        self, role: bootstrap_pb2.Role = bootstrap_pb2.ROLE_UNSPECIFIED
    ) -> list[bootstrap_pb2.NodeStatus]:
        request = bootstrap_pb2.ListNodesRequest(role=role)
        response = await self.stub.ListNodes(request, timeout=self.policy.rpc_timeout_s)
        return list(response.nodes)

    async def post_destination(self, destination: bootstrap_pb2.RoomDestination) -> None:
        await self.stub.PostDestination(
            destination, timeout=self.policy.rpc_timeout_s, metadata=self._identity
        )

    async def post_room_status(self, status: bootstrap_pb2.RoomStatus) -> None:
        await self.stub.PostRoomStatus(
            status, timeout=self.policy.rpc_timeout_s, metadata=self._identity
        )

    async def fail_room(self, room: int, node_id: str, reason: str) -> bool:
        """Give a room up; True when D may free its pages at once (P never got them)."""
        request = bootstrap_pb2.FailRoomRequest(room=room, node_id=node_id, reason=reason)
        response = await self.stub.FailRoom(
            request, timeout=self.policy.rpc_timeout_s, metadata=self._identity
        )
        return response.safe_to_free

    def watch_nodes(self) -> AsyncIterator[bootstrap_pb2.NodeEvent]:
        reset = bootstrap_pb2.NodeEvent(kind=bootstrap_pb2.NodeEvent.KIND_UNSPECIFIED)
        return self._reconnecting(
            "WatchNodes", lambda: self.stub.WatchNodes(bootstrap_pb2.WatchNodesRequest()), reset
        )

    def watch_destinations(
        self, prefill_node_id: str
    ) -> AsyncIterator[bootstrap_pb2.RoomDestination]:
        request = bootstrap_pb2.WatchDestinationsRequest(prefill_node_id=prefill_node_id)
        return self._reconnecting(
            f"WatchDestinations({prefill_node_id})",
            lambda: self.stub.WatchDestinations(request, metadata=self._identity),
        )

    def watch_room_status(self, decode_node_id: str) -> AsyncIterator[bootstrap_pb2.RoomStatus]:
        request = bootstrap_pb2.WatchRoomStatusRequest(decode_node_id=decode_node_id)
        return self._reconnecting(
            f"WatchRoomStatus({decode_node_id})",
            lambda: self.stub.WatchRoomStatus(request, metadata=self._identity),
        )

    async def _reconnecting(
        self, what: str, open_stream: Callable[[], Any], reset: T | None = None
    ) -> AsyncIterator[T]:
        """Yield a server stream's messages, reopening it (with backoff) whenever it ends.

        `reset`, if given, is yielded once when a stream is up again after one that broke.
        """
        backoff = 0.0
        reset_due = False
        while True:
            call = open_stream()
            was_up = False
            try:
                await call.initial_metadata()  # the server sends it as soon as the stream is up
                was_up = not call.done()
                if was_up and reset_due and reset is not None:
                    reset_due = False
                    yield reset
                async for message in call:
                    yield message
                logger.info("%s stream ended by the bootstrap; reopening", what)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _FINAL_CODES:
                    raise
                logger.warning("%s stream broke (%s); reopening", what, exc.code())
            finally:
                call.cancel()
            reset_due = reset_due or was_up
            backoff = self.policy.next_backoff(0.0 if was_up else backoff)
            await asyncio.sleep(backoff)


class NodeSession:
    """Registration and heartbeats of one node (see the module docstring)."""

    def __init__(
        self,
        client: BootstrapClient,
        node: bootstrap_pb2.NodeInfo,
        load: Callable[[], bootstrap_pb2.NodeLoad] = bootstrap_pb2.NodeLoad,
        on_reregistered: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.client = client
        self.node = bootstrap_pb2.NodeInfo()
        self.node.CopyFrom(node)
        self.load = load
        self.on_reregistered = on_reregistered
        self.heartbeat_interval_s = 1.0
        self.heartbeat_timeout_s = 5.0
        self.registrations = 0
        # Send time of the last heartbeat (or registration) bootstrap acknowledged: bootstrap
        # saw us alive no earlier than this.
        self.last_ack = 0.0
        self.draining = False  # sent with every heartbeat from `drain` on
        self._heartbeats: asyncio.Task[None] | None = None

    @property
    def node_id(self) -> str:
        return self.node.node_id

    async def start(self, give_up_after_s: float | None = 30.0) -> str:
        """Register (raises RegistrationRefused / BootstrapUnreachable) and start heartbeating."""
        await self._register(give_up_after_s)
        self._heartbeats = asyncio.create_task(self._heartbeat_loop(), name="bootstrap-heartbeat")
        self._heartbeats.add_done_callback(self._report_crash)
        return self.node_id

    def _report_crash(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "heartbeats of node %s stopped: %r; the bootstrap will declare it dead",
                self.node_id,
                task.exception(),
            )

    async def stop(self, deregister: bool = True) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeats
            self._heartbeats = None
        if deregister and self.node_id:
            try:
                await self.client.deregister(self.node_id)
            except grpc.aio.AioRpcError as exc:
                logger.warning("deregister of node %s failed: %s", self.node_id, exc.code())

    async def _register(self, give_up_after_s: float | None) -> None:
        sent = time.monotonic()
        response = await self.client.register(self.node, give_up_after_s, self._load())
        self.last_ack = sent
        self.heartbeat_timeout_s = response.heartbeat_timeout_s or self.heartbeat_timeout_s
        self.node.node_id = response.node_id  # re-registrations keep this id
        self.client.identify(response.node_id, response.node_secret)
        self.heartbeat_interval_s = response.heartbeat_interval_s or self.heartbeat_interval_s
        self.registrations += 1
        logger.info(
            "node %s registered with the bootstrap at %s", self.node_id, self.client.address
        )

    async def drain(self, draining: bool = True) -> None:
        """Tell the bootstrap now (and with every heartbeat) that this node is draining: the
        gateways stop sending it new requests (False: routable again, a drain given up)."""
        self.draining = draining
        try:
            await self.client.heartbeat(self.node_id, self._load())
        except grpc.aio.AioRpcError as exc:  # the next heartbeat says it again
            logger.warning("draining heartbeat of node %s failed: %s", self.node_id, exc.code())

    def _load(self) -> bootstrap_pb2.NodeLoad:
        load = self.load()
        load.draining = self.draining
        return load

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            sent = time.monotonic()
            try:
                await self.client.heartbeat(self.node_id, self._load())
                self.last_ack = sent
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    logger.warning("heartbeat of node %s failed: %s", self.node_id, exc.code())
                    continue
                logger.warning(
                    "bootstrap forgot node %s (%s): re-registering", self.node_id, exc.details()
                )
                await self._reregister()

    async def _reregister(self) -> None:
        try:
            await self._register(give_up_after_s=None)
        except RegistrationRefused as exc:
            logger.error("node %s cannot re-register: %s; retrying", self.node_id, exc)
            return
        if self.on_reregistered is not None:
            await self.on_reregistered(self.node_id)
