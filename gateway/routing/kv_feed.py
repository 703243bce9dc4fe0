"""Following every live node's KV-cache events into the gateway's prefix index.

`KVFeeds.sync` runs on every change of the node table (`gateway/routing/nodes.py`): a node that
registered KV-event endpoints gets a `NodeFeed` task; one that left, or registered again with
other endpoints (a restart), has its feed stopped and its blocks dropped from the index. Every
gateway worker runs its own feeds into its own index (gateway/process/workers.py).

A feed (vLLM's consumer protocol, `engine/node/kv_publisher.py`): subscribe (SUB), then ask
the replay socket for a snapshot and apply it; then apply each batch whose seq is the last one
plus 1. Anything else is resynced, never fatal:
- a gap (seq jumps ahead): replay from the first missing seq; if the node no longer has it
  (the window moved on), a snapshot;
- a frame that is malformed (not three frames, a bad seq, a payload that is not a batch) or
  out of order (a seq already applied, not explained by a resync): logged, counted, snapshot;
- seq 0 after others: the node's publisher restarted, snapshot.
While a node's feed has no consistent view (before its first snapshot, or the node does not
answer) it is not tracked, and routing treats it as holding nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from engine.kv_events import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    KVEventBatch,
    MalformedEvent,
    decode_batch,
)
from gateway.metrics import GatewayMetrics
from gateway.routing.nodes import LiveNode, NodeDirectory
from gateway.routing.prefix_index import PrefixIndex

logger = logging.getLogger("pdserve.gateway.kv_events")

REPLAY_TIMEOUT_S = 5.0  # a replay or snapshot answer; a node silent this long is resynced later
RETRY_S = 1.0


@dataclass(frozen=True)
class FeedEndpoints:
    publisher: str
    replay: str
    topic: bytes
    block_size: int


class ResyncNeeded(Exception):
    """The feed's view may be wrong: resync from a snapshot."""


class NodeFeed:
    def __init__(
        self,
        node_id: str,
        endpoints: FeedEndpoints,
        index: PrefixIndex,
        metrics: GatewayMetrics,
        ctx: zmq.asyncio.Context,
    ) -> None:
        self.node_id = node_id
        self.endpoints = endpoints
        self.index = index
        self.metrics = metrics
        self.ctx = ctx
        self.last_seq = -1
        self._stale_upto = -1  # frames up to here were queued before the last resync
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"kv-events-{self.node_id}")

    def cancel(self) -> None:
        """Stop at once: a cancelled task runs nothing but its cleanup, so it cannot touch the
        index of a feed started for the same node after it."""
        if self.task is not None:
            self.task.cancel()

    async def wait(self) -> None:
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic)
        sub.connect(self.endpoints.publisher)
        try:
            await asyncio.sleep(0.1)  # let the subscription reach the publisher first
            await self._resync("start")
            while True:
                frames = await sub.recv_multipart()
                try:
                    await self._on_frames(frames)
                except ResyncNeeded as exc:
                    await self._resync(str(exc))
        finally:
            sub.close()

    async def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed("frames", f"{len(frames)} frames, not topic | seq | payload")
        seq = int.from_bytes(frames[1], "big")
        if seq <= self._stale_upto and seq != 0:
            return  # in the snapshot or replay already
        if seq == 0 and self.last_seq > 0:
            raise ResyncNeeded("the node's publisher restarted (seq 0)")
        if seq <= self.last_seq:
            self.metrics.kv_event_errors.labels("out_of_order").inc()
            logger.warning(
                "node %s: KV-event batch %d after %d (out of order)",
                self.node_id,
                seq,
                self.last_seq,
            )
            raise ResyncNeeded("out of order")
        if seq > self.last_seq + 1:
            self.metrics.kv_event_gaps.inc()
            logger.info(
                "node %s: KV events %d..%d missed: replaying",
                self.node_id,
                self.last_seq + 1,
                seq - 1,
            )
            await self._replay(seq)
            if seq <= self.last_seq:
                return  # the replay brought this batch too
        self._apply(seq, self._decode(frames[2]))

    def _decode(self, payload: bytes) -> KVEventBatch:
        try:
            return decode_batch(payload)
        except MalformedEvent as exc:
            self._malformed("payload", str(exc))
            raise AssertionError("unreachable") from None

    def _malformed(self, reason: str, detail: str) -> None:
        self.metrics.kv_event_errors.labels(f"malformed_{reason}").inc()
        logger.warning("node %s: malformed KV-event frame (%s): resyncing", self.node_id, detail)
        raise ResyncNeeded(f"malformed {reason}")

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        self.index.apply(self.node_id, batch.events)
        self.last_seq = seq
        self.metrics.kv_event_lag.observe(max(time.time() - batch.ts, 0.0))
        self.metrics.kv_index_blocks.labels(self.node_id).set(self.index.num_blocks(self.node_id))

    async def _replay(self, until: int) -> None:
        """Apply the missed batches before `until`, or resync when the node lacks them."""
        answer = await self._request((self.last_seq + 1).to_bytes(8, "big"))
        if not answer or answer[0][0] != self.last_seq + 1:
            raise ResyncNeeded("missed batches are out of the node's replay window")
        self.metrics.kv_event_resyncs.labels("replay").inc()
        for seq, payload in answer:
            if seq != self.last_seq + 1:
                raise ResyncNeeded("a replay with a gap")
            self._apply(seq, self._decode(payload))
        self._stale_upto = max(self._stale_upto, self.last_seq)

    async def _resync(self, why: str) -> None:
        """From a snapshot; while the node does not answer, untracked, retried every second."""
        self.index.drop(self.node_id)
        while True:
            answer = await self._request(SNAPSHOT_REQUEST)
            if answer is not None and len(answer) == 1:
                seq, payload = answer[0]
                try:
                    batch = decode_batch(payload)
                except MalformedEvent as exc:
                    self.metrics.kv_event_errors.labels("malformed_snapshot").inc()
                    logger.warning("node %s: bad KV-event snapshot: %s", self.node_id, exc)
                else:
                    self.index.track(self.node_id, self.endpoints.block_size)
                    self._apply(seq, batch)
                    self._stale_upto = seq
                    self.metrics.kv_event_resyncs.labels("snapshot").inc()
                    logger.info(
                        "node %s: KV index synced from a snapshot at seq %d (%s): %d blocks",
                        self.node_id,
                        seq,
                        why,
                        self.index.num_blocks(self.node_id),
                    )
                    return
            await asyncio.sleep(RETRY_S)

    async def _request(self, body: bytes) -> list[tuple[int, bytes]] | None:
        """One replay-socket request: its (seq, payload) answers, or None on a timeout. A fresh
        DEALER each time, so a late answer to an earlier request cannot be taken for this one."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.endpoints.replay)
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", body))
            while True:
                if not await dealer.poll(int(REPLAY_TIMEOUT_S * 1000)):
                    logger.warning("node %s: no KV-event replay answer", self.node_id)
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.metrics.kv_event_errors.labels("malformed_replay").inc()
                    return None
                if frames[1] == END_SEQ:
                    return out
                out.append((int.from_bytes(frames[1], "big"), frames[2]))
        finally:
            dealer.close()


def feed_endpoints(node: LiveNode) -> FeedEndpoints | None:
    ep = node.kv_events
    if ep is None or not ep.publisher or not ep.replay or ep.block_size < 1:
        return None
    return FeedEndpoints(ep.publisher, ep.replay, ep.topic.encode(), ep.block_size)


class KVFeeds:
    """One feed per live node that publishes KV events."""

    def __init__(self, index: PrefixIndex, metrics: GatewayMetrics) -> None:
        self.index = index
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.feeds: dict[str, NodeFeed] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def sync(self, directory: NodeDirectory) -> None:
        """Start feeds for new nodes, stop those of nodes gone or registered anew."""
        wanted = {}
        for node in directory.nodes.values():
            endpoints = feed_endpoints(node)
            if endpoints is not None:
                wanted[node.node_id] = endpoints
        for node_id, feed in list(self.feeds.items()):
            if wanted.get(node_id) != feed.endpoints:
                del self.feeds[node_id]
                feed.cancel()
                self.index.drop(node_id)
                self.metrics.kv_index_blocks.labels(node_id).set(0)
                task = asyncio.create_task(feed.wait())
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)
        for node_id, endpoints in wanted.items():
            if node_id not in self.feeds:
                feed = NodeFeed(node_id, endpoints, self.index, self.metrics, self.ctx)
                self.feeds[node_id] = feed
                feed.start()

    async def close(self) -> None:
        feeds, self.feeds = list(self.feeds.values()), {}
        for feed in feeds:
            feed.cancel()
            self.index.drop(feed.node_id)
        await asyncio.gather(*(f.wait() for f in feeds), *self._stopping)
        self.ctx.destroy(linger=0)
