"""The rooms a node role holds, each in exactly one phase, moved only along its role's table.

A role (prefill_node/, decode_node/) declares its phases as an `Enum` and its legal moves as a
table of moves (`None` as a target: the room leaves the role). `PhaseTable.move` is the only way
a room's phase changes, so the table in the role's module docstring is the whole story, and a
move the table does not list is a bug that fails loudly instead of a room stuck between dicts.
`RoomRole` is what both roles share besides: the rooms, and the inbox that the bootstrap link's
thread fills with room messages for the engine thread.
"""

from __future__ import annotations

import queue
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from engine.request import Req
from kvtransfer.room import RoomMessage

P = TypeVar("P", bound=Enum)


@dataclass
class RoomEntry(Generic[P]):
    """One request's room: its phase, and when it entered it (the phase's timers start there)."""

    req: Req
    phase: P
    since: float

    @property
    def room(self) -> int:
        return self.req.room


E = TypeVar("E", bound=RoomEntry)  # type: ignore[type-arg]


class IllegalMove(RuntimeError):
    pass


class PhaseTable(Generic[P, E]):
    """The role's rooms by number (in arrival order), with every phase change checked."""

    def __init__(self, moves: Mapping[P, frozenset[P | None]], clock: Callable[[], float]) -> None:
        self.moves = moves
        self.clock = clock
        self._entries: dict[int, E] = {}

    def add(self, entry: E) -> None:
        if entry.room in self._entries:
            held = self._entries[entry.room].phase.name
            raise IllegalMove(f"room {entry.room} is already held (in {held})")
        entry.since = self.clock()
        self._entries[entry.room] = entry

    def move(self, entry: E, phase: P | None) -> None:
        """`entry` to `phase` (None: the room leaves), if the role's table allows it."""
        if phase not in self.moves[entry.phase]:
            target = phase.name if phase is not None else "(gone)"
            raise IllegalMove(f"room {entry.room}: {entry.phase.name} -> {target} is no move")
        if phase is None:
            del self._entries[entry.room]
            return
        entry.phase = phase
        entry.since = self.clock()

    def restart_timer(self, entry: E) -> None:
        """The room stays in its phase, but its timeout counts from now (progress was seen)."""
        entry.since = self.clock()

    def get(self, room: int) -> E | None:
        return self._entries.get(room)

    def find(self, rid: str) -> E | None:
        return next((e for e in self._entries.values() if e.req.rid == rid), None)

    def in_phase(self, *phases: P) -> list[E]:
        """The rooms in any of `phases`, oldest first (a snapshot: safe to move them)."""
        return [e for e in self._entries.values() if e.phase in phases]

    def counts(self) -> Counter[P]:
        """Rooms per phase (safe from another thread: it reads a snapshot)."""
        return Counter(e.phase for e in list(self._entries.values()))

    def __iter__(self) -> Iterator[E]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, room: int) -> bool:
        return room in self._entries


class RoomRole(Generic[P, E]):
    """The rooms of a node role and its inbox of room messages (with their arrival times)."""

    def __init__(self, moves: Mapping[P, frozenset[P | None]], clock: Callable[[], float]) -> None:
        self.clock = clock
        self.rooms: PhaseTable[P, E] = PhaseTable(moves, clock)
        self.inbox: queue.Queue[tuple[RoomMessage, float]] = queue.Queue()
        self._wake: Callable[[], None] = lambda: None  # the engine loop's, once bound

    @property
    def has_work(self) -> bool:
        return bool(len(self.rooms) or not self.inbox.empty())

    def bind_wakeup(self, wake: Callable[[], None]) -> None:
        self._wake = wake

    def deliver(self, message: RoomMessage) -> None:
        """Called by the bootstrap link's thread: queue the message, stamped with when it came
        (when P's DONE reached D is when the KV arrived), and wake the engine loop."""
        self.inbox.put((message, time.monotonic()))
        self._wake()

    def received(self) -> list[tuple[RoomMessage, float]]:
        """The messages queued since the last call, oldest first."""
        messages = []
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                return messages
