"""KV transfer backends with real engines over loopback: a target process owns the destination.

The target (spawned) registers a byte buffer, sends back its endpoint and region, then answers
typed commands (fill, read, stop). The initiator lives in the test process. Every backend runs
the same cases; `coalesce_pages` has its own engine-free tests.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import pytest

from kvtransfer import create_engine
from kvtransfer.base import (
    KVTransferEngine,
    MemoryRegion,
    PeerInfo,
    RangeColumns,
    TransferConfig,
    TransferError,
    TransferRange,
    TransferState,
    coalesce_pages,
)
from kvtransfer.head_routes import RankKV, plan_routes
from kvtransfer.room import RoomDestination
from kvtransfer.sender import KVSender, page_runs
from tests.fake_transfer import wait_settled

BACKENDS = ["mooncake", "nixl"]
BUFFER_BYTES = 32 << 20
PAGE = 4096
SENTINEL = 0xA5


@pytest.fixture(scope="module", autouse=True)
def loopback_ucx() -> Iterator[None]:
    """UCX on loopback: keep it off the host's other interfaces (spawned targets inherit it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_NET_DEVICES", "lo")
        yield


@dataclass(frozen=True)
class Fill:
    value: int


@dataclass(frozen=True)
class ReadAll:
    pass


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class TargetReady:
    endpoint: bytes
    region: MemoryRegion


def target_main(backend: str, node_name: str, conn: Connection) -> None:
    engine = create_engine(TransferConfig(backend=backend, node_name=node_name))
    buffer = np.full(BUFFER_BYTES, SENTINEL, dtype=np.uint8)
    region = MemoryRegion("kv", buffer.ctypes.data, buffer.nbytes)
    engine.register([region])
    conn.send(TargetReady(engine.local_endpoint(), region))
    while True:
        command = conn.recv()
        if isinstance(command, Fill):
            buffer[:] = command.value
            conn.send(True)
        elif isinstance(command, ReadAll):
            conn.send(buffer.tobytes())
        elif isinstance(command, Stop):
            break
    engine.close()
    conn.send(True)


@dataclass
class Target:
    process: mp.process.BaseProcess
    conn: Connection
    peer: PeerInfo

    @property
    def region(self) -> MemoryRegion:
        return self.peer.regions["kv"]

    def ask(self, command: object, timeout: float = 30.0) -> object:
        self.conn.send(command)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"target {self.peer.node_id} did not answer {command}")
        return self.conn.recv()

    def read(self) -> np.ndarray:
        payload = self.ask(ReadAll())
        assert isinstance(payload, bytes)
        return np.frombuffer(payload, dtype=np.uint8)

    def stop(self) -> None:
        """Stop the target; it must exit cleanly (NIXL's UCX once crashed every process at exit)."""
        self.ask(Stop())
        self.process.join(30)
        assert self.process.exitcode == 0, f"target exited with {self.process.exitcode}"


@dataclass
class StartingTarget:
    """A spawned target that may still be importing (NIXL pulls in torch: seconds)."""

    node_id: str
    process: mp.process.BaseProcess
    conn: Connection

    def ready(self, timeout: float = 60.0) -> Target:
        if not self.conn.poll(timeout):
            self.process.kill()
            raise TimeoutError(f"target {self.node_id} did not start in {timeout} s")
        ready: TargetReady = self.conn.recv()
        peer = PeerInfo(self.node_id, ready.endpoint, {"kv": ready.region})
        return Target(self.process, self.conn, peer)


def spawn_target(backend: str, node_id: str) -> StartingTarget:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target_main, args=(backend, node_id, child), daemon=True)
    process.start()
    return StartingTarget(node_id, process, parent)


@dataclass
class Initiator:
    engine: KVTransferEngine
    buffer: np.ndarray

    @property
    def base(self) -> int:
        return int(self.buffer.ctypes.data)


def make_initiator(backend: str, node_name: str) -> Initiator:
    engine = create_engine(TransferConfig(backend=backend, node_name=node_name))
    buffer = np.random.default_rng(7).integers(0, 256, BUFFER_BYTES, dtype=np.uint8)
    engine.register([MemoryRegion("kv", buffer.ctypes.data, buffer.nbytes)])
    return Initiator(engine, buffer)


@dataclass
class Loopback:
    initiator: Initiator
    target: Target
    doomed: StartingTarget  # for the dead-peer case, started early so that it is ready


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Loopback]:
    backend = request.param
    starting = spawn_target(backend, f"{backend}-target-{os.getpid()}")
    doomed = spawn_target(backend, f"{backend}-doomed-{os.getpid()}")
    initiator = make_initiator(backend, f"{backend}-initiator-{os.getpid()}")
    target = starting.ready()
    initiator.engine.connect(target.peer)
    initiator.engine.connect(target.peer)  # idempotent
    yield Loopback(initiator, target, doomed)
    initiator.engine.close()
    target.stop()
    doomed.process.kill()


def write_and_wait(initiator: Initiator, target: Target, ranges: Sequence[TransferRange]) -> None:
    assert target.ask(Fill(SENTINEL))
    handle = initiator.engine.write(target.peer.node_id, ranges)
    assert wait_settled(initiator.engine, handle) is TransferState.DONE
    initiator.engine.release(handle)


def test_large_contiguous_write(pair: Loopback) -> None:
    initiator, target = pair.initiator, pair.target
    length, src_off, dst_off = 16 << 20, 4096, 8 << 20
    ranges = [TransferRange(initiator.base + src_off, target.region.addr + dst_off, length)]
    write_and_wait(initiator, target, ranges)
    dst = target.read()
    assert np.array_equal(dst[dst_off : dst_off + length], initiator.buffer[src_off:][:length])
    assert (dst[:dst_off] == SENTINEL).all()
    assert (dst[dst_off + length :] == SENTINEL).all()


def scattered_mapping(num_pages: int, pool_pages: int, seed: int) -> list[int]:
    """Destination pages for source pages 0..n-1: runs of 1-16 pages at shuffled places."""
    rng = np.random.default_rng(seed)
    runs: list[int] = []
    while sum(runs) < num_pages:
        runs.append(min(int(rng.integers(1, 17)), num_pages - sum(runs)))
    slot = pool_pages // len(runs)  # each run gets its own slot, so runs never overlap
    assert slot >= 16
    dst: list[int] = []
    for run, place in zip(runs, rng.permutation(len(runs)), strict=True):
        first = int(place) * slot + int(rng.integers(0, slot - run + 1))
        dst.extend(range(first, first + run))
    return dst


@pytest.mark.parametrize("form", ["coalesced", "one-per-page", "columns"])
def test_scattered_pages(pair: Loopback, form: str) -> None:
    """Also as RangeColumns, the form of a layer group's write (one range per page and head)."""
    initiator, target = pair.initiator, pair.target
    num_pages = 3000
    dst_pages = scattered_mapping(num_pages, BUFFER_BYTES // PAGE, seed=3)
    src_pages = list(range(num_pages))
    dst_base = target.region.addr
    ranges: Sequence[TransferRange]
    if form == "coalesced":
        ranges = coalesce_pages(src_pages, dst_pages, PAGE, initiator.base, dst_base)
        assert len(ranges) < num_pages // 4
    elif form == "columns":
        columns = np.stack(
            [
                initiator.base + np.array(src_pages) * PAGE,
                dst_base + np.array(dst_pages) * PAGE,
                np.full(num_pages, PAGE),
            ]
        )
        ranges = RangeColumns(columns.astype(np.int64))
    else:
        ranges = [
            TransferRange(initiator.base + s * PAGE, dst_base + d * PAGE, PAGE)
            for s, d in zip(src_pages, dst_pages, strict=True)
        ]
    write_and_wait(initiator, target, ranges)
    dst = target.read().reshape(-1, PAGE)
    src = initiator.buffer.reshape(-1, PAGE)
    assert np.array_equal(dst[dst_pages], src[src_pages])
    untouched = np.ones(len(dst), dtype=bool)
    untouched[dst_pages] = False
    assert (dst[untouched] == SENTINEL).all()


def test_concurrent_writes_to_one_peer(pair: Loopback) -> None:
    """4 x 1000 one-page descriptors in flight at once: over Mooncake's default per-peer cap."""
    initiator, target = pair.initiator, pair.target
    assert target.ask(Fill(SENTINEL))
    writes, pages = 4, 1000
    handles = [
        initiator.engine.write(
            target.peer.node_id,
            [
                TransferRange(initiator.base + p * PAGE, target.region.addr + p * PAGE, PAGE)
                for p in range(w * pages, (w + 1) * pages)
            ],
        )
        for w in range(writes)
    ]
    for handle in handles:
        assert wait_settled(initiator.engine, handle) is TransferState.DONE
        initiator.engine.release(handle)
    written = writes * pages * PAGE
    dst = target.read()
    assert np.array_equal(dst[:written], initiator.buffer[:written])
    assert (dst[written:] == SENTINEL).all()


def test_an_engine_that_notifies_calls_back_once_a_write_ended(pair: Loopback) -> None:
    """A prefill node's loop waits for this callback instead of polling every 50 us."""
    initiator, target = pair.initiator, pair.target
    engine = initiator.engine
    if not engine.notifies_completion:
        pytest.skip(f"{engine.name} writes are polled (no completion callback)")
    ended = threading.Semaphore(0)
    engine.bind_completion(ended.release)
    try:
        assert target.ask(Fill(SENTINEL))
        length = 4 << 20
        handle = engine.write(
            target.peer.node_id, [TransferRange(initiator.base, target.region.addr, length)]
        )
        assert ended.acquire(timeout=30), "no completion callback within 30 s"
        assert engine.poll(handle) is TransferState.DONE  # the callback came after the end
        engine.release(handle)
        assert np.array_equal(target.read()[:length], initiator.buffer[:length])
    finally:
        engine.bind_completion(lambda: None)


def test_write_outside_peer_region_fails(pair: Loopback) -> None:
    initiator, target = pair.initiator, pair.target
    beyond = target.region.addr + target.region.length
    try:
        handle = initiator.engine.write(
            target.peer.node_id, [TransferRange(initiator.base, beyond, PAGE)]
        )
        state = wait_settled(initiator.engine, handle)
        initiator.engine.release(handle)
    except TransferError as exc:
        assert target.peer.node_id in str(exc)
        state = TransferState.FAILED
    assert state is TransferState.FAILED


def test_write_to_unconnected_peer_names_it(pair: Loopback) -> None:
    initiator = pair.initiator
    with pytest.raises(TransferError, match="never-connected-node"):
        initiator.engine.write(
            "never-connected-node", [TransferRange(initiator.base, 0x1000, PAGE)]
        )


def test_write_to_dead_peer_fails_in_bounded_time(pair: Loopback) -> None:
    initiator, live = pair.initiator, pair.target
    doomed = pair.doomed.ready()
    try:
        initiator.engine.connect(doomed.peer)
        ranges = [TransferRange(initiator.base, doomed.region.addr, 1 << 20)]
        handle = initiator.engine.write(doomed.peer.node_id, ranges)  # opens the connection
        assert wait_settled(initiator.engine, handle) is TransferState.DONE
        initiator.engine.release(handle)
        doomed.process.kill()
        doomed.process.join(10)
        started = time.monotonic()
        try:
            handle = initiator.engine.write(doomed.peer.node_id, ranges)
            state = wait_settled(initiator.engine, handle, timeout=40)
            initiator.engine.release(handle)
        except TransferError as exc:
            assert doomed.peer.node_id in str(exc)
            state = TransferState.FAILED
        assert state is TransferState.FAILED
        assert time.monotonic() - started < 40
    finally:
        doomed.process.kill()
    # The engine still serves its live peers.
    write_and_wait(initiator, live, [TransferRange(initiator.base, live.region.addr, 1 << 20)])
    assert np.array_equal(live.read()[: 1 << 20], initiator.buffer[: 1 << 20])


def test_mooncake_rdma_without_devices_is_refused() -> None:
    config = TransferConfig(
        backend="mooncake", node_name="rdma-probe", protocol="rdma", device_names="no_such_hca"
    )
    with pytest.raises(TransferError, match="no RDMA device matched 'no_such_hca'"):
        create_engine(config)


def test_coalesce_pages_merges_runs_contiguous_on_both_sides() -> None:
    ranges = coalesce_pages([0, 1, 2, 5, 6, 9], [10, 11, 3, 4, 5, 0], 100, 1000, 5000)
    assert ranges == [
        TransferRange(1000, 6000, 200),  # pages 0-1 -> 10-11
        TransferRange(1200, 5300, 100),  # page 2 -> 3: source run continues, destination breaks
        TransferRange(1500, 5400, 200),  # pages 5-6 -> 4-5
        TransferRange(1900, 5000, 100),
    ]


def test_coalesce_pages_edge_cases() -> None:
    assert coalesce_pages([], [], 64, 0, 0) == []
    assert coalesce_pages(list(range(8)), list(range(8, 16)), 64, 0, 0) == [
        TransferRange(0, 512, 512)
    ]
    descending = coalesce_pages([3, 2, 1], [3, 2, 1], 64, 0, 0)
    assert [r.length for r in descending] == [64, 64, 64]


def test_coalesce_pages_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="3 source pages but 2 destination pages"):
        coalesce_pages([0, 1, 2], [0, 1], 64, 0, 0)


class _RecordingEngine:
    """What a sender asks of its engine: `write` ranges or `write_pages` page ids."""

    def __init__(self) -> None:
        self.writes: list[list[TransferRange]] = []
        self.page_writes: list[tuple[str, list[int], list[int], int, int, int]] = []

    def write(self, peer_id: str, ranges: list[TransferRange]) -> int:
        self.writes.append(list(ranges))
        return len(self.writes)

    def write_pages(self, peer_id, src, dst, page_bytes, src_base, dst_base) -> int:  # type: ignore[no-untyped-def]
        self.page_writes.append((peer_id, list(src), list(dst), page_bytes, src_base, dst_base))
        return -len(self.page_writes)


def test_sender_writes_whole_pages_by_page_ids_and_head_runs_by_ranges() -> None:
    """One rank each side: the pages go by ids (no range per page), counted as coalesce_pages'
    runs; a decode node of another TP size gets the head routes' ranges."""
    heads, hpb, page = 4, 256, 1024
    prefill = [RankKV(0, "p", 1 << 20, range(heads), hpb)]
    dest = RoomDestination(1, "d", "p", (7, 8, 9, 30), 0, 0, prompt_len=4 * 16)
    engine = _RecordingEngine()
    decode = [RankKV(0, "d", 1 << 30, range(heads), hpb)]
    one = KVSender(engine, dest, 16, plan_routes(prefill, decode))  # type: ignore[arg-type]
    one.send_pages([3, 4, 5, 6], 4)
    assert engine.page_writes == [("d", [3, 4, 5, 6], [7, 8, 9, 30], page, 1 << 20, 1 << 30)]
    assert engine.writes == []
    assert (one.stats.pages, one.stats.descriptors, one.stats.bytes) == (4, 2, 4 * page)
    assert one.stats.page_id_writes == 1
    assert page_runs([3, 4, 5, 6], [7, 8, 9, 30]) == len(
        coalesce_pages([3, 4, 5, 6], [7, 8, 9, 30], 1, 0, 0)
    )

    two_ranks = [
        RankKV(0, "d", 1 << 30, range(2), hpb),
        RankKV(1, "d#1", 1 << 31, range(2, 4), hpb),
    ]
    engine = _RecordingEngine()
    split = KVSender(engine, dest, 16, plan_routes(prefill, two_ranks))  # type: ignore[arg-type]
    split.send_pages([3, 4, 5, 6], 4)
    assert engine.page_writes == [] and len(engine.writes) == 2
    assert split.stats.descriptors == 8  # a range per page and decode rank
    assert split.stats.page_id_writes == 0
