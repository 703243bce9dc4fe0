"""The phases of a prefill node's room (one per PD request), and every move between them.

    (arrives)  -> BOOTSTRAP   waiting for the decode node's destination (pages + aux slot)
    BOOTSTRAP  -> ACTIVE      destination taken: the request joins the scheduler; after every
                              chunk its full pages are written into D's pages
    BOOTSTRAP  -> SETTLING    failed before computing (bootstrap timeout, D cancelled, client
                              abort, wrong or unreachable decode node): nothing was written
    ACTIVE     -> SETTLING    first token sampled: the rest of the pages and the aux slot are
                              sent; or failed (write error, lease lost, cancel, abort): the
                              scheduler parks the request, its pages held
    SETTLING   -> REPORTED    every write it started settled (or failed): DONE or FAILED posted
                              to bootstrap and the Prefill call answered; pages still held
    REPORTED   -> (gone)      the next step boundary: pages released (into the prefix cache
                              when the room is DONE)

A room that failed carries its `failure` from the moment it is doomed, whatever its phase: it
is reported FAILED once its writes settled (a late write must not read pages handed to
another request). `since` is when the room entered its phase: the bootstrap timeout counts in
BOOTSTRAP, the transfer timeout in SETTLING.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.node.phases import RoomEntry
from kvtransfer.room import RoomDestination
from kvtransfer.sender import KVSender


class PrefillPhase(enum.Enum):
    BOOTSTRAP = "bootstrap"
    ACTIVE = "active"
    SETTLING = "settling"
    REPORTED = "reported"


PREFILL_MOVES: dict[PrefillPhase, frozenset[PrefillPhase | None]] = {
    PrefillPhase.BOOTSTRAP: frozenset({PrefillPhase.ACTIVE, PrefillPhase.SETTLING}),
    PrefillPhase.ACTIVE: frozenset({PrefillPhase.SETTLING}),
    PrefillPhase.SETTLING: frozenset({PrefillPhase.REPORTED}),
    PrefillPhase.REPORTED: frozenset({None}),
}


@dataclass
class PrefillEntry(RoomEntry[PrefillPhase]):
    dest: RoomDestination | None = None
    sender: KVSender | None = None
    failure: str = ""  # set once the room is doomed; reported after its writes settle
    failure_kind: str = ""  # metrics label: write_failed, transfer_timeout, lease_lost, ...
    epoch: int = 0  # the link's registration epoch when the room started
    announced: bool = False  # TRANSFERRING posted: its first pages are out

    def fail(self, kind: str, reason: str) -> None:
        """Doom the room (the first failure is the one reported)."""
        if not self.failure:
            self.failure, self.failure_kind = reason, kind


class EarlyDestinations:
    """Destinations that came before their Prefill call (the gateway calls P and D at once):
    held by room until the call arrives, or for the bootstrap timeout at the most."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[RoomDestination, float]] = {}

    def hold(self, dest: RoomDestination, now: float) -> None:
        self._held[dest.room] = (dest, now)

    def take(self, room: int) -> RoomDestination | None:
        dest, _ = self._held.pop(room, (None, 0.0))
        return dest

    def expired(self, now: float, timeout_s: float) -> list[RoomDestination]:
        """Take the destinations held longer than `timeout_s`."""
        old = [room for room, (_, seen) in self._held.items() if now - seen > timeout_s]
        return [self._held.pop(room)[0] for room in old]
