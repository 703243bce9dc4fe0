"""The gateway's prefix index, the `kv_aware` policy and a node feed's resyncs.

The feed is driven by a scripted publisher with real ZMQ sockets on 127.0.0.1 (a PUB and a
ROUTER answering replay and snapshot requests as a node does), so that gaps, a replay window
that moved on, malformed and out-of-order frames and a publisher restart can be produced on
purpose: each is counted and resynced, and the index ends equal to what the publisher holds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.kv_events import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockSet,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
    prefix_hashes,
)
from engine.node.transfer_setup import node_load
from gateway.metrics import GatewayMetrics
from gateway.routing.kv_feed import FeedEndpoints, NodeFeed
from gateway.routing.nodes import DECODE, PREFILL, LiveNode, NodeDirectory
from gateway.routing.policies import KVAware, LeastLoad, PrefixAware, Router, make_policy
from gateway.routing.prefix_index import EXPECT_S, PrefixIndex
from proto import bootstrap_pb2
from tests.helpers import routing_config

BLOCK = 4
ROUTING = routing_config("kv_aware", "kv_aware", 8)


def stored(tokens: list[int], parent_tokens: list[int] = ()) -> BlockStored:  # type: ignore[assignment]
    parent = prefix_hashes(parent_tokens, BLOCK)[-1] if parent_tokens else None
    hashes = prefix_hashes([*parent_tokens, *tokens], BLOCK)[len(parent_tokens) // BLOCK :]
    return BlockStored(hashes, parent, tokens, BLOCK, "CPU")


def _node(node_id: str, role: int, running_tokens: int = 0) -> LiveNode:
    load = bootstrap_pb2.NodeLoad(running_tokens=running_tokens)
    return LiveNode(node_id, role, "127.0.0.1:1", stub=None, load=load)  # type: ignore[arg-type]


# ---- index and policy ------------------------------------------------------------------------


def test_index_matches_whole_blocks_of_a_prefix_and_never_the_whole_prompt() -> None:
    index = PrefixIndex()
    prompt = list(range(1, 15))  # 3 full blocks and 2 tokens
    assert index.cached_tokens("a", prompt) == 0  # untracked
    index.track("a", BLOCK)
    index.apply("a", [stored(prompt[:8])])
    assert index.cached_tokens("a", prompt) == 8
    assert index.cached_tokens("a", [99, *prompt]) == 0  # another prefix: other hashes
    index.apply("a", [stored(prompt[8:12], prompt[:8])])
    assert index.cached_tokens("a", prompt) == 12
    assert index.cached_tokens("a", prompt[:12]) == 11  # the last token always runs
    index.apply("a", [BlockRemoved(prefix_hashes(prompt, BLOCK)[1:2])])
    assert index.cached_tokens("a", prompt) == 4  # a hole ends the prefix
    index.apply("a", [AllBlocksCleared()])
    assert index.cached_tokens("a", prompt) == 0 and index.tracked("a")
    index.drop("a")
    assert not index.tracked("a")


def test_expected_blocks_bridge_the_events_lag_until_confirmed_removed_or_expired() -> None:
    now = [100.0]
    index = PrefixIndex(clock=lambda: now[0])
    history = list(range(1, 15))  # a turn's prompt and output: 3 whole blocks
    index.expect("a", history)
    assert index.cached_tokens("a", [*history, 50]) == 0  # untracked: nothing expected
    index.track("a", BLOCK)
    index.expect("a", history)
    assert index.cached_tokens("a", [*history, 50]) == 12  # the next turn: before any event
    index.apply("a", [BlockRemoved(prefix_hashes(history, BLOCK)[2:3])])
    assert index.cached_tokens("a", [*history, 50]) == 8  # the node's word wins
    index.apply("a", [stored(history[:8])])
    now[0] += EXPECT_S + 1  # expected blocks expire; stored ones stay
    assert index.cached_tokens("a", [*history, 50]) == 8
    index.expect("a", history)
    index.apply("a", [AllBlocksCleared()])
    assert index.cached_tokens("a", [*history, 50]) == 0


def test_kv_aware_weighs_tokens_to_compute_against_load() -> None:
    index = PrefixIndex()
    policy = make_policy("kv_aware", ROUTING, index, "prefill")
    assert isinstance(policy, KVAware) and isinstance(policy.fallback, PrefixAware)
    assert isinstance(make_policy("kv_aware", ROUTING, index, "decode").fallback, LeastLoad)  # type: ignore[attr-defined]
    prompt = list(range(1, 42))
    a, b = _node("a", PREFILL), _node("b", PREFILL)
    for node_id in ("a", "b"):
        index.track(node_id, BLOCK)
    index.apply("b", [stored(prompt[:32])])
    assert policy.pick([a, b], prompt) is b
    b.load = bootstrap_pb2.NodeLoad(running_tokens=20, queued_tokens=11)  # 31 < 32 saved
    assert policy.pick([a, b], prompt) is b
    b.inflight_tokens = 33  # the gateway's own count is higher than the heartbeat's
    assert policy.pick([a, b], prompt) is a


def test_kv_aware_decode_side_weighs_running_context_lightly() -> None:
    """A decode node's load is its streams' context (0.01 a token by default): a follow-up
    stays with the node holding its history until that node runs 100x the hit in extra
    context."""
    index = PrefixIndex()
    policy = make_policy("kv_aware", ROUTING, index, "decode")
    prompt = list(range(1, 42))
    a, b = _node("a", DECODE), _node("b", DECODE)
    for node_id in ("a", "b"):
        index.track(node_id, BLOCK)
    index.apply("b", [stored(prompt[:32])])
    b.load = bootstrap_pb2.NodeLoad(running_tokens=3_000)  # 30 < 32 saved
    assert policy.pick([a, b], prompt) is b
    b.load = bootstrap_pb2.NodeLoad(running_tokens=3_300)  # 33 > 32
    assert policy.pick([a, b], prompt) is a
    heavy = replace(ROUTING, decode_kv_load_weight=1.0)
    assert make_policy("kv_aware", heavy, index, "decode").pick([a, b], prompt) is a
    b.load = bootstrap_pb2.NodeLoad(running_tokens=31)
    assert make_policy("kv_aware", heavy, index, "decode").pick([a, b], prompt) is b


def test_kv_load_weights_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="--decode-kv-load-weight must be >= 0"):
        replace(ROUTING, decode_kv_load_weight=-1.0)


def test_kv_aware_falls_back_when_no_node_publishes_events() -> None:
    index = PrefixIndex()
    policy = make_policy("kv_aware", ROUTING, index, "decode")
    a, b = _node("a", DECODE), _node("b", DECODE)
    a.inflight = 3
    assert policy.pick([a, b], [1, 2, 3]) is b  # least_load


def test_router_sends_no_stream_to_a_decode_node_at_its_cap_while_another_has_room() -> None:
    """`kv_aware` weighs a decode node's streams by their context, so a node running five
    short streams at its cap of five costs less than one running three long ones, and a
    request sent there waits for one of the five to end (two-phase-12: single requests waited
    16-25 s). Nodes at their cap are left out while one is below it, whatever the policy; with
    every node at its cap the policy picks among all."""
    directory = NodeDirectory(cooldown_s=5.0)
    for node in (_node("p", PREFILL), _node("d1", DECODE), _node("d2", DECODE)):
        directory.nodes[node.node_id] = node
    index = PrefixIndex()
    for node_id in ("d1", "d2"):
        index.track(node_id, BLOCK)
    d1, d2 = directory.nodes["d1"], directory.nodes["d2"]
    d1.load = bootstrap_pb2.NodeLoad(running_requests=5, running_tokens=800,
                                     max_running_requests=5)  # fmt: skip
    d2.load = bootstrap_pb2.NodeLoad(running_requests=3, running_tokens=1500,
                                     max_running_requests=5)  # fmt: skip
    prompt = list(range(1, 130))
    assert ROUTING.decode_policy == "kv_aware"
    assert make_policy("kv_aware", ROUTING, index, "decode").pick([d1, d2], prompt) is d1
    router = Router(directory, ROUTING, index)
    assert d1.at_cap and not d2.at_cap
    assert all(router.choose(prompt).decode is d2 for _ in range(4))
    d2.decoding = 5  # this gateway's own count reaches the cap before a heartbeat says so
    assert d2.at_cap
    assert router.choose(prompt).decode is d1  # every node at its cap: the policy's pick
    d1.load = bootstrap_pb2.NodeLoad(running_requests=9, running_tokens=800)  # no cap reported
    assert not d1.at_cap and router.choose(prompt).decode is d1


def test_a_node_heartbeat_carries_its_running_request_cap() -> None:
    """What `LiveNode.at_cap` reads: the engine's `max_running_requests`, beside its load."""
    request = SimpleNamespace(seq_len=40, prompt_ids=[1] * 30, kv_len=10)
    scheduler = SimpleNamespace(
        config=EngineConfig("unused", max_running_requests=5),
        kv=SimpleNamespace(allocator=SimpleNamespace(num_free=6, num_cached=2, total=64)),
        running=[request, request], waiting=[request],
    )  # fmt: skip
    load = node_load(scheduler, (1, 0))  # type: ignore[arg-type]
    assert (load.max_running_requests, load.running_requests, load.queued_requests) == (5, 2, 1)
    assert (load.running_tokens, load.queued_tokens, load.free_pages) == (80, 20, 8)


def test_router_prefills_a_short_suffix_on_the_decode_node_holding_the_history() -> None:
    directory = NodeDirectory(cooldown_s=5.0)
    for node in (_node("p", PREFILL), _node("d1", DECODE), _node("d2", DECODE)):
        directory.nodes[node.node_id] = node
    index = PrefixIndex()
    router = Router(directory, ROUTING, index)
    history = list(range(1, 41))
    index.track("d1", BLOCK)
    index.track("d2", BLOCK)
    index.apply("d2", [stored(history)])
    short_turn = router.choose([*history, 50, 51, 52])
    assert short_turn.decode.node_id == "d2" and short_turn.prefill is None
    long_turn = router.choose([*history, *range(60, 80)])  # 20 > 8 new tokens
    assert long_turn.decode.node_id == "d2" and long_turn.prefill is not None
    assert router.choose(list(range(100, 140))).prefill is not None  # nothing cached


# ---- a node feed against a scripted publisher ------------------------------------------------


class ScriptedPublisher:
    """PUB + ROUTER like a node's, where the test decides every frame and the replay window."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        for sock in (self.pub, self.router):
            sock.setsockopt(zmq.LINGER, 0)
        pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoints = FeedEndpoints(
            f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", TOPIC, BLOCK
        )
        self.seq = -1
        self.window: dict[int, bytes] = {}  # what replay can serve
        self.blocks = BlockSet()
        self.snapshots = 0
        self.task = asyncio.create_task(self._serve())

    async def publish(self, events: list[KVEvent], *, send: bool = True) -> None:
        """The next batch: into the window and the block set; on the wire unless `send` is
        False (a batch the subscriber misses)."""
        self.seq += 1
        payload = encode_batch(KVEventBatch(events))
        self.window[self.seq] = payload
        self.blocks.apply(events)
        if send:
            await self.pub.send_multipart((TOPIC, self.seq.to_bytes(8, "big"), payload))

    async def raw(self, *frames: bytes) -> None:
        await self.pub.send_multipart(frames)

    async def _serve(self) -> None:
        while True:
            client, _, body = await self.router.recv_multipart()
            if body == SNAPSHOT_REQUEST:
                self.snapshots += 1
                snap = encode_batch(KVEventBatch(self.blocks.snapshot(BLOCK, "CPU")))
                await self.router.send_multipart(
                    (client, b"", max(self.seq, 0).to_bytes(8, "big"), snap)
                )
            else:
                start = int.from_bytes(body, "big")
                for seq in sorted(self.window):
                    if seq >= start:
                        frame = (client, b"", seq.to_bytes(8, "big"), self.window[seq])
                        await self.router.send_multipart(frame)
            await self.router.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self.task.cancel()
        self.pub.close()
        self.router.close()


@contextlib.asynccontextmanager
async def feed_and_publisher() -> AsyncIterator[tuple[NodeFeed, ScriptedPublisher, PrefixIndex]]:
    ctx = zmq.asyncio.Context()
    publisher = ScriptedPublisher(ctx)
    index = PrefixIndex()
    feed = NodeFeed("n", publisher.endpoints, index, GatewayMetrics(), ctx)
    await publisher.publish([AllBlocksCleared()])
    feed.start()
    try:
        await until(lambda: index.tracked("n"))
        yield feed, publisher, index
    finally:
        feed.cancel()
        await feed.wait()
        publisher.close()
        ctx.destroy(linger=0)


async def until(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def synced(feed: NodeFeed, publisher: ScriptedPublisher, index: PrefixIndex) -> bool:
    ours = index._nodes.get("n")
    return (
        feed.last_seq == publisher.seq
        and ours is not None
        and ours.hashes == set(publisher.blocks.blocks)
    )


def counter(feed: NodeFeed, name: str, **labels: str) -> float:
    value = feed.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_feed_follows_in_order_and_replays_a_gap() -> None:
    async def scenario() -> None:
        async with feed_and_publisher() as (feed, pub, index):
            await pub.publish([stored([1, 2, 3, 4])])
            await until(lambda: synced(feed, pub, index))
            await pub.publish([stored([5, 6, 7, 8], [1, 2, 3, 4])], send=False)  # missed
            await pub.publish([stored([9, 9, 9, 9])])
            await until(lambda: synced(feed, pub, index))
            assert counter(feed, "pdserve_gateway_kv_event_gaps_total") == 1
            assert counter(feed, "pdserve_gateway_kv_event_resyncs_total", kind="replay") == 1
            assert pub.snapshots == 1  # only the first one

    asyncio.run(scenario())


def test_feed_takes_a_snapshot_when_the_window_moved_on() -> None:
    async def scenario() -> None:
        async with feed_and_publisher() as (feed, pub, index):
            await pub.publish([stored([1, 2, 3, 4])], send=False)
            await pub.publish([stored([5, 5, 5, 5])], send=False)
            pub.window.clear()  # the node no longer has them
            await pub.publish([BlockRemoved(prefix_hashes([5, 5, 5, 5], BLOCK))])
            await until(lambda: synced(feed, pub, index) and pub.snapshots == 2)
            assert index.cached_tokens("n", [1, 2, 3, 4, 0]) == 4

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ((TOPIC, b"\x00\x01"), "malformed_frames"),
        ((TOPIC, (1).to_bytes(8, "big"), b"\xc1"), "malformed_payload"),
        ((TOPIC, (1).to_bytes(8, "big"), encode_batch(KVEventBatch([]))[:-1]), "malformed_payload"),
    ],
)
def test_malformed_frames_are_counted_and_resynced(frames: tuple[bytes, ...], reason: str) -> None:
    async def scenario() -> None:
        async with feed_and_publisher() as (feed, pub, index):
            await pub.raw(*frames)
            await until(lambda: pub.snapshots == 2)
            assert counter(feed, "pdserve_gateway_kv_event_errors_total", reason=reason) == 1
            await pub.publish([stored([1, 2, 3, 4])])  # and the feed goes on
            await until(lambda: synced(feed, pub, index))

    asyncio.run(scenario())


def test_out_of_order_and_restart_resync_from_a_snapshot() -> None:
    async def scenario() -> None:
        async with feed_and_publisher() as (feed, pub, index):
            for k in range(3):
                await pub.publish([stored([k + 1] * 4)])
            await until(lambda: synced(feed, pub, index))
            old = pub.window[1]
            await pub.raw(TOPIC, (1).to_bytes(8, "big"), old)  # seq 1 again after 3
            await until(lambda: pub.snapshots == 2)
            assert counter(feed, "pdserve_gateway_kv_event_errors_total", reason="out_of_order")
            # The publisher restarts: seq 0 again, an empty cache.
            pub.seq, pub.window, pub.blocks = -1, {}, BlockSet()
            await pub.publish([AllBlocksCleared()])
            await until(lambda: pub.snapshots == 3 and synced(feed, pub, index))
            assert index.num_blocks("n") == 0

    asyncio.run(scenario())
