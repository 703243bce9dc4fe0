"""Late binding to a decode node: requests wait at the gateway, not in one node's queue.

A stream holds its decode slot for its whole generation. When every live decode node is at its
running-request cap (`LiveNode.at_cap`), a request sent to one of them waits in that node's
queue until one of *its* streams ends, while another node may free a slot much sooner. So a
request that finds every node at its cap joins the gateway's line instead, and is routed when a
node has room: first come, first served, each one picked by the routing policy among the nodes
below their cap at that moment. A request arriving while others wait joins behind them.

The line looks again when a node may have room: one of this gateway's requests left a node
(`Dispatcher.leave`), a heartbeat refreshed a node's load, or a node joined (e.g. a prefill node
switched to decode). A request waits at most `hold_s` (`--decode-hold`); then it is routed as if
the line did not exist (into a node's queue). Only a request that has streamed nothing waits: a
stream moving to another node after a failure is routed at once.

The first in line blocks those behind it: a retry whose only node with room is one it failed on
waits out its hold (that node is usually cooling down and failing the others too). A heartbeat
the node sent before one of this gateway's requests ended there, but that arrives after, still
counts it: the node can look at its cap for one more heartbeat interval (1 s), and a request
wait that long for nothing.

**Off by default.** A request the line releases counts against its node's cap at once
(`Dispatcher.enter`'s `takes_slot`), before the next in line looks: in a PD cluster a request
otherwise counts only from its first token, and one wake could send the whole line to the node
that freed one slot. Two-phase-13 (benchmarks/) measured the line hurting before that was
mended.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class DecodeLine:
    def __init__(self, hold_s: float) -> None:
        """`hold_s`: the longest a request waits for a node below its cap (0: never waits)."""
        self.hold_s = hold_s
        self._line: deque[asyncio.Event] = deque()

    def __len__(self) -> int:
        return len(self._line)

    def wake(self) -> None:
        """A node may have room: the first in line looks."""
        if self._line:
            self._line[0].set()

    def must_wait(self, blocked: Callable[[], bool]) -> bool:
        """Others are waiting already, or `blocked()`: every decode node is at its cap."""
        return bool(self._line) or blocked()

    async def turn(self, blocked: Callable[[], bool]) -> bool:
        """Wait until this request is first in line and `blocked()` is false (some node has
        room); True then (route it now, before the next await), False after `hold_s` (route
        it anyway)."""
        if self.hold_s <= 0:
            return False
        me = asyncio.Event()
        self._line.append(me)
        try:
            async with asyncio.timeout(self.hold_s):
                while self._line[0] is not me or blocked():
                    me.clear()
                    await me.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._line.remove(me)
            self.wake()  # the next in line looks: the node may have room for two
