"""The roles a registered node can serve, by name: a registry of role builders.

A disaggregated node process (engine/node/disagg.py) keeps its model, KV pool, prefix cache,
transfer engine and bootstrap link whatever its role; what a role adds is one PD state machine
on the engine thread: `PrefillRole` (prefill_node/prefill_role.py) or `DecodeRole`
(decode_node/decode_role.py), each made by its package's `build_role`. Those packages sit above
this one (imports run one way), so the registry names their builders by module path and imports
them on first use: both entry points, and a role switch (role_switch.py), reach every role
through it. The colocated role has no state machine: the node takes requests without a room and
prefills and decodes them itself.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.engine_loop import NodeRole
from engine.metrics import NodeMetrics
from engine.model_runner import ModelRunner
from engine.node.bootstrap_link import NodeLink
from engine.node.transfer_setup import TransferSetup
from kvtransfer.room import RoomMessage
from proto import bootstrap_pb2


class PDRole(NodeRole, Protocol):
    def deliver(self, message: RoomMessage) -> None:
        """From the bootstrap link's thread: a room message for the engine thread."""
        ...

    def load_queues(self) -> tuple[int, int]:
        """(rooms in transfer, rooms waiting) for the heartbeat's load, from any thread."""
        ...


@dataclass(frozen=True)
class RoleParts:
    """What a node's role is built from (the same for every role the node serves)."""

    args: argparse.Namespace  # the node's flags (the role's timeouts among them)
    link: NodeLink
    transfer: TransferSetup
    runner: ModelRunner
    metrics: NodeMetrics  # the node's; `prefill_role()` / `decode_role()` add a role's own


RoleFactory = Callable[[RoleParts], PDRole]


@dataclass(frozen=True)
class RoleKind:
    name: str  # "prefill" | "decode" | "colocated": the flag, the metric label, Health.role
    wire: int  # bootstrap_pb2.Role it registers as
    builder: str  # "module:function" making its PDRole from RoleParts; "" for none

    def build(self, parts: RoleParts) -> PDRole | None:
        """The role's state machine, fresh (None: colocated, no PD queues)."""
        if not self.builder:
            return None
        module, function = self.builder.split(":")
        factory: RoleFactory = getattr(importlib.import_module(module), function)
        return factory(parts)


ROLE_KINDS: dict[str, RoleKind] = {
    "prefill": RoleKind("prefill", bootstrap_pb2.PREFILL, "prefill_node.server:build_role"),
    "decode": RoleKind("decode", bootstrap_pb2.DECODE, "decode_node.server:build_role"),
    "colocated": RoleKind("colocated", bootstrap_pb2.COLOCATED, ""),
}


def role_kind(name: str) -> RoleKind:
    kind = ROLE_KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown role {name!r}: use one of {', '.join(ROLE_KINDS)}")
    return kind


@dataclass
class ServedRole:
    """The role the node serves now; the bootstrap link's callbacks read it here, so a switch
    changes it in one place."""

    kind: RoleKind
    role: PDRole | None = None

    def deliver(self, message: RoomMessage) -> None:
        if self.role is not None:  # colocated: no rooms (its link watches no room stream)
            self.role.deliver(message)

    def load_queues(self) -> tuple[int, int]:
        return self.role.load_queues() if self.role is not None else (0, 0)
