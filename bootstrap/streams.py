"""What sits behind the bootstrap's server streams: per-node mailboxes and a broadcast.

`Outbox` holds the messages for one node id (destinations for a prefill node, room statuses for
a decode node) whether or not that node is subscribed right now, so nothing is lost when a node
is slow to subscribe or its stream breaks. A stream sends the head item and removes it only after
the write returned: an item whose write was interrupted is sent again to the next subscriber
(at-least-once). One subscriber per node id: a new subscription supersedes the old one, whose
stream then ends.

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
    items: deque[T] = field(default_factory=deque)
    subscriber: int = 0  # token of the stream that currently owns this outbox; 0: none
    last_token: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def idle(self) -> bool:
        """Empty and unwatched: the owner may forget this outbox."""
        return not self.items and self.subscriber == 0

    def put(self, item: T) -> None:
        self.items.append(item)
        self.changed.set()

    def discard(self, unwanted: Callable[[T], bool]) -> int:
        kept = [item for item in self.items if not unwanted(item)]
        dropped = len(self.items) - len(kept)
        self.items = deque(kept)
        return dropped

    def clear(self) -> None:
        self.items.clear()

    def subscribe(self) -> int:
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
            if self.items:
                return self.items[0]
            self.changed.clear()
            await self.changed.wait()
        return None

    def ack(self, item: T) -> None:
        """`item` was written to the stream: drop it (unless something else removed it)."""
        if self.items and self.items[0] is item:
            self.items.popleft()


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
