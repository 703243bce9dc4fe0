"""The layer-group poster (prefill_node/group_poster.py): a forward's layer groups are posted by a
thread of their own, so the thread that signals them neither waits nor posts.

The fake cases pin the order and the hand-back (`finish`); the last case streams a prompt's
groups through a real NIXL engine on loopback while the test thread polls another write, and
checks every byte that landed.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from engine.layer_groups import GroupDone, split_layers
from kvtransfer.base import TransferError, TransferRange, TransferState
from kvtransfer.head_routes import LayerSpan, RankKV, plan_routes
from kvtransfer.room import RoomDestination
from kvtransfer.sender import KVSender
from prefill_node.group_poster import GroupPoster
from prefill_node.layer_stream import ChunkPages, ForwardWrites, LayerStreamer, StreamConfig
from tests.fake_transfer import wait_settled
from tests.test_kvtransfer import (
    SENTINEL,
    Fill,
    Initiator,
    Target,
    make_initiator,
    spawn_target,
)


@dataclass
class GateEvent:
    """A CUDA event's host side that passes when the test opens it (`synchronize` blocks)."""

    gate: threading.Event = field(default_factory=threading.Event)

    def query(self) -> bool:
        return self.gate.is_set()

    def synchronize(self) -> None:
        if not self.gate.wait(30):
            raise TimeoutError("the test never opened this event")


@dataclass
class RecordingSender:
    # (span offset, span length, upto page, posting thread)
    posts: list[tuple[int, int, int, str]] = field(default_factory=list)
    marked: list[int] = field(default_factory=list)
    fail_with: Exception | None = None

    def send_layers(self, pages, upto: int, span: LayerSpan) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.posts.append((span.offset, span.length, upto, threading.current_thread().name))

    def mark_sent(self, upto: int) -> None:
        self.marked.append(upto)


def _poster_streamer(groups: int) -> LayerStreamer:
    config = StreamConfig(split_layers(4, groups), 10, 16, False, torch.device("cpu"), poster=True)
    return LayerStreamer(config, lambda req: None)


def _signal(writes: ForwardWrites, streamer: LayerStreamer, events: list[GateEvent]) -> None:
    for i, group in enumerate(streamer.config.groups):
        writes.on_group(GroupDone(i, group, events[i]))  # type: ignore[arg-type]


def _wait_for_posts(sender: RecordingSender, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(sender.posts) < count and time.monotonic() < deadline:
        time.sleep(0.001)


def test_groups_are_posted_in_order_on_the_poster_while_the_signaller_goes_on() -> None:
    """The signalling thread returns from every group at once, the GPU still on group 0; the
    poster posts each group once its event passed, in order, and `finish` returns only once
    the last one is out (then the pages count as sent)."""
    streamer = _poster_streamer(4)
    sender = RecordingSender()
    writes = ForwardWrites(streamer, [ChunkPages(1, sender, [0, 1, 2], 3)])  # type: ignore[arg-type]
    events = [GateEvent() for _ in range(4)]
    start = time.monotonic()
    _signal(writes, streamer, events)
    assert time.monotonic() - start < 1.0 and sender.posts == []  # nothing waited for
    for i, event in enumerate(events):
        event.gate.set()  # the GPU passes group i; the later ones still compute
        _wait_for_posts(sender, i + 1)
        assert [p[:3] for p in sender.posts][i] == (10 * i, 10, 3)
        assert sender.marked == ([3] if i == 3 else [])  # sent once the last group is out
    streamer.finish()
    assert len(sender.posts) == 4 and {p[3] for p in sender.posts} == {"kv-group-poster"}
    assert streamer.poster is not None
    assert (streamer.poster.stats.groups, streamer.poster.stats.writes) == (4, 4)
    streamer.close()


def test_groups_ready_together_go_out_as_one_write() -> None:
    """The poster fell behind (still waiting on group 0 while groups 1-3 passed): once group 0
    passes, the four go out as one write of layers 0-3, a quarter of the descriptors."""
    streamer = _poster_streamer(4)
    sender = RecordingSender()
    writes = ForwardWrites(streamer, [ChunkPages(1, sender, [0, 1, 2], 3)])  # type: ignore[arg-type]
    events = [GateEvent() for _ in range(4)]
    for event in events[1:]:
        event.gate.set()
    _signal(writes, streamer, events)
    events[0].gate.set()
    streamer.finish()
    assert [p[:3] for p in sender.posts] == [(0, 40, 3)] and sender.marked == [3]
    assert streamer.poster is not None
    assert (streamer.poster.stats.groups, streamer.poster.stats.writes) == (4, 1)
    streamer.close()


def test_a_write_that_cannot_start_is_the_rooms_failure_after_finish() -> None:
    streamer = _poster_streamer(2)
    good, bad = RecordingSender(), RecordingSender(fail_with=TransferError("peer gone"))
    chunks = [ChunkPages(1, good, [0, 1], 2), ChunkPages(2, bad, [2, 3], 2)]  # type: ignore[arg-type]
    writes = ForwardWrites(streamer, chunks)
    events = [GateEvent() for _ in range(2)]
    for event in events:
        event.gate.set()
    _signal(writes, streamer, events)
    streamer.finish()
    assert sum(p[1] for p in good.posts) == 40 and good.marked == [2]  # maybe one write
    assert bad.marked == []
    assert streamer.take_failures() == {2: "KV write failed: peer gone"}
    streamer.close()


def test_a_bug_in_a_post_is_raised_by_finish_not_swallowed() -> None:
    streamer = _poster_streamer(2)
    broken = RecordingSender(fail_with=ValueError("4 source pages but 3 dest pages"))
    writes = ForwardWrites(streamer, [ChunkPages(1, broken, [0], 1)])  # type: ignore[arg-type]
    events = [GateEvent() for _ in range(2)]
    for event in events:
        event.gate.set()
    _signal(writes, streamer, events)
    with pytest.raises(RuntimeError, match=r"posting a layer group failed.*4 source pages"):
        streamer.finish()
    streamer.finish()  # raised once; the poster still runs
    streamer.close()
    assert isinstance(streamer.poster, GroupPoster)
    with pytest.raises(RuntimeError, match="closed"):
        streamer.poster.submit(GroupDone(0, range(2)), print)


# ---- a real NIXL engine on loopback -------------------------------------------------------------

LAYERS, HEADS, LAYER_PAGE, PAGE_SIZE = 4, 2, 1024, 16
HEAD_PAGE = LAYERS * LAYER_PAGE
PAGE_BYTES = HEADS * HEAD_PAGE


@pytest.fixture(scope="module")
def nixl_pair() -> Iterator[tuple[Initiator, Target]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_NET_DEVICES", "lo")
        starting = spawn_target("nixl", "poster-target")
        initiator = make_initiator("nixl", "poster-initiator")
        target = starting.ready()
        initiator.engine.connect(target.peer)
        yield initiator, target
        initiator.engine.close()
        target.stop()


def test_nixl_groups_posted_by_the_poster_land_bit_exact(
    nixl_pair: tuple[Initiator, Target],
) -> None:
    """A 64-page prompt on scattered pages, 4 layers in 2 groups, two KV heads: the poster
    posts both groups through NIXL while the test thread polls a write of its own (the
    engine's lock: a poll never waits for a post); every destination page holds the source
    page's bytes and nothing else changed."""
    initiator, target = nixl_pair
    engine = initiator.engine
    assert engine.concurrent_writes
    assert target.ask(Fill(SENTINEL))
    pool_pages = initiator.buffer.nbytes // PAGE_BYTES
    rng = random.Random(3)
    src_pages = rng.sample(range(pool_pages // 2), 64)
    dst_pages = rng.sample(range(1, pool_pages), 64)  # page 0: the test thread's own write
    heads = range(HEADS)
    routes = plan_routes(
        [RankKV(0, "", initiator.base, heads, HEAD_PAGE)],
        [RankKV(0, target.peer.node_id, target.region.addr, heads, HEAD_PAGE)],
    )
    dest = RoomDestination(7, target.peer.node_id, "p", tuple(dst_pages), 0, 0, 64 * PAGE_SIZE)
    sender = KVSender(engine, dest, PAGE_SIZE, routes)
    config = StreamConfig(
        split_layers(LAYERS, 2), LAYER_PAGE, PAGE_SIZE, False, torch.device("cpu"), poster=True
    )
    streamer = LayerStreamer(config, lambda req: None)
    writes = ForwardWrites(streamer, [ChunkPages(7, sender, src_pages, 64)])
    # A write of the test thread's own, polled while the poster posts (into the upper half).
    spare = initiator.base + (pool_pages - 1) * PAGE_BYTES
    own = engine.write(target.peer.node_id, [TransferRange(spare, target.region.addr, 512)])
    events = [GateEvent() for _ in range(2)]
    _signal(writes, streamer, events)
    for event in events:
        event.gate.set()
        engine.poll(own)  # PENDING while the poster holds the engine, never blocked
    streamer.finish()
    assert wait_settled(engine, own) is TransferState.DONE
    engine.release(own)
    deadline = time.monotonic() + 30
    while (state := sender.poll()) is TransferState.PENDING and time.monotonic() < deadline:
        time.sleep(0.001)
    assert state is TransferState.DONE and sender.all_pages_sent
    streamer.close()
    landed = target.read()
    expected = np.full_like(landed, SENTINEL)
    expected[:512] = initiator.buffer[spare - initiator.base :][:512]
    for s, d in zip(src_pages, dst_pages, strict=True):
        expected[d * PAGE_BYTES : (d + 1) * PAGE_BYTES] = initiator.buffer[
            s * PAGE_BYTES : (s + 1) * PAGE_BYTES
        ]
    assert np.array_equal(landed, expected)
