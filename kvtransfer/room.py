"""Typed room messages exchanged (through bootstrap) between a prefill and a decode node.

These are the node's one type per message; the wire types are in `proto/bootstrap.proto`, and
`engine/node/bootstrap_link.py` converts between the two at the node's edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from kvtransfer.base import PeerInfo


class RoomState(Enum):
    """What a prefill node reports about a room (and D hears back)."""

    TRANSFERRING = "transferring"  # the first pages are out: D restarts its transfer timer
    DONE = "done"  # every write landed; the first token is in D's aux slot
    FAILED = "failed"  # nothing more will be written (with `may_still_write`: it might)


@dataclass(frozen=True)
class RoomDestination:
    """Where P must write the KV of one request: D's pages and aux slot."""

    room: int
    decode_node_id: str
    prefill_node_id: str
    page_ids: tuple[int, ...]  # D pages for prompt tokens [cached_tokens, prompt_len)
    cached_tokens: int  # prompt tokens D already holds (page-aligned): not sent
    aux_slot: int
    prompt_len: int
    cancelled: bool = False
    ticket: str = ""  # the gateway's room ticket (bootstrap/security.py, RoomTickets)


@dataclass(frozen=True)
class RoomStatus:
    room: int
    prefill_node_id: str
    decode_node_id: str
    state: RoomState
    reason: str = ""
    may_still_write: bool = False  # FAILED while P may still be writing: keep the pages


@dataclass(frozen=True)
class FailRoomAnswer:
    """Bootstrap's answer to a FailRoom: may D free the room's pages now?"""

    room: int
    safe_to_free: bool
    error: str = ""


@dataclass(frozen=True)
class LinkReset:
    """The node registered again under its id (bootstrap restarted and forgot it, or declared
    it dead): rooms posted before registration number `epoch` are unknown to bootstrap now, so
    no status about them will ever come."""

    epoch: int


# bootstrap -> node role inbox
RoomMessage = RoomDestination | RoomStatus | FailRoomAnswer | LinkReset


class RoomLink(Protocol):
    """What a node role needs from bootstrap; calls return at once (the link sends them on
    its own event loop). Answers and pushed events come back through the role's inbox."""

    @property
    def node_id(self) -> str: ...

    def post_destination(self, dest: RoomDestination) -> None: ...

    def post_status(self, status: RoomStatus) -> None: ...

    def fail_room(self, room: int, reason: str) -> None: ...

    def peer(self, node_id: str) -> PeerInfo | None: ...

    @property
    def epoch(self) -> int:
        """Registrations so far: rooms of an older epoch were failed by bootstrap."""
        ...

    def lease_ok(self) -> bool:
        """True while bootstrap cannot have declared this node dead (writes are safe)."""
        ...
