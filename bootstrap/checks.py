"""Refusals of the bootstrap's room and identity checks, apart from the servicer that calls them.

`check_destination` decides whether a decode node may open a room as posted; `verify_caller`
proves (with `--internal-token`'s node credentials) that a call comes from the node it names.
Both raise a `BootstrapError`, which the servicer turns into the gRPC status it names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bootstrap.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from bootstrap.registry import NodeRegistry
from bootstrap.security import NODE_ID_HEADER, NODE_SECRET_HEADER, RoomTickets, metadata_value
from proto import bootstrap_pb2


def check_destination(
    dest: bootstrap_pb2.RoomDestination, registry: NodeRegistry, tickets: RoomTickets | None
) -> None:
    """Raise unless `dest` names a room its decode node may open towards a live prefill node."""
    if dest.room == 0:
        raise InvalidArgument("room 0 is not a valid room number: use a nonzero id")
    if dest.cancelled:
        raise InvalidArgument(
            f"room {dest.room}: `cancelled` is set by the bootstrap only; use FailRoom"
        )
    for name in ("decode_node_id", "prefill_node_id"):
        if not getattr(dest, name):
            raise InvalidArgument(f"room {dest.room}: {name} is required")
    decode = registry.require(dest.decode_node_id)
    if decode.role != bootstrap_pb2.DECODE:
        raise FailedPrecondition(
            f"room {dest.room}: {decode.label} cannot post destinations; only decode nodes do"
        )
    if tickets is not None and not tickets.valid(
        dest.ticket, dest.room, dest.prefill_node_id, dest.decode_node_id
    ):
        raise PermissionDenied(
            f"room {dest.room}: {'no' if not dest.ticket else 'a wrong'} room ticket for "
            f"decode node {dest.decode_node_id} and prefill node {dest.prefill_node_id}: "
            "only the decode node the gateway assigned the room to may open it (the gateway "
            "and the bootstrap share --room-key-file)"
        )
    prefill = registry.get(dest.prefill_node_id)
    if prefill is None:
        raise FailedPrecondition(
            f"room {dest.room}: prefill node {dest.prefill_node_id} is not registered "
            f"(dead, left or never joined): pick a live prefill node"
        )
    if prefill.role != bootstrap_pb2.PREFILL:
        raise FailedPrecondition(f"room {dest.room}: {prefill.label} is not a prefill node")


def verify_caller(
    metadata: Sequence[Any] | None, registry: NodeRegistry, node_id: str, what: str
) -> None:
    """The call (its gRPC `metadata`) must carry `node_id`'s own credential.

    The rooms' own checks compare the node ids the messages name; this proves the caller is
    the node it names, so a node cannot post, fail or watch as another one.
    """
    if registry.get(node_id) is None:  # e.g. the bootstrap restarted: retry later
        named = node_id or "(none named)"
        raise NotFound(f"{what}: node {named} is not registered: register first")
    caller = metadata_value(metadata, NODE_ID_HEADER)
    record = registry.get(caller) if caller else None
    proven = record is not None and record.holds(metadata_value(metadata, NODE_SECRET_HEADER))
    if proven and caller == node_id:
        return
    who = (
        f"node {caller}" if proven
        else f"a caller without node {caller or '?'}'s credential (x-pdserve-node-secret)"
    )  # fmt: skip
    raise PermissionDenied(
        f"{what}: only node {node_id or '(none named)'} may do this, and this call comes "
        f"from {who}; each node calls with the credential its Register returned"
    )
