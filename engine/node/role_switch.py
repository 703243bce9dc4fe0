"""Switching a registered node's role without a restart (`SwitchRole`, proto/node.proto).

The node keeps its weights, its KV pool with the prefix cache in it (cached pages are KV of
token prefixes, valid in any role), its transfer engine with its registered memory, its gRPC
server and its node id. In order:

1. build the new role's state machine (roles.py): a role that cannot be built leaves the node
   serving as it was;
2. drain the old role exactly as SIGTERM does (`drain` in server.py): refuse new requests, tell
   the bootstrap (the gateways stop routing here), give in-flight requests the drain timeout,
   abort the rest (the gateway moves streams that already started to another node);
3. wait, up to `SETTLE_S`, until the old role holds no room (a prefill node's last writes
   settling, a decode node's quarantined pages) and the scheduler no request; if some remain the
   switch is given up: the node serves its old role again and says so;
4. deregister (the gateways and peers see the node leave; its role's room stream closes), put
   the new role in the engine loop (`EngineLoop.replace_role`, refused if a request slipped in,
   in which case the node registers again in its old role), register again under the same node
   id as the new role and open that role's room stream: the gateways see it join in its new
   role and route by it;
5. stop draining; count the switch (`pdserve_node_role_switches_total{from,to}`, and
   `pdserve_node_info{role}` names the role served now).

One switch at a time; none while the node shuts down. A tensor-parallel node refuses: its
other ranks' transfer agents were not tested across a switch.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from bootstrap.client import RegistrationRefused
from engine.engine_loop import EngineLoop, RoleBusy
from engine.metrics import NodeMetrics
from engine.node.bootstrap_link import NodeLink
from engine.node.multiplex import RequestError
from engine.node.roles import RoleKind, RoleParts, ServedRole, role_kind
from engine.node.server import drain
from engine.node.service import NodeService
from proto import node_pb2

logger = logging.getLogger("pdserve.node")

SETTLE_S = 30.0  # after the drain, rooms still held get this long to end
_POLL_S = 0.05


@dataclass
class RoleSwitcher:
    served: ServedRole
    parts: RoleParts
    engine: EngineLoop
    service: NodeService
    link: NodeLink
    metrics: NodeMetrics
    drain_timeout_s: float  # the node's --drain-timeout, unless the request gives one
    settle_s: float = SETTLE_S
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def switch(
        self, role: str, drain_timeout_s: float | None = None
    ) -> node_pb2.SwitchRoleResponse:
        """Serve `role` from now on (see the module docstring); RequestError says why not."""
        kind = self._check(role, drain_timeout_s)
        old = self.served.kind
        if kind is old:
            return self._answer(old, switched=False)
        async with self._lock:
            loop = asyncio.get_running_loop()
            started = loop.time()
            new_role = kind.build(self.parts)
            timeout = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
            why = f"switching from the {old.name} to the {kind.name} role"
            aborted = await drain(self.service, timeout, self.link.drain, why)
            if not await self._settled(loop.time() + self.settle_s):
                await self._resume()
                raise RequestError(
                    grpc.StatusCode.ABORTED,
                    f"the {old.name} role still held requests or rooms {self.settle_s:.0f} s "
                    f"after its drain (KV writes settling, quarantined pages): the node serves "
                    f"as {old.name} again; retry the switch later",
                )
            await self.link.leave()
            try:
                await asyncio.wrap_future(self.engine.replace_role(new_role))
            except RoleBusy as exc:  # a request accepted just as the drain began
                await self.link.rejoin(old.wire)
                await self._resume()
                raise RequestError(
                    grpc.StatusCode.ABORTED,
                    f"{exc}; the node serves as {old.name} again: retry the switch",
                ) from exc
            self.served.kind, self.served.role = kind, new_role
            self.service.role = kind.name
            await self._rejoin(kind)
            self.service.stop_draining()
            self.metrics.switched_role(kind.name)
            seconds = loop.time() - started
            logger.info(
                "switched from the %s to the %s role in %.2f s (%d requests aborted); "
                "registered as %s node %s",
                *(old.name, kind.name, seconds, aborted, kind.name, self.link.node_id),
            )
            return self._answer(old, switched=True, aborted=aborted, seconds=seconds)

    def _check(self, role: str, drain_timeout_s: float | None) -> RoleKind:
        try:
            kind = role_kind(role)
        except ValueError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        if drain_timeout_s is not None and drain_timeout_s < 0:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"drain_timeout_s must be >= 0 seconds, got {drain_timeout_s}",
            )
        if self._lock.locked():
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "a role switch is already under way on this node: wait for it to end",
            )
        if self.service.draining:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this node is draining ({self.service.drain_reason}): it cannot switch roles",
            )
        if self.parts.runner.group.size > 1:
            raise RequestError(
                grpc.StatusCode.UNIMPLEMENTED,
                "a tensor-parallel node (--tp-size > 1) cannot switch roles yet: start a node "
                f"in the {kind.name} role instead",
            )
        return kind

    async def _settled(self, deadline: float) -> bool:
        """True once the engine holds no request and the role no room; False at `deadline`."""
        loop = asyncio.get_running_loop()
        while True:
            busy = await asyncio.wrap_future(
                self.engine.call(lambda s: self.engine.holds_requests())
            )
            if not busy:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)

    async def _resume(self) -> None:
        """A switch given up: routable again in the old role."""
        self.service.stop_draining()
        await self.link.undrain()

    async def _rejoin(self, kind: RoleKind) -> None:
        try:
            await self.link.rejoin(kind.wire)
        except RegistrationRefused as exc:
            logger.error("registering as %s was refused: %s", kind.name, exc)
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the bootstrap refused this node as {kind.name}: {exc}; it is registered "
                "nowhere now: restart it",
            ) from exc

    def _answer(
        self, old: RoleKind, switched: bool, aborted: int = 0, seconds: float = 0.0
    ) -> node_pb2.SwitchRoleResponse:
        return node_pb2.SwitchRoleResponse(
            from_role=old.name,
            role=self.served.kind.name,
            node_id=self.link.node_id,
            switched=switched,
            aborted=aborted,
            seconds=seconds,
        )
