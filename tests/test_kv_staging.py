"""Staging pages (engine/memory/staging.py): the span allocator's invariant, the gather and
scatter kernels byte for byte on the engine's page layouts, and the whole path (gather ->
one descriptor -> scatter) between two processes through real transfer engines on loopback."""

from __future__ import annotations

import multiprocessing as mp
import random
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing.connection import Connection

import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.memory import IntegrityError, KVLayout, PagedKVCache, PageStager, StagingArea
from engine.memory.staging import StagingSpan, count_runs
from engine.metrics import PrefillMetrics
from engine.request import Req
from engine.sampling import SamplingParams
from kvtransfer import create_engine
from kvtransfer.aux import AuxBuffer
from kvtransfer.base import (
    KVTransferEngine,
    MemoryRegion,
    PeerInfo,
    TransferConfig,
    TransferRange,
    TransferState,
    coalesce_pages,
)
from kvtransfer.head_routes import NodeKV
from kvtransfer.room import RoomDestination
from prefill_node.writes import RoomWriter
from tests.fake_transfer import RecordingEngine, wait_settled

POISON = -7.0


@pytest.fixture(scope="module", autouse=True)
def loopback_ucx() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_NET_DEVICES", "lo")
        yield


# ---- the span allocator ----------------------------------------------------------------------


def test_spans_are_bounded_first_fit_and_merge_when_given_back() -> None:
    area = StagingArea(first_page=100, num_pages=10)
    a, b, c = area.acquire(4), area.acquire(4), area.acquire(2)
    assert (a, b, c) == (StagingSpan(100, 4), StagingSpan(104, 4), StagingSpan(108, 2))
    assert area.acquire(1) is None  # bounded: nothing more until a span comes back
    area.release(b)
    assert area.acquire(5) is None  # 4 free pages, not 5
    area.release(a)
    assert area.acquire(8) == StagingSpan(100, 8)  # a and b merged into one free run
    area.check_integrity()
    assert (area.num_free, area.num_held) == (0, 10)


def test_a_fenced_span_stays_out_of_use_until_its_fence_says_done() -> None:
    area = StagingArea(first_page=8, num_pages=4)
    span = area.acquire(4)
    assert span is not None
    done = [False]
    area.release(span, fence=lambda: done[0])
    assert (area.num_held, area.num_fenced) == (0, 4)
    area.check_integrity()
    assert area.acquire(1) is None  # the scatter kernel may still read it
    done[0] = True
    assert area.acquire(4) == span
    area.check_integrity()


def test_double_release_and_bad_sizes_are_refused() -> None:
    area = StagingArea(first_page=1, num_pages=4)
    span = area.acquire(2)
    assert span is not None
    area.release(span)
    with pytest.raises(IntegrityError, match="not held"):
        area.release(span)
    with pytest.raises(ValueError, match="at least one page"):
        area.acquire(0)
    with pytest.raises(ValueError, match="outside a span"):
        span.ids(1, 3)


def test_random_acquire_and_release_keep_the_invariant() -> None:
    rng = random.Random(3)
    area = StagingArea(first_page=50, num_pages=64)
    held: list[StagingSpan] = []
    fenced: list[list[bool]] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            span = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.3:
                flag = [False]
                fenced.append(flag)
                area.release(span, fence=lambda flag=flag: flag[0])
            else:
                area.release(span)
        else:
            span_or_none = area.acquire(rng.randint(1, 20))
            if span_or_none is not None:
                assert all(
                    span_or_none.start + span_or_none.length <= s.start
                    or s.start + s.length <= span_or_none.start
                    for s in held
                )
                held.append(span_or_none)
        if fenced and rng.random() < 0.2:
            fenced.pop(0)[0] = True
        area.check_integrity()
        assert area.held == frozenset(held)
    for span in held:
        area.release(span)
    for flag in fenced:
        flag[0] = True
    assert area.acquire(64) == StagingSpan(50, 64)  # everything came back, in one run


def test_count_runs_is_the_descriptor_count_of_coalesce_pages() -> None:
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randint(1, 30)
        src = rng.sample(range(100), n)
        dst = sorted(rng.sample(range(100), n)) if rng.random() < 0.5 else rng.sample(range(100), n)
        assert count_runs(src, dst) == len(coalesce_pages(src, dst, 1, 0, 0))
    assert count_runs([3, 4, 5, 9]) == 2


# ---- gather and scatter on the engine's layouts ---------------------------------------------


LAYOUTS = [
    KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, page_size=1, dtype=torch.float32),
    KVLayout(num_layers=3, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32),
    KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=16, dtype=torch.bfloat16),
    # a TP rank's shard: its KV heads alone (SmolLM2's 3 heads split 2 + 1)
    KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float16),
]


def filled_cache(layout: KVLayout, pages: int, staging: int, seed: int) -> PagedKVCache:
    cache = PagedKVCache(layout, pages, torch.device("cpu"), staging_pages=staging)
    gen = torch.Generator().manual_seed(seed)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=gen).to(layout.dtype))
    cache.staging.fill_(POISON)
    return cache


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lo: f"ps{lo.page_size}-h{lo.num_kv_heads}")
def test_gather_then_scatter_moves_exact_pages(layout: KVLayout) -> None:
    rng = random.Random(layout.page_size * 31 + layout.num_kv_heads)
    sender = filled_cache(layout, pages=40, staging=24, seed=1)
    receiver = filled_cache(layout, pages=40, staging=24, seed=2)
    receiver_before = receiver.buffer.clone()
    s_stage = PageStager(sender, min_runs=0)
    r_stage = PageStager(receiver, min_runs=0)
    for _ in range(5):
        n = rng.randint(1, 20)
        src, dst = rng.sample(range(1, 40), n), rng.sample(range(1, 40), n)
        s_span, r_span = s_stage.area.acquire(n), r_stage.area.acquire(n)
        assert s_span is not None and r_span is not None
        split = rng.randint(0, n)  # two chunks, as a prefill's chunks arrive
        s_stage.gather(src[:split], s_span, 0)
        s_stage.gather(src[split:], s_span, split)
        staged = sender.storage[s_span.start : s_span.start + n]
        assert torch.equal(staged, sender.buffer[torch.tensor(src)])
        # the transfer: staging span -> staging span, one contiguous copy
        receiver.storage[r_span.start : r_span.start + n] = staged
        assert r_stage.scatter(r_span, 0, dst) is None  # CPU: done on return
        assert torch.equal(receiver.buffer[torch.tensor(dst)], sender.buffer[torch.tensor(src)])
        untouched = sorted(set(range(40)) - set(dst))
        assert torch.equal(receiver.buffer[untouched], receiver_before[untouched])
        receiver_before = receiver.buffer.clone()
        s_stage.area.release(s_span)
        r_stage.area.release(r_span)
    for stager in (s_stage, r_stage):
        stager.area.check_integrity()
        assert stager.area.num_free == 24


def test_staging_pages_lie_after_the_pool_in_one_registered_allocation() -> None:
    layout = LAYOUTS[2]
    cache = PagedKVCache(layout, 10, torch.device("cpu"), staging_pages=6)
    assert cache.buffer.shape[0] == 10 and cache.staging.shape[0] == 6
    assert cache.staging.data_ptr() == cache.storage.data_ptr() + 10 * layout.page_bytes
    stager = PageStager(cache, min_runs=2)
    assert stager.area.acquire(6) == StagingSpan(10, 6)  # page ids continue the pool's
    assert stager.worth_staging([1, 5, 9]) and not stager.worth_staging([1, 2, 3, 7])
    with pytest.raises(ValueError, match="staging_pages > 0"):
        PageStager(PagedKVCache(layout, 10, torch.device("cpu")), min_runs=2)


# ---- the whole path between two processes through a real engine ----------------------------


LOOP_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, page_size=16, dtype=torch.float32)
POOL, STAGING = 48, 32


def registered_engine(
    backend: str, node_name: str, cache: PagedKVCache
) -> tuple[KVTransferEngine, MemoryRegion]:
    """A transfer engine with the cache's storage registered as the region "kv"."""
    engine = create_engine(TransferConfig(backend=backend, node_name=node_name))
    storage = cache.storage
    region = MemoryRegion("kv", storage.data_ptr(), storage.numel() * storage.element_size())
    engine.register([region])
    return engine, region


def receiver_main(backend: str, conn: Connection) -> None:
    """The decode side: a pool with staging pages; scatters a span into pages on request."""
    cache = filled_cache(LOOP_LAYOUT, POOL, STAGING, seed=99)
    stager = PageStager(cache, min_runs=0)
    engine, region = registered_engine(backend, f"staging-d-{backend}", cache)
    conn.send((engine.local_endpoint(), region))
    while (command := conn.recv()) is not None:
        n, dst = command
        span = stager.area.acquire(n)
        assert span is not None
        conn.send(span)
        conn.recv()  # the sender's DONE
        stager.scatter(span, 0, dst)
        stager.area.release(span)
        stager.area.check_integrity()
        conn.send(cache.buffer.clone())
    engine.close()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_scattered_pages_move_as_one_descriptor_through_a_real_engine(backend: str) -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, args=(backend, there), daemon=True)
    proc.start()
    engine = None
    try:
        assert here.poll(60), f"receiver did not start (exit code {proc.exitcode})"
        endpoint, remote = here.recv()
        sender = filled_cache(LOOP_LAYOUT, POOL, STAGING, seed=1)
        stager = PageStager(sender, min_runs=0)
        engine, local = registered_engine(backend, f"staging-p-{backend}", sender)
        engine.connect(PeerInfo("decode", endpoint, {"kv": remote}))
        rng = random.Random(7)
        before = None
        for n in (1, 17, 32):
            src, dst = rng.sample(range(1, POOL), n), rng.sample(range(1, POOL), n)
            here.send((n, dst))
            r_span = here.recv()
            s_span = stager.area.acquire(n)
            assert s_span is not None
            stager.gather(src, s_span, 0)
            ranges = coalesce_pages(
                s_span.ids(0, n), r_span.ids(0, n), LOOP_LAYOUT.page_bytes, local.addr, remote.addr
            )
            assert ranges == [
                TransferRange(
                    local.addr + s_span.start * LOOP_LAYOUT.page_bytes,
                    remote.addr + r_span.start * LOOP_LAYOUT.page_bytes,
                    n * LOOP_LAYOUT.page_bytes,
                )
            ]
            handle = engine.write("decode", ranges)
            assert wait_settled(engine, handle) is TransferState.DONE
            engine.release(handle)
            stager.area.release(s_span)
            here.send("done")
            pool = here.recv()
            assert torch.equal(pool[torch.tensor(dst)], sender.buffer[torch.tensor(src)])
            if before is not None:
                untouched = sorted(set(range(POOL)) - set(dst))
                assert torch.equal(pool[untouched], before[untouched])
            before = pool
        here.send(None)
        proc.join(30)
        assert proc.exitcode == 0
        stager.area.check_integrity()
        assert stager.area.num_free == STAGING
    finally:
        if engine is not None:
            engine.close()
        if proc.is_alive():
            proc.kill()


# ---- the prefill node's writer: which writes it stages --------------------------------------


class OnePeerLink:
    def __init__(self, peer: PeerInfo) -> None:
        self._peer = peer

    def peer(self, node_id: str) -> PeerInfo | None:
        return self._peer


def test_the_writer_gathers_scattered_chunks_and_writes_one_descriptor_each() -> None:
    layout = LAYOUTS[1]  # 4-token pages
    cache = filled_cache(layout, pages=64, staging=16, seed=4)
    stager = PageStager(cache, min_runs=2)
    engine = RecordingEngine()
    base, pb = cache.storage.data_ptr(), layout.page_bytes
    aux = AuxBuffer(4)
    peer = PeerInfo(
        "d", b"", {"kv": MemoryRegion("kv", 1 << 40, 1 << 30), "aux": MemoryRegion("aux", 0, 1)}
    )
    kv = NodeKV.single(base, layout.head_page_bytes, layout.num_kv_heads)
    registry = CollectorRegistry()
    link = OnePeerLink(peer)
    writer = RoomWriter(engine, aux, kv, layout.page_size, link, stager, PrefillMetrics(registry))  # type: ignore[arg-type]
    dest_pages = tuple(range(100, 110))  # D staged: its pages are one run
    dest = RoomDestination(1, "d", "p", dest_pages, 0, 0, prompt_len=40)
    sender = writer.open(dest)
    req = Req(rid="r", prompt_ids=list(range(40)), params=SamplingParams(), sampler=None)  # type: ignore[arg-type]
    req.pages = [9, 3, 30, 31, 32, 33, 50, 7, 21, 22]  # 10 pages: 6 runs
    req.kv_len = 16  # chunk 1: pages 0-3 are 3 runs (> 2): gathered
    writer.send_computed(req, sender)
    span = req.staging
    assert span is not None and span.length == 10  # for the whole prompt
    assert engine.writes[-1] == [
        TransferRange(base + span.start * pb, (1 << 40) + 100 * pb, 4 * pb)
    ]
    req.kv_len = 24  # chunk 2: pages 4-5 (32, 33) are one run: written from the pool
    writer.send_computed(req, sender)
    assert engine.writes[-1] == [TransferRange(base + 32 * pb, (1 << 40) + 104 * pb, 2 * pb)]
    req.kv_len = 40  # last chunk: pages 6-9 (50, 7, 21, 22): 3 runs, gathered at offset 6
    writer.send_computed(req, sender)
    assert engine.writes[-1] == [
        TransferRange(base + (span.start + 6) * pb, (1 << 40) + 106 * pb, 4 * pb)
    ]
    staged = cache.storage[span.start : span.start + 10]
    gathered = [0, 1, 2, 3, 6, 7, 8, 9]
    assert torch.equal(staged[gathered], cache.buffer[[req.pages[i] for i in gathered]])
    assert registry.get_sample_value("pdserve_prefill_staged_pages_total") == 8
    assert sender.poll() is TransferState.DONE
    writer.release_staging(req)
    assert req.staging is None and stager.area.num_free == 16
    stager.area.check_integrity()
    # every span taken: the next room writes from its pool pages, and the metric says so
    hog = stager.area.acquire(16)
    other = Req(rid="o", prompt_ids=list(range(40)), params=SamplingParams(), sampler=None)  # type: ignore[arg-type]
    other.pages, other.kv_len = list(req.pages), 40
    writer.send_computed(other, writer.open(replace(dest, room=2)))
    assert other.staging is None and len(engine.writes[-1]) == 6  # its 6 runs
    assert registry.get_sample_value("pdserve_prefill_staging_full_total") == 1
    assert hog is not None
