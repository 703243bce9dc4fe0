"""Layer-wise KV streaming (`--kv-stream-layers`): the engine's layer-group signals, the byte
ranges of a layer group, and when the prefill node posts each group's writes.

The end-to-end runs (a PD pair streaming by layer group, greedy output equal to HF, no page
leaked) are in tests/test_disagg.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.layer_groups import GroupDone, LayerStream, split_layers
from engine.memory.kv_cache import KVLayout
from engine.request import Req
from engine.sampling import RequestSampler, SamplingParams
from kvtransfer.base import (
    KVTransferEngine,
    RangeColumns,
    TransferRange,
    columns_of,
    total_bytes,
)
from kvtransfer.head_routes import HeadRoute, LayerSpan, RankKV, plan_routes, route_pages
from kvtransfer.room import RoomDestination
from kvtransfer.sender import KVSender
from prefill_node.layer_stream import (
    ChunkPages,
    ForwardWrites,
    LayerStreamer,
    StreamConfig,
    check_streamable,
)
from scripts.tiny_models import llama_config, write_llama_config

# ---- splitting the layers ---------------------------------------------------------------------


def test_split_layers_covers_every_layer_once_larger_groups_first() -> None:
    assert split_layers(30, 4) == (range(0, 8), range(8, 16), range(16, 23), range(23, 30))
    assert split_layers(5, 3) == (range(0, 2), range(2, 4), range(4, 5))
    assert split_layers(4, 4) == tuple(range(i, i + 1) for i in range(4))
    assert split_layers(7, 1) == (range(0, 7),)
    for bad in (0, 8):
        with pytest.raises(ValueError, match=r"use 1\.\.7"):
            split_layers(7, bad)


def test_streaming_is_refused_where_it_cannot_run() -> None:
    check_streamable(0, 30, tp_size=4, staging_pages=64)  # off: anything goes
    check_streamable(30, 30, tp_size=1, staging_pages=0)
    with pytest.raises(ValueError, match=r"use 0 \(off\) or 1\.\.30"):
        check_streamable(31, 30, 1, 0)
    with pytest.raises(ValueError, match="needs --tp-size 1 on the prefill node"):
        check_streamable(2, 30, 2, 0)
    with pytest.raises(ValueError, match="cannot be combined with --kv-staging-pages"):
        check_streamable(2, 30, 1, 64)


# ---- byte ranges against a real tensor ----------------------------------------------------------

LAYERS, HEADS, PAGE, DIM = 5, 4, 4, 8
LAYOUT = KVLayout(LAYERS, HEADS, DIM, PAGE, torch.float32)


def _pool(num_pages: int, heads: int, fill: bool) -> torch.Tensor:
    shape = (num_pages, heads, LAYERS, 2, PAGE, DIM)
    if fill:
        return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    return torch.zeros(shape)


def _copy(ranges: list[TransferRange], src: torch.Tensor, dst: torch.Tensor) -> None:
    """The fake transfer engine: addresses are byte offsets into the two pools."""
    src_bytes, dst_bytes = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    for r in ranges:
        dst_bytes[r.dst_addr : r.dst_addr + r.length] = src_bytes[
            r.src_addr : r.src_addr + r.length
        ]


@pytest.mark.parametrize("dst_split", [[range(0, 4)], [range(0, 1), range(1, 3), range(3, 4)]])
def test_layer_group_ranges_move_exactly_the_groups_layers(dst_split: list[range]) -> None:
    """P (TP 1, every head) into D of one rank or three (head runs 1, 2, 1): after each group,
    D's pages hold exactly the layers sent so far of P's pages, nothing else; all groups
    together move the whole pages."""
    hpb, lpb = LAYOUT.head_page_bytes, LAYOUT.layer_page_bytes
    src = _pool(6, HEADS, fill=True)
    dsts = [_pool(8, len(h), fill=False) for h in dst_split]
    src_rank = RankKV(0, "", 0, range(HEADS), hpb)
    # Every D rank's pool at its own fake base: one big address space split by rank.
    stride = 1 << 30
    dst_ranks = [RankKV(r, f"d#{r}", r * stride, h, hpb) for r, h in enumerate(dst_split)]
    routes = plan_routes([src_rank], dst_ranks)
    src_pages, dst_pages = [4, 1, 2, 5], [0, 3, 4, 7]  # scattered, one run contiguous on both
    groups = split_layers(LAYERS, 3)
    sent: list[range] = []
    for group in groups:
        plan = route_pages(routes, src_pages, dst_pages, LayerSpan.of(group, lpb))
        for peer, ranges in plan[0].items():
            rank = int(peer.split("#")[1])
            local = [
                TransferRange(r.src_addr, r.dst_addr - rank * stride, r.length) for r in ranges
            ]
            _copy(local, src, dsts[rank])
        sent.append(group)
        expected = [torch.zeros_like(d) for d in dsts]
        for rank, heads in enumerate(dst_split):
            for s, d in zip(src_pages, dst_pages, strict=True):
                for g in sent:
                    expected[rank][d, :, g.start : g.stop] = src[s, heads, g.start : g.stop]
        for rank in range(len(dsts)):
            assert torch.equal(dsts[rank], expected[rank]), (group, rank)
    for rank, heads in enumerate(dst_split):
        assert torch.equal(dsts[rank][dst_pages], src[src_pages][:, heads])


def test_a_span_of_every_layer_is_whole_pages_again() -> None:
    hpb, lpb = LAYOUT.head_page_bytes, LAYOUT.layer_page_bytes
    ranks = [RankKV(0, "d", 0, range(HEADS), hpb)]
    routes = plan_routes([RankKV(0, "", 0, range(HEADS), hpb)], ranks)
    all_layers = LayerSpan.of(range(LAYERS), lpb)
    plan = route_pages(routes, [3, 4, 5, 9], [0, 1, 2, 3], all_layers)
    page = LAYOUT.page_bytes
    assert list(plan[0]["d"]) == [
        TransferRange(3 * page, 0, 3 * page),
        TransferRange(9 * page, 3 * page, page),
    ]
    one_group = route_pages(routes, [3], [0], LayerSpan.of(range(1, 3), lpb))
    assert len(one_group[0]["d"]) == HEADS  # one range per head: heads are apart by the layers


def _reference_layer_ranges(
    route: HeadRoute, src_pages: list[int], dst_pages: list[int], span: LayerSpan
) -> list[TransferRange]:
    """The per-range Python planning that `HeadRoute.layer_ranges` replaced (numpy columns),
    kept here as the reference: one range per page and head, merged where they touch."""
    src, dst = route.src, route.dst
    ranges = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        src_page = src.kv_base + s * src.page_bytes + span.offset
        dst_page = dst.kv_base + d * dst.page_bytes + span.offset
        for i in range(route.num_heads):
            src_addr = src_page + (route.src_head + i) * src.head_page_bytes
            dst_addr = dst_page + (route.dst_head + i) * dst.head_page_bytes
            ranges.append(TransferRange(src_addr, dst_addr, span.length))
    if span.length != src.head_page_bytes:
        return ranges
    merged: list[TransferRange] = []
    for r in ranges:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.src_addr + last.length == r.src_addr
            and last.dst_addr + last.length == r.dst_addr
        ):
            merged[-1] = TransferRange(last.src_addr, last.dst_addr, last.length + r.length)
        else:
            merged.append(r)
    return merged


@pytest.mark.parametrize("seed", range(6))
def test_layer_ranges_as_columns_equal_the_per_range_planning(seed: int) -> None:
    """Random page sets (runs and scattered pages), head splits and layer spans, the span of
    every layer included: the numpy planning gives the same ranges in the same order."""
    rng = random.Random(seed)
    layers, hpb = 6, 6 * 1024  # 8 KV heads
    lpb = hpb // layers
    splits = [[range(0, 8)], [range(0, 4), range(4, 8)], [range(0, 2), range(2, 8)]]
    src_split, dst_split = rng.choice(splits), rng.choice(splits)
    src_ranks = [RankKV(r, "", (r + 1) << 32, h, hpb) for r, h in enumerate(src_split)]
    dst_ranks = [RankKV(r, f"d#{r}", (r + 9) << 32, h, hpb) for r, h in enumerate(dst_split)]
    routes = plan_routes(src_ranks, dst_ranks)
    for _ in range(20):
        count = rng.randrange(0, 300)
        src_pages = rng.sample(range(4096), count)
        start = rng.randrange(0, 1000)
        dst_pages = list(range(start, start + count)) if rng.random() < 0.5 else src_pages[::-1]
        if rng.random() < 0.3:  # runs contiguous on both sides
            src_pages = list(range(start + 7, start + 7 + count))
        first = rng.randrange(layers)
        span = LayerSpan.of(range(first, rng.randrange(first + 1, layers + 1)), lpb)
        if rng.random() < 0.3:
            span = LayerSpan.of(range(layers), lpb)
        for route in routes:
            expected = _reference_layer_ranges(route, src_pages, dst_pages, span)
            assert list(route.layer_ranges(src_pages, dst_pages, span)) == expected
        plan = route_pages(routes, src_pages, dst_pages, span)
        for rank, by_peer in plan.items():
            for peer, ranges in by_peer.items():
                expected = [
                    r
                    for route in routes
                    if (route.src.tp_rank, route.dst.peer_id) == (rank, peer)
                    for r in _reference_layer_ranges(route, src_pages, dst_pages, span)
                ]
                assert list(ranges) == expected


def test_range_columns_read_as_transfer_ranges() -> None:
    columns = RangeColumns(np.array([[10, 20, 30], [0, 5, 9], [4, 4, 2]], dtype=np.int64))
    assert len(columns) == 3 and columns[1] == TransferRange(20, 5, 4)
    assert list(columns[1:]) == [TransferRange(20, 5, 4), TransferRange(30, 9, 2)]
    assert total_bytes(columns) == 10 == total_bytes(list(columns))
    assert columns_of(list(columns)).tolist() == columns.columns.tolist()
    with pytest.raises(ValueError, match=r"\[3, n\]"):
        RangeColumns(np.zeros((2, 4), dtype=np.int64))


# ---- the engine's signals ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def five_layer_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("five-layers") / "llama"
    write_llama_config(path, llama_config(num_hidden_layers=5, hidden_size=64, vocab_size=256,
                                          intermediate_size=128))  # fmt: skip
    return path


def _req(rid: str, prompt_len: int, max_new: int = 2) -> Req:
    params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
    prompt = list(range(5, 5 + prompt_len))
    return Req(rid, prompt, params, RequestSampler(params, prompt, 256, "cpu"))


def test_groups_signal_once_each_in_order_after_their_layers_wrote_kv(five_layer_model) -> None:
    """3 groups of 5 layers (2, 2, 1), a prompt of 3 chunks then decode steps: each extend
    forward signals groups 0, 1, 2 once, in order; when group g signals, the KV of its layers
    (and the earlier ones) is in the pool for the chunk's tokens and the later layers' is not;
    decode forwards signal nothing."""
    config = EngineConfig(str(five_layer_model), load_format="dummy", max_total_tokens=512,
                          chunked_prefill_size=24, page_size=8)  # fmt: skip
    engine = build_engine(config)
    runner, scheduler = engine.scheduler.runner, engine.scheduler
    groups = split_layers(5, 3)
    seen: list[tuple[int, int]] = []  # (forward, group)
    begun: list[list[int]] = []

    def begin(reqs, lens):
        begun.append(list(lens))
        forward = len(begun) - 1
        (req,) = reqs
        start = req.kv_len  # before this forward
        locs = runner.req_to_token.table[req.slot, start : start + lens[0]]
        pages, offsets = locs // config.page_size, locs % config.page_size

        def on_group(done: GroupDone) -> None:
            assert done.ready() and done.event is None  # CPU: written already
            seen.append((forward, done.index))
            kv = runner.kv_cache.buffer[pages, :, :, :, offsets]  # [tokens, heads, layers, 2, dim]
            for layer in range(5):
                written = bool(kv[:, :, layer].abs().sum(dim=(1, 2, 3)).ne(0).all())
                assert written == (layer < done.layers.stop), (forward, done.index, layer)

        return on_group

    runner.layer_stream = LayerStream(groups, begin)
    scheduler.add_request(_req("a", 60, max_new=3))
    while scheduler.has_work:
        scheduler.step()
    assert begun == [[24], [24], [12]]  # the decode steps asked for nothing
    assert seen == [(f, g) for f in range(3) for g in range(3)]
    scheduler.check_integrity()


def test_a_forward_without_a_callback_costs_no_signal(five_layer_model) -> None:
    config = EngineConfig(str(five_layer_model), load_format="dummy", max_total_tokens=512)
    engine = build_engine(config)
    runner = engine.scheduler.runner
    runner.layer_stream = LayerStream(split_layers(5, 2), lambda reqs, lens: None)
    req = _req("a", 10)
    engine.scheduler.add_request(req)
    engine.scheduler.step()
    batch = runner.build_batch([req], [1])
    assert batch.after_layer is None  # decode: never asked


# ---- when the prefill node posts a group's writes ---------------------------------------------


@dataclass
class FakeEvent:
    """A CUDA event's host side: `done` says whether the GPU passed it."""

    done: bool = False
    waited: int = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


@dataclass
class RecordingSender:
    """Records the layer spans written; the pages count as sent on `mark_sent`."""

    posts: list[tuple[int, int]] = field(default_factory=list)  # (span offset, upto page)
    marked: list[int] = field(default_factory=list)

    def send_layers(self, pages, upto: int, span: LayerSpan) -> None:
        self.posts.append((span.offset, upto))

    def mark_sent(self, upto: int) -> None:
        self.marked.append(upto)


def _chunk_for(sender: RecordingSender, upto: int, room: int = 1) -> ChunkPages:
    return ChunkPages(room, sender, [0, 1, 2, 3], upto)  # type: ignore[arg-type]


def _streamer(groups: int, stream_ordered: bool = False) -> LayerStreamer:
    config = StreamConfig(split_layers(4, groups), 10, 16, stream_ordered, torch.device("cpu"))
    return LayerStreamer(config, lambda req: None)


def test_gpu_groups_post_once_passed_never_waiting_until_the_last_is_queued() -> None:
    """Not stream-ordered (NIXL, Mooncake): while the forward is queued a group is posted only
    once its event passed (the host never waits there: the GPU would run dry); at the last
    group the host waits for each earlier group in turn and posts it, and the last group is
    posted by `finish`, after the step (or before the next forward begins)."""
    streamer = _streamer(4)
    sender = RecordingSender()
    writes = ForwardWrites(streamer, [_chunk_for(sender, upto=3)])
    events = [FakeEvent() for _ in range(4)]
    groups = streamer.config.groups
    writes.on_group(GroupDone(0, groups[0], events[0]))  # type: ignore[arg-type]
    assert sender.posts == []  # the GPU is still on group 0
    events[0].done = True
    writes.on_group(GroupDone(1, groups[1], events[1]))  # type: ignore[arg-type]
    assert sender.posts == [(0, 3)]  # passed: posted; group 1 still running
    writes.on_group(GroupDone(2, groups[2], events[2]))  # type: ignore[arg-type]
    assert sender.posts == [(0, 3)] and events[1].waited == 0  # no wait while queuing
    writes.on_group(GroupDone(3, groups[3], events[3]))  # type: ignore[arg-type]
    assert sender.posts == [(0, 3), (10, 3), (20, 3)]  # waited for in turn, posted
    assert events[1].waited == 1 and events[2].waited == 1 and events[3].waited == 0
    assert sender.marked == [] and streamer.unfinished == [writes]
    streamer.finish()
    assert sender.posts == [(0, 3), (10, 3), (20, 3), (30, 3)] and events[3].waited == 1
    assert sender.marked == [3]  # counted once the last group is out
    assert streamer.unfinished == []


def test_a_forward_begins_after_the_last_forwards_groups_are_out() -> None:
    """With overlap the role may not run between two forwards: `begin` posts what the earlier
    forward left, so the next chunk's pages start where the sender's count says."""
    streamer = _streamer(2)
    sender = RecordingSender()
    writes = ForwardWrites(streamer, [_chunk_for(sender, upto=2)])
    for i, group in enumerate(streamer.config.groups):
        writes.on_group(GroupDone(i, group, FakeEvent()))  # type: ignore[arg-type]
    assert sender.marked == []
    assert streamer.begin([], []) is None  # nothing of this batch is streamed
    assert sender.posts == [(0, 2), (20, 2)] and sender.marked == [2]


def test_cpu_groups_post_at_once_and_failures_wait_for_the_role() -> None:
    streamer = _streamer(2)

    class Failing(RecordingSender):
        def send_layers(self, pages, upto: int, span: LayerSpan) -> None:
            from kvtransfer.base import TransferError

            raise TransferError("peer gone")

    good, bad = RecordingSender(), Failing()
    writes = ForwardWrites(streamer, [_chunk_for(good, 2, room=1), _chunk_for(bad, 2, room=2)])
    for i, group in enumerate(streamer.config.groups):
        writes.on_group(GroupDone(i, group))
    assert good.posts == [(0, 2), (20, 2)] and good.marked == [2]
    assert bad.marked == []
    assert streamer.take_failures() == {2: "KV write failed: peer gone"}
    assert streamer.take_failures() == {}


def test_the_chunk_plan_covers_full_pages_then_the_partial_last_page() -> None:
    """Pages a chunk completes: [next page, last full page); the last chunk adds the partial
    page; a chunk that completes no page streams nothing."""
    dest = RoomDestination(1, "d", "p", tuple(range(5)), 0, 0, prompt_len=70)
    sender = KVSender(None, dest, 16, [])  # type: ignore[arg-type]
    streamer = LayerStreamer(
        StreamConfig(split_layers(4, 2), 10, 16, False, torch.device("cpu")), lambda req: sender
    )
    req = _req("a", 70)
    req.pages = [10, 11, 12, 13, 14]
    assert streamer._chunk(req, 10) is None  # tokens [0, 10): no full page yet
    req.kv_len = 10
    chunk = streamer._chunk(req, 30)  # [10, 40): pages 0, 1 complete
    assert chunk is not None and (sender.next_page, chunk.upto) == (0, 2)
    sender.mark_sent(2)
    req.kv_len = 40
    chunk = streamer._chunk(req, 30)  # [40, 70): the last chunk, pages 2..4 (4 partial)
    assert chunk is not None and chunk.upto == 5
    assert sender.stats.pages == 2


def test_the_prefill_server_builds_its_stream_config_from_the_flag() -> None:
    """cuda_ipc is stream-ordered, the others are not; 0 is off; a TP node is refused."""
    from types import SimpleNamespace

    from kvtransfer.cuda_ipc import CudaIpcEngine
    from kvtransfer.faults import FaultInjectingEngine
    from kvtransfer.mooncake import MooncakeEngine
    from kvtransfer.nixl import NixlEngine
    from prefill_node.server import stream_config

    assert CudaIpcEngine.stream_ordered and not (
        NixlEngine.stream_ordered or MooncakeEngine.stream_ordered
    )
    inner = SimpleNamespace(
        config=None,
        stream_ordered=True,
        notifies_completion=True,
        cheap_poll=False,
        concurrent_writes=True,
    )
    wrapped = FaultInjectingEngine(inner)  # type: ignore[arg-type]
    assert wrapped.stream_ordered  # the fault wrapper says what the engine it wraps does
    assert wrapped.notifies_completion and not wrapped.cheap_poll and wrapped.concurrent_writes
    assert NixlEngine.concurrent_writes and not MooncakeEngine.concurrent_writes

    def parts(groups: int, engine: type[KVTransferEngine], tp: int = 1) -> SimpleNamespace:
        runner = SimpleNamespace(
            model_config=SimpleNamespace(num_layers=LAYERS),
            config=SimpleNamespace(tp_size=tp, kv_staging_pages=0, page_size=PAGE),
            kv_layout=LAYOUT,
            device=torch.device("cpu"),
        )
        args = SimpleNamespace(kv_stream_layers=groups)
        transfer = SimpleNamespace(engine=engine)
        return SimpleNamespace(args=args, runner=runner, transfer=transfer)

    assert stream_config(parts(0, NixlEngine)) is None  # type: ignore[arg-type]
    config = stream_config(parts(2, CudaIpcEngine))  # type: ignore[arg-type]
    assert config is not None and config.stream_ordered and not config.poster
    assert config.groups == (range(0, 3), range(3, 5))
    assert config.layer_page_bytes == 2 * PAGE * DIM * 4
    config = stream_config(parts(2, MooncakeEngine))  # type: ignore[arg-type]
    assert config is not None and not config.stream_ordered and not config.poster
    config = stream_config(parts(2, NixlEngine))  # type: ignore[arg-type]
    assert config is not None and config.poster  # NIXL posts from the poster thread
    with pytest.raises(ValueError, match="needs --tp-size 1"):
        stream_config(parts(2, NixlEngine, tp=2))  # type: ignore[arg-type]
