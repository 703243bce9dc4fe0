"""When a request passed each point of its life on one node (for its timing breakdown).

Marks are `time.monotonic()` stamps set once, on the engine thread (except `arrived`, set by
the thread that hands the request to the engine loop, and `kv_arrived`, set by the bootstrap
link's thread when the decode node hears the room is done). Durations between
marks go back to the gateway in the node's final message (`proto/node.proto`, NodeTiming),
which assembles the request's whole timeline (see gateway/dispatch/timeline.py).

    prefill node:   arrived -> destination -> scheduled -> first_token -> transfer_done
                    (bootstrap wait)  (queue)     (prefill)     (KV transfer)
    decode node:    arrived -> published ........ kv_arrived -> admitted -> second_token -> finished
                    (prealloc)      (waiting for P)   (queue)   (first decode)   (decode)
    local prefill:  arrived -> scheduled -> first_token -> second_token -> finished
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class RequestTiming:
    arrived: float = 0.0
    destination: float = 0.0  # P: D's pages known
    scheduled: float = 0.0  # first chunk in a batch
    first_token: float = 0.0  # P: sampled; D: emitted (taken over or sampled locally)
    transfer_done: float = 0.0  # P: every write confirmed (or failed)
    published: float = 0.0  # D: pages reserved and posted to bootstrap
    kv_arrived: float = 0.0  # D: P reported the room done
    admitted: float = 0.0  # D: joined the running batch
    second_token: float = 0.0
    finished: float = 0.0

    def mark(self, name: str, now: float | None = None) -> None:
        """Set a mark unless it is set already (retractions and replays keep the first)."""
        if not getattr(self, name):
            setattr(self, name, time.monotonic() if now is None else now)

    def span(self, start: str, end: str) -> float:
        """Seconds from mark `start` to mark `end`; 0 when either is missing."""
        a, b = getattr(self, start), getattr(self, end)
        return max(b - a, 0.0) if a and b else 0.0
