"""What sits behind the bootstrap's server streams: per-node mailboxes and a broadcast.

`Outbox` holds the messages for one node id (destinations for a prefill node, room statuses for
a decode node) whether or not that node is subscribed right now, so nothing is lost when a node
is slow to subscribe. A finished stream write only means the message reached the socket, not the
node, so written messages are also kept for `replay_window_s` (the heartbeat timeout: a node cut
off for longer is declared dead and its rooms failed) and sent again, first, to the node's next
stream. Delivery is therefore at-least-once; nodes ignore rooms they already know or no longer
hold. One stream per node id: a new subscription supersedes the old one, whose stream then ends.

`Broadcast` fans node events out to WatchNodes streams; a watcher that falls `max_backlog` events
behind is dropped (it resubscribes and gets a fresh snapshot) so memory stays bounded.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Outbox(Generic[T]):
    replay_window_s: float
    pending: deque[T] = field(default_factory=deque)  # not yet written to any stream
    sent: deque[tuple[float, T]] = field(default_factory=deque)  # (written at, item)
    subscriber: int = 0  # token of the stream that currently owns this outbox; 0: none
    last_token: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def idle(self) -> bool:
        """Nothing to send or replay, and unwatched: the owner may forget this outbox."""
        return not self.pending and not self.sent and self.subscriber == 0

    def put(self, item: T) -> None:
        self.pending.append(item)
        self.changed.set()

    def discard(self, unwanted: Callable[[T], bool]) -> int:
        """Drop matching items that no stream has carried yet."""
        kept = [item for item in self.pending if not unwanted(item)]
        dropped = len(self.pending) - len(kept)
        self.pending = deque(kept)
        return dropped

    def clear(self) -> None:
        self.pending.clear()
        self.sent.clear()

    def prune(self, now: float) -> None:
        while self.sent and now - self.sent[0][0] > self.replay_window_s:
            self.sent.popleft()

    def subscribe(self, now: float) -> int:
        """A new stream takes over; what the previous ones carried recently is sent again."""
        self.prune(now)
        self.pending.extendleft(reversed([item for _, item in self.sent]))
        self.sent.clear()
        self.last_token += 1
        self.subscriber = self.last_token
        self.changed.set()  # wakes a superseded stream so that it ends
        return self.subscriber

    def unsubscribe(self, token: int) -> None:
        if self.subscriber == token:
            self.subscriber = 0

    async def next(self, token: int) -> T | None:
        """The head item once there is one; None when `token` has been superseded."""
        while self.subscriber == token:
            if self.pending:
                return self.pending[0]
            self.changed.clear()
            await self.changed.wait()
        return None

    def written(self, item: T, now: float) -> None:
        """`item` (the head) went to the stream; kept for replay (unless it was dropped)."""
        if self.pending and self.pending[0] is item:
            self.pending.popleft()
            self.sent.append((now, item))
        self.prune(now)

    def skipped(self, item: T) -> None:
        """`item` (the head) is stale and was not written: drop it."""
        if self.pending and self.pending[0] is item:
            self.pending.popleft()


@dataclass(eq=False)  # hashed by identity: kept in a set
class Watcher(Generic[T]):
    queue: asyncio.Queue[T | None] = field(default_factory=asyncio.Queue)
    fell_behind: bool = False


class Broadcast(Generic[T]):
    def __init__(self, max_backlog: int) -> None:
        self.max_backlog = max_backlog
        self.watchers: set[Watcher[T]] = set()

    def subscribe(self) -> Watcher[T]:
        watcher: Watcher[T] = Watcher()
        self.watchers.add(watcher)
        return watcher

    def unsubscribe(self, watcher: Watcher[T]) -> None:
        self.watchers.discard(watcher)

    def publish(self, item: T) -> None:
        for watcher in list(self.watchers):
            if watcher.queue.qsize() >= self.max_backlog:
                watcher.fell_behind = True
                self.watchers.discard(watcher)
                watcher.queue.put_nowait(None)  # wakes the stream so that it ends
            else:
                watcher.queue.put_nowait(item)
