"""The room table: one room per request handed from a prefill node (P) to a decode node (D).

Life of a room (`RoomPhase`); every transition runs on the service's event loop:

    PostDestination from D                      -> QUEUED (in P's destination outbox)
    QUEUED, P's WatchDestinations stream takes it -> DELIVERED
    QUEUED + FailRoom from D                    -> closed, safe_to_free; P never sees it
    DELIVERED + FailRoom from D                 -> CANCELLING; P gets it again with `cancelled`
    open + PostRoomStatus(TRANSFERRING) from P  -> unchanged; the progress is forwarded to D
    open + PostRoomStatus(DONE|FAILED) from P   -> closed; D gets the status
    open + FailRoom from P                      -> closed; D gets FAILED
    open + P dead, left or re-registered        -> closed; D gets FAILED naming P. If P had the
                                                   room and its process may live on (its
                                                   destination stream is still up: frozen, or
                                                   partitioned), the FAILED says
                                                   `may_still_write` and the room stays UNSETTLED
    open + D dead, left or re-registered        -> closed; P gets `cancelled` if it had the room
    QUEUED longer than the TTL                  -> closed; D gets FAILED (nobody writes)
    DELIVERED longer than the TTL               -> CANCELLING; P gets `cancelled`, D waits for
                                                   P's FAILED (P may be writing into its pages)
    CANCELLING longer than twice the TTL        -> closed; D gets FAILED with `may_still_write`
                                                   (P is stuck, not dead): UNSETTLED
    UNSETTLED + DONE|FAILED (or FailRoom) from P -> D gets FAILED without the flag: free the pages
    UNSETTLED + P's process gone                -> the same (its last destination stream closed
                                                   while it is not registered)

D frees a room's pages only on a status without `may_still_write`: a prefill node declared dead
by missed heartbeats may only be frozen, and its transfer engine finishes the writes it had
started when it wakes up, whatever its lease says by then.

A closed room is forgotten (once settled), so its number may be reused and a late post about it
gets NOT_FOUND.
Messages wait in the addressee's outbox (`streams.Outbox`) until its stream takes them.

The bootstrap only relays: a room keeps the wire messages as posted (`WireDestination`,
`WireStatus`, the proto types). Nodes turn them into their own typed messages
(`kvtransfer.room`) at their edge, `engine/node/bootstrap_link.py`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from bootstrap.errors import AlreadyExists, InvalidArgument, NotFound, PermissionDenied
from bootstrap.streams import Outbox
from proto import bootstrap_pb2
from proto.bootstrap_pb2 import RoomDestination as WireDestination
from proto.bootstrap_pb2 import RoomStatus as WireStatus

logger = logging.getLogger("pdserve.bootstrap.rooms")


class RoomPhase(enum.Enum):
    QUEUED = "queued"  # posted by D, not yet handed to P's stream
    DELIVERED = "delivered"  # P has (or may have) it: P may be writing into D's pages
    CANCELLING = "cancelling"  # D gave up after delivery; waiting for P to confirm it stopped


@dataclass
class Room:
    destination: WireDestination
    opened_at: float  # time.monotonic() of PostDestination
    phase: RoomPhase = RoomPhase.QUEUED

    @property
    def room_id(self) -> int:
        return self.destination.room

    @property
    def prefill_node_id(self) -> str:
        return self.destination.prefill_node_id

    @property
    def decode_node_id(self) -> str:
        return self.destination.decode_node_id

    @property
    def label(self) -> str:
        return (
            f"room {self.room_id} (prefill {self.prefill_node_id} -> decode {self.decode_node_id})"
        )

    def involves(self, node_id: str) -> bool:
        return node_id in (self.prefill_node_id, self.decode_node_id)

    @property
    def writing(self) -> bool:
        """P has (or may have) the destination, so it may be writing into D's pages."""
        return self.phase is not RoomPhase.QUEUED

    def status(self, state: int, reason: str, may_still_write: bool = False) -> WireStatus:
        return WireStatus(
            room=self.room_id,
            prefill_node_id=self.prefill_node_id,
            decode_node_id=self.decode_node_id,
            state=state,  # type: ignore[arg-type]
            reason=reason,
            may_still_write=may_still_write,
        )

    def cancelled_destination(self) -> WireDestination:
        cancel = WireDestination()
        cancel.CopyFrom(self.destination)
        cancel.cancelled = True
        return cancel


def state_name(state: int) -> str:
    return bootstrap_pb2.RoomState.Name(state)  # type: ignore[arg-type]


class RoomTable:
    """Open rooms and the outboxes of the nodes they involve. Pure state: the caller passes time."""

    def __init__(self, replay_window_s: float) -> None:
        self.replay_window_s = replay_window_s  # see `streams.Outbox`
        self.rooms: dict[int, Room] = {}
        self.unsettled: dict[int, Room] = {}  # closed while P may still write into D's pages
        self.destinations: dict[str, Outbox[WireDestination]] = {}  # by prefill node id
        self.statuses: dict[str, Outbox[WireStatus]] = {}  # by decode node id

    def destination_outbox(self, prefill_node_id: str) -> Outbox[WireDestination]:
        outbox = self.destinations.get(prefill_node_id)
        if outbox is None:
            outbox = self.destinations[prefill_node_id] = Outbox(self.replay_window_s)
        return outbox

    def status_outbox(self, decode_node_id: str) -> Outbox[WireStatus]:
        outbox = self.statuses.get(decode_node_id)
        if outbox is None:
            outbox = self.statuses[decode_node_id] = Outbox(self.replay_window_s)
        return outbox

    def forget_outboxes(self, node_id: str, clear: bool = False) -> None:
        """Drop a node's outboxes if idle (after `clear`, if asked: the node is gone)."""
        for outboxes in (self.destinations, self.statuses):
            outbox = outboxes.get(node_id)
            if outbox is not None and clear:
                outbox.clear()
            if outbox is not None and outbox.idle:
                del outboxes[node_id]

    def prune_outboxes(self, now: float) -> None:
        """Forget written messages past the replay window, then outboxes left idle."""
        for outboxes in (self.destinations, self.statuses):
            for node_id, outbox in list(outboxes.items()):
                outbox.prune(now)
                if outbox.idle:
                    del outboxes[node_id]

    def open(self, destination: WireDestination, now: float) -> Room:
        existing = self.rooms.get(destination.room)
        if existing is not None:
            raise AlreadyExists(
                f"{existing.label} is already open: use a new room number, or FailRoom it first"
            )
        room = Room(WireDestination(), now)
        room.destination.CopyFrom(destination)
        self.rooms[room.room_id] = room
        self.destination_outbox(room.prefill_node_id).put(room.destination)
        logger.info("%s opened: %d pages queued for P", room.label, len(destination.page_ids))
        return room

    def take_destination(self, destination: WireDestination) -> bool:
        """P's stream is about to write `destination`: False if it is stale (skip it).

        From this moment on P may be writing into D's pages, so the room counts as delivered
        even if the write is then interrupted (the item is replayed on P's next stream).
        """
        if destination.cancelled:
            return True
        room = self.rooms.get(destination.room)
        if room is None or room.destination is not destination:
            return False  # a replay for a closed room: P finished it, or its cancel follows
        if room.phase is RoomPhase.CANCELLING:
            return False  # a replay: the cancelled copy is queued behind it
        if room.phase is RoomPhase.QUEUED:
            room.phase = RoomPhase.DELIVERED
            logger.info("%s delivered to P", room.label)
        return True

    def post_status(self, status: WireStatus) -> Room | None:
        """P's status for an open room (None: it settled an UNSETTLED one)."""
        if status.room not in self.rooms and self._settle(
            status.room, status.prefill_node_id, f"prefill node reported {state_name(status.state)}"
        ):
            return None
        room = self._require(status.room)
        if status.prefill_node_id != room.prefill_node_id:
            raise PermissionDenied(
                f"{room.label}: only prefill node {room.prefill_node_id} may post its status, "
                f"not {status.prefill_node_id or '(empty prefill_node_id)'}"
            )
        if status.state == bootstrap_pb2.TRANSFERRING:
            self.status_outbox(room.decode_node_id).put(room.status(status.state, status.reason))
        elif status.state in (bootstrap_pb2.DONE, bootstrap_pb2.FAILED):
            self._close(room, status.state, status.reason, tell_decode=True, tell_prefill=False)
        else:
            raise InvalidArgument(
                f"{room.label}: state {state_name(status.state)} cannot be posted; "
                f"post TRANSFERRING, DONE or FAILED"
            )
        return room

    def fail(self, room_id: int, node_id: str, reason: str) -> bool:
        """FailRoom from one side of the room; returns safe_to_free (for D's pages)."""
        if room_id not in self.rooms and self._settle(room_id, node_id, "prefill node failed it"):
            return True
        room = self._require(room_id)
        if node_id == room.prefill_node_id:
            reason = reason or f"prefill node {node_id} failed the room"
            self._close(room, bootstrap_pb2.FAILED, reason, tell_decode=True, tell_prefill=False)
            return True
        if node_id != room.decode_node_id:
            raise PermissionDenied(
                f"{room.label}: node {node_id or '(empty node_id)'} is not in it"
            )
        if room.phase is RoomPhase.QUEUED:
            self._close(room, bootstrap_pb2.FAILED, reason, tell_decode=False, tell_prefill=False)
            return True
        if room.phase is RoomPhase.DELIVERED:
            room.phase = RoomPhase.CANCELLING
            self.destination_outbox(room.prefill_node_id).put(room.cancelled_destination())
            logger.info(
                "%s cancelling (D gave up: %s): waiting for P to confirm", room.label, reason
            )
        return False

    def fail_node(self, node_id: str, reason: str, process_gone: bool) -> list[Room]:
        """Close every room involving a node that is gone; the other side is told why.

        `process_gone`: the node's process cannot write any more (its connection closed). If
        not, the rooms it held as P stay UNSETTLED until it confirms or its connection closes.
        """
        gone = [room for room in self.rooms.values() if room.involves(node_id)]
        for room in gone:
            may_write = room.prefill_node_id == node_id and room.writing and not process_gone
            self._close(
                room,
                bootstrap_pb2.FAILED,
                reason,
                tell_decode=room.decode_node_id != node_id,
                tell_prefill=room.prefill_node_id != node_id,
                may_still_write=may_write,
            )
        self.forget_outboxes(node_id, clear=True)
        return gone

    def writer_gone(self, prefill_node_id: str) -> None:
        """The prefill node's process is gone: its UNSETTLED rooms' pages may be freed."""
        for room in [r for r in self.unsettled.values() if r.prefill_node_id == prefill_node_id]:
            self._settle(room.room_id, prefill_node_id, "its bootstrap connection closed")

    def _settle(self, room_id: int, prefill_node_id: str, how: str) -> bool:
        room = self.unsettled.get(room_id)
        if room is None or room.prefill_node_id != prefill_node_id:
            return False
        del self.unsettled[room_id]
        reason = f"prefill node {prefill_node_id} stopped writing ({how})"
        self.status_outbox(room.decode_node_id).put(room.status(bootstrap_pb2.FAILED, reason))
        logger.info("%s settled: %s", room.label, reason)
        return True

    def expire(self, now: float, ttl_s: float) -> list[Room]:
        old = [room for room in self.rooms.values() if now - room.opened_at > ttl_s]
        closed = []
        for room in old:
            reason = f"room {room.room_id} expired after {ttl_s:g} s"
            if room.phase is RoomPhase.DELIVERED:
                room.phase = RoomPhase.CANCELLING
                self.destination_outbox(room.prefill_node_id).put(room.cancelled_destination())
                logger.info("%s expired: cancelling, waiting for P to confirm", room.label)
            elif room.phase is RoomPhase.QUEUED or now - room.opened_at > 2 * ttl_s:
                self._close(
                    room,
                    bootstrap_pb2.FAILED,
                    reason,
                    tell_decode=True,
                    tell_prefill=True,
                    may_still_write=room.writing,  # P is stuck, not known dead
                )
                closed.append(room)
        for room_id, room in list(self.unsettled.items()):
            if now - room.opened_at > 4 * ttl_s:  # D's own quarantine expiry freed it long ago
                del self.unsettled[room_id]
                logger.warning("%s forgotten unsettled: P never confirmed", room.label)
        return closed

    def _require(self, room_id: int) -> Room:
        room = self.rooms.get(room_id)
        if room is None:
            raise NotFound(
                f"room {room_id} is not open (never posted, or already closed: done, failed, "
                f"expired or its node died); its final status, if any, went to WatchRoomStatus"
            )
        return room

    def _close(
        self,
        room: Room,
        state: int,
        reason: str,
        *,
        tell_decode: bool,
        tell_prefill: bool,
        may_still_write: bool = False,
    ) -> None:
        del self.rooms[room.room_id]
        if may_still_write:
            self.unsettled[room.room_id] = room
        if room.phase is RoomPhase.QUEUED:
            outbox = self.destinations.get(room.prefill_node_id)
            if outbox is not None:
                outbox.discard(lambda item: item is room.destination)
        elif tell_prefill and room.phase is RoomPhase.DELIVERED:
            self.destination_outbox(room.prefill_node_id).put(room.cancelled_destination())
        if tell_decode:
            self.status_outbox(room.decode_node_id).put(room.status(state, reason, may_still_write))
        logger.info(
            "%s closed %s (was %s%s): %s",
            room.label,
            state_name(state),
            room.phase.value,
            ", P may still write: unsettled" if may_still_write else "",
            reason,
        )
