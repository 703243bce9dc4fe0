"""The phases of a decode node's disaggregated room (one per request with a bootstrap room).

    (arrives)   -> PREALLOC    waiting for KV pages: admitted when the pool can hold the prompt
                               plus `decode_headroom` tokens while keeping a page for every
                               decoding request
    PREALLOC    -> TRANSFER    pages reserved (the scheduler parks the request) and published
                               to bootstrap as the room's destination
    PREALLOC    -> (gone)      client abort: nothing was reserved
    TRANSFER    -> (gone)      P reported DONE: the aux slot is checked and the request joins
                               the running batch with no prefill forward; or P reported FAILED
                               (no write can land any more): pages freed
    TRANSFER    -> QUARANTINE  given up while P may still be writing: client abort, no KV
                               within `transfer_timeout_s` (its timer restarts whenever P
                               reports progress), P failed with `may_still_write` (declared
                               dead while its process may be frozen), or this node registered
                               again so bootstrap forgot the room. The client has its error;
                               the pages stay held
    QUARANTINE  -> (gone)      bootstrap says no write can land any more (never delivered, P
                               confirmed it stopped, or P's process is gone); or, if no answer
                               comes (bootstrap restarted and forgot the room), after another
                               `transfer_timeout_s`: pages freed

Requests without a room prefill locally (colocated): they go straight to the scheduler.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.node.phases import RoomEntry


class DecodePhase(enum.Enum):
    PREALLOC = "prealloc"
    TRANSFER = "transfer"
    QUARANTINE = "quarantine"


DECODE_MOVES: dict[DecodePhase, frozenset[DecodePhase | None]] = {
    DecodePhase.PREALLOC: frozenset({DecodePhase.TRANSFER, None}),
    DecodePhase.TRANSFER: frozenset({DecodePhase.QUARANTINE, None}),
    DecodePhase.QUARANTINE: frozenset({None}),
}


@dataclass
class DecodeEntry(RoomEntry[DecodePhase]):
    epoch: int = 0  # the link's registration when the destination was published
    staged_into: tuple[int, ...] = ()  # with a staging span: the pages it is scattered into
