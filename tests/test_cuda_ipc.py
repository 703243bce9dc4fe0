"""The `cuda_ipc` transfer backend: its kernel, its plans, its endpoint and its refusals.

On a CPU: the copy kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`, in a child
process: the switch is read when a kernel is decorated) on CPU tensors and must move exactly the
pages torch indexing moves (scattered whole pages, partial pages, runs of heads, suffixes); the
chunk planning, the endpoint encoding and every refusal are plain Python; the aux path
(`process_vm_writev`) writes into a real second process. With a CUDA GPU, two processes move
scattered pages and an aux slot through the engine itself, byte for byte.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtransfer import create_engine
from kvtransfer.base import (
    MemoryRegion,
    PeerInfo,
    RangeColumns,
    TransferConfig,
    TransferError,
    TransferRange,
    TransferState,
    coalesce_pages,
    columns_of,
)
from kvtransfer.cuda_ipc_plan import (
    BACKEND_FLAG,
    MAX_CHUNK_BYTES,
    CopyPlan,
    ExportedRegion,
    IpcEndpoint,
    check_registrable,
    chunk_size,
    group_ranges,
    plan_columns,
    plan_copy,
    plan_pages,
    split_rows,
)
from kvtransfer.process_memory import (
    ProcessMemoryError,
    write_process_memory,
)
from tests.fake_transfer import RecordingEngine
from tests.triton_interpreter import interpret

REPO = Path(__file__).resolve().parents[1]

# Runs in a child with TRITON_INTERPRET=1. Each case: a source and a poisoned destination pool
# of `pages` pages of `page_bytes`, the ranges of a write, the expected destination built with
# torch indexing from the same ranges, and the kernel's result compared byte for byte.
KERNEL_CASES = textwrap.dedent(
    """
    import random
    import torch
    from kvtransfer.base import coalesce_pages
    from kvtransfer.cuda_ipc_kernel import WORD_DTYPES, copy_rows
    from kvtransfer.cuda_ipc_plan import plan_copy
    from kvtransfer.head_routes import RankKV, plan_routes, route_pages

    def run(name, src, dst, ranges, max_chunk, max_piece=1 << 20):
        expected = dst.clone()
        for s, d, n in ranges:
            expected[d : d + n] = src[s : s + n]
        plan = plan_copy(ranges, max_chunk=max_chunk, max_piece=max_piece)
        word = WORD_DTYPES[plan.word_bytes]
        copy_rows(src.view(word), dst.view(word), torch.from_numpy(plan.rows),
                  plan.chunk_words, plan.max_chunks)
        assert torch.equal(dst, expected), name
        print(name, plan.num_rows, plan.chunk_bytes)

    rng = random.Random(3)
    page, pages = 1024, 48
    src = torch.randint(0, 256, (pages * page,), dtype=torch.uint8)
    def poisoned():
        return torch.full((pages * page,), 0xA5, dtype=torch.uint8)

    s_pages, d_pages = rng.sample(range(pages), 20), rng.sample(range(pages), 20)
    scattered = [(r.src_addr, r.dst_addr, r.length)
                 for r in coalesce_pages(s_pages, d_pages, page, 0, 0)]
    run("scattered pages", src, poisoned(), scattered, 256)
    runs = [(r.src_addr, r.dst_addr, r.length)
            for r in coalesce_pages(list(range(4, 12)), [30, 31, 32, 2, 3, 40, 41, 42], page, 0, 0)]
    run("runs of pages, big chunks", src, poisoned(), runs, 4096)
    run("long runs cut into pieces", src, poisoned(), runs, 256, max_piece=1024)
    run("suffix only (pages 5.. of a prompt)", src, poisoned(), scattered[5:], 256)
    run("odd bytes (1-byte words)", src, poisoned(), [(3, 1001, 77), (2000, 5, 9)], 256)
    run("2-byte words", src, poisoned(), [(2, 4094, 6), (100, 200, 30)], 256)
    # TP 2 -> 1 with 4 KV heads: one range per (page, run of heads) from each prefill rank
    head = page // 4
    prefill = [RankKV(0, "", 0, range(0, 2), head), RankKV(1, "", 0, range(2, 4), head)]
    decode = [RankKV(0, "d", 0, range(0, 4), head)]
    plan = route_pages(plan_routes(prefill, decode), s_pages[:6], d_pages[:6])
    dst = poisoned()
    for rank, by_peer in sorted(plan.items()):
        rank_src = torch.randint(0, 256, (pages * page // 2,), dtype=torch.uint8)
        rows = [(r.src_addr, r.dst_addr, r.length) for r in by_peer["d"]]
        run(f"tp 2->1 head routes, rank {rank}", rank_src, dst, rows, 256)
    """
)


def test_kernel_moves_what_torch_indexing_moves_under_the_interpreter() -> None:
    stdout = interpret(KERNEL_CASES, timeout=240)
    lines = stdout.splitlines()
    assert len(lines) == 8, stdout
    assert lines[0].startswith("scattered pages") and lines[0].endswith(" 256")
    assert lines[1].split()[-2:] == ["3", "1024"]  # 3 runs of 1 KiB pages, chunk = a page
    assert lines[2].split()[-2:] == ["8", "256"]  # the same runs cut into 1 KiB pieces


def test_kernel_compiles_for_hopper_with_128_bit_loads_and_stores() -> None:
    """No GPU needed: Triton lowers the kernel to sm_90 PTX and a cubin with its bundled
    ptxas. 16 KiB chunks of 8-byte words, 16-byte aligned, 4 KiB steps over 256 threads: every
    copy is a v2.b64 load and store (4 steps x 1 per thread); only the row's three words are
    scalar loads."""
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvtransfer.cuda_ipc_kernel import MAX_BLOCK_BYTES, NUM_WARPS, _copy_rows_kernel

    pointers = ("src", "dst", "rows")
    source = ASTSource(
        fn=_copy_rows_kernel,
        signature={**dict.fromkeys(pointers, "*i64"), "CHUNK": "constexpr", "BLOCK": "constexpr"},
        constexprs={"CHUNK": MAX_CHUNK_BYTES // 8, "BLOCK": MAX_BLOCK_BYTES // 8},
        attrs={(i,): [["tt.divisibility", 16]] for i in range(len(pointers))},
    )
    target = GPUTarget("cuda", 90, 32)
    kernel = triton.compile(source, target=target, options={"num_warps": NUM_WARPS})
    ptx = kernel.asm["ptx"]
    steps = MAX_CHUNK_BYTES // MAX_BLOCK_BYTES
    assert ptx.count("st.global.v2.b64") == steps and ptx.count("ld.global.v2.b64") == steps
    assert ptx.count("ld.global.b64") == 3 and ptx.count("st.global") == steps
    assert len(kernel.asm["cubin"]) > 0


def test_device_pointer_is_specialised_like_a_tensor() -> None:
    """The peer's mapped pool reaches the kernel as a DevicePointer (no torch tensor): Triton
    must see a 16-byte-aligned int64 pointer, as for a tensor, or it would not vectorise."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    from triton.backends.nvidia.compiler import CUDABackend

    from kvtransfer.cuda_ipc_kernel import DevicePointer

    def spec(arg: object) -> tuple[str, str]:
        return tuple(libtriton.native_specialize_impl(CUDABackend, arg, False, True, True))

    assert spec(DevicePointer(1 << 40, torch.int64)) == ("*i64", "D")
    assert spec(DevicePointer((1 << 40) + 8, torch.int64)) == ("*i64", "")
    assert spec(DevicePointer(1 << 40, torch.int64)) == spec(torch.zeros(2, dtype=torch.int64))


def test_chunk_size_divides_every_offset_and_length() -> None:
    assert chunk_size([2 << 20, 4 << 20]) == MAX_CHUNK_BYTES
    assert chunk_size([4096, 12288, 8192], max_chunk=1 << 20) == 4096
    assert chunk_size([48, 16]) == 16
    assert chunk_size([3, 8]) == 1
    assert chunk_size([]) == MAX_CHUNK_BYTES
    with pytest.raises(ValueError, match="power of two"):
        chunk_size([8], max_chunk=24)


def test_plan_copy_gives_one_row_of_chunks_a_range() -> None:
    plan = plan_copy([(0, 4096, 8192), (16384, 0, 4096)], max_chunk=4096)
    assert plan.chunk_bytes == 4096 and plan.word_bytes == 8 and plan.chunk_words == 512
    assert plan.rows.tolist() == [[0, 1, 2], [4, 0, 1]]  # in chunks: offsets and lengths
    assert plan.nbytes == 12288 and plan.max_chunks == 2
    # a base address only 4-byte aligned makes 4-byte words, the chunks stay as large
    odd_base = plan_copy([(0, 0, 64)], align=(0x1000, 0x1004))
    assert (odd_base.chunk_bytes, odd_base.word_bytes) == (64, 4)
    assert plan_copy([(0, 0, 4096)], align=(0x7F00_0000_0200,)).word_bytes == 8
    assert plan_copy([], max_chunk=64).num_rows == 0
    with pytest.raises(ValueError, match="positive lengths"):
        plan_copy([(0, 0, 0)])


def test_plan_copy_cuts_long_ranges_into_pieces() -> None:
    """A grid is (longest row's chunks x rows): a long range beside short ones is cut so that
    few programs have nothing to do."""
    plan = plan_copy([(0, 1 << 20, 10 << 10), (64 << 10, 0, 4 << 10)], max_chunk=2048,
                     max_piece=4096)  # fmt: skip
    assert plan.rows.tolist() == [[0, 512, 2], [2, 514, 2], [4, 516, 1], [32, 0, 2]]
    assert plan.max_chunks == 2 and plan.nbytes == 14 << 10


def test_plan_copy_of_256_scattered_2mib_pages_is_a_row_a_page() -> None:
    page = 2 << 20
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(1024)[:256].tolist(), rng.permutation(1024)[:256].tolist()
    ranges = coalesce_pages(src, dst, page, 0, 0)
    plan = plan_copy([(r.src_addr, r.dst_addr, r.length) for r in ranges])
    per_page = page // MAX_CHUNK_BYTES
    assert plan.num_rows == 256 and plan.nbytes == 256 * page and plan.max_chunks == per_page
    assert (plan.rows[:, 0] // per_page).tolist() == src
    assert (plan.rows[:, 1] // per_page).tolist() == dst


# --- the vectorised checks and plans against the per-range reference ---------------------------
# The first version of the backend checked and planned a write range by range; these are that
# logic, kept as the reference the vectorised code (bounds, columns, page ids) must agree with
# on random writes, refusals included.


def reference_group(
    ranges: list[TransferRange], local: tuple[ExportedRegion, ...], peer: IpcEndpoint
) -> dict[tuple[int, int], list[tuple[int, int, int]]] | str:
    """Per range: the regions holding it on both sides, GPU to GPU or CPU to CPU; the groups
    in order, or why the first bad range is refused ("outside" or "crossing")."""
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for r in ranges:
        li = next((i for i, g in enumerate(local) if g.contains(r.src_addr, r.length)), None)
        pi = next((i for i, g in enumerate(peer.regions) if g.contains(r.dst_addr, r.length)),
                  None)  # fmt: skip
        if li is None or pi is None:
            return "outside"
        if local[li].on_gpu != peer.regions[pi].on_gpu:
            return "crossing"
        groups.setdefault((li, pi), []).append((r.src_addr, r.dst_addr, r.length))
    return groups


def reference_plan_copy(
    ranges: list[tuple[int, int, int]], align: tuple[int, ...], max_chunk: int, max_piece: int
) -> tuple[int, int, list[list[int]]]:
    """(chunk, word, rows) as plan_copy made them before the column form."""
    rows = np.asarray(ranges, dtype=np.int64).reshape(-1, 3)
    if (rows[:, 2] <= 0).any() or (rows[:, :2] < 0).any():
        raise ValueError("ranges need non-negative offsets and positive lengths")
    chunk = chunk_size(rows.ravel(), max_chunk)
    word = chunk_size([chunk, *align], max_chunk=8)
    piece = max(max_piece - max_piece % chunk, chunk)
    if len(rows) and rows[:, 2].max() > piece:
        rows = split_rows(rows, piece)
    return chunk, word, (rows // chunk).tolist()


def apply_rows(src: np.ndarray, dst: np.ndarray, plan: CopyPlan) -> None:
    """What the kernel does with a plan, in numpy (offsets from the regions' starts)."""
    c = plan.chunk_bytes
    for s, d, n in plan.rows.tolist():
        dst[d * c : (d + n) * c] = src[s * c : (s + n) * c]


GPU0, GPU1, CPU = "cuda:0", "cuda:1", "cpu"
POOLS = {  # synthetic address spaces: (local regions, peer regions), none overlapping
    "one pool each": (
        (ExportedRegion("kv", 0x10_0000, 64 << 10, GPU0), ExportedRegion("aux", 0x2000, 512, CPU)),
        (ExportedRegion("kv", 0x40_0000, 48 << 10, GPU1), ExportedRegion("aux", 0x9000, 512, CPU)),
    ),
    "two peer pools": (
        (ExportedRegion("kv", 0x10_0400, 64 << 10, GPU0),),
        (ExportedRegion("kv", 0x40_0000, 32 << 10, GPU0),
         ExportedRegion("staging", 0x50_0000, 16 << 10, GPU0)),
    ),
}  # fmt: skip


def random_ranges(rng: np.random.Generator, local: tuple, peer: tuple) -> list[TransferRange]:
    """Pages of one pool into another (some odd pieces, some aux slots, now and then into a
    second pool); in one write of six a range past a region's end, before its start, or from
    GPU memory into CPU memory."""
    page = int(rng.choice([256, 1024]))
    gpu_peer = [r for r in peer if r.on_gpu]
    n = int(rng.integers(1, 24))
    kinds = rng.choice(["page", "odd", "aux"], n, p=[0.9, 0.05, 0.05]).tolist()
    if rng.random() < 1 / 6:
        kinds[int(rng.integers(n))] = str(rng.choice(["past", "before", "cross"]))
    out = []
    usual = gpu_peer[int(rng.integers(len(gpu_peer)))]  # the write's pool; now and then another
    for kind in kinds:
        src_r = local[0]
        dst_r = usual if rng.random() < 0.95 else gpu_peer[int(rng.integers(len(gpu_peer)))]
        if kind == "aux" and not local[-1].on_gpu and not peer[-1].on_gpu:
            src_r, dst_r = local[-1], peer[-1]
        if kind == "cross":
            dst_r = peer[-1] if not peer[-1].on_gpu else dst_r
            src_r = local[-1] if peer[-1].on_gpu and not local[-1].on_gpu else src_r
        length = min(page if kind != "odd" else int(rng.integers(1, 300)), src_r.length,
                     dst_r.length)  # fmt: skip
        s = src_r.addr + int(rng.integers(0, (src_r.length - length) // page + 1)) * page
        d = dst_r.addr + int(rng.integers(0, (dst_r.length - length) // page + 1)) * page
        if kind == "odd":
            s = src_r.addr + int(rng.integers(0, src_r.length - length + 1))
            d = dst_r.addr + int(rng.integers(0, dst_r.length - length + 1))
        if kind == "past":
            d = dst_r.addr + dst_r.length - length + int(rng.integers(1, 64))
        if kind == "before":
            s = src_r.addr - int(rng.integers(1, 64))
        out.append(TransferRange(s, d, length))
    return out


@pytest.mark.parametrize("pools", sorted(POOLS))
def test_group_ranges_agrees_with_the_per_range_checks(pools: str) -> None:
    local, peer_regions = POOLS[pools]
    peer = IpcEndpoint("decode", "boot", 1, peer_regions)
    rng = np.random.default_rng(7)
    refused = fast = 0
    for _ in range(400):
        ranges = random_ranges(rng, local, peer_regions)
        expected = reference_group(ranges, local, peer)
        if isinstance(expected, str):
            with pytest.raises(TransferError) as err:
                group_ranges(ranges, local, peer, "prefill")
            named = next(r for r in ranges if str(r) in str(err.value))
            assert isinstance(reference_group([named], local, peer), str), err.value
            refused += 1
            continue
        got = group_ranges(ranges, local, peer, "prefill")
        assert {k: v.T.tolist() for k, v in got.items()} == {
            k: [list(r) for r in v] for k, v in expected.items()
        }
        fast += len(got) == 1
        columns = RangeColumns(columns_of(ranges).copy())  # a layer group's form
        as_columns = group_ranges(columns, local, peer, "prefill")
        assert {k: v.tolist() for k, v in as_columns.items()} == {
            k: v.tolist() for k, v in got.items()
        }
        assert not any(np.shares_memory(v, columns.columns) for v in as_columns.values())
    assert refused > 20 and fast > 100  # both paths and the refusals were exercised


def test_group_ranges_refuses_ranges_whose_end_would_wrap_or_that_are_empty() -> None:
    """A range near 2**63 would wrap its int64 end below its region's end and pass a bounds
    check (the version before this one let it through, to a write far out of the pool)."""
    local, peer_regions = POOLS["one pool each"]
    peer = IpcEndpoint("decode", "boot", 1, peer_regions)
    kv = peer_regions[0]
    fine = TransferRange(local[0].addr, kv.addr, 256)
    evil = TransferRange(local[0].addr + 256, (1 << 63) - 64, 256)
    for bad in (evil, TransferRange(local[0].addr, kv.addr, 0),
                TransferRange(local[0].addr, kv.addr, -256)):  # fmt: skip
        with pytest.raises(TransferError, match=r"length <= 0 or an address or length >= 2\*\*62"):
            group_ranges([fine, bad, fine], local, peer, "prefill")
    assert group_ranges([], local, peer, "prefill") == {}


def test_plan_columns_makes_the_plans_of_the_per_range_version() -> None:
    rng = np.random.default_rng(11)
    for case in range(500):
        n = int(rng.integers(0, 40))
        unit = int(rng.choice([1, 2, 8, 64, 4096, 16384]))
        rows = np.stack([rng.integers(0, 1 << 12, n) * unit, rng.integers(0, 1 << 12, n) * unit,
                         rng.integers(1, 600, n) * unit], axis=1)  # fmt: skip
        if case % 50 == 0 and n:
            rows[int(rng.integers(n)), int(rng.integers(3))] *= -1 if case % 100 else 0
        align = tuple(int(a) for a in rng.choice([0x1000, 0x1004, 0x1002, 0x1001], 2))
        max_chunk, max_piece = int(rng.choice([256, 16384])), int(rng.choice([4096, 2 << 20]))
        try:
            chunk, word, expected = reference_plan_copy(rows.tolist(), align, max_chunk, max_piece)
        except ValueError:
            with pytest.raises(ValueError, match="positive lengths"):
                plan_columns(rows.T, align, max_chunk, max_piece)
            continue
        out = np.full((64, 3), -1, dtype=np.int64)
        for target in (None, out):
            plan = plan_columns(np.ascontiguousarray(rows.T), align, max_chunk, max_piece, target)
            assert (plan.chunk_bytes, plan.word_bytes) == (chunk, word)
            assert plan.rows.tolist() == expected
            assert plan.max_chunks == max((r[2] for r in expected), default=0)
            assert plan_copy(rows, align, max_chunk, max_piece).rows.tolist() == expected
            if target is not None and 0 < len(expected) <= len(out):
                assert np.shares_memory(plan.rows, out)


@pytest.mark.parametrize("pools", sorted(POOLS))
def test_plan_pages_moves_the_bytes_of_the_checked_ranges(pools: str) -> None:
    """Page ids planned straight into rows: taken exactly when the page ranges are one GPU
    pool into another, and then moving the same bytes as the ranges would."""
    local, peer_regions = POOLS[pools]
    peer = IpcEndpoint("decode", "boot", 1, peer_regions)
    rng = np.random.default_rng(5)
    taken = 0
    for _ in range(300):
        page = int(rng.choice([64, 256, 1024, 3 * 256]))
        src_r, dst_r = local[0], peer_regions[int(rng.integers(len(peer_regions)))]
        src_base = src_r.addr + int(rng.choice([0, 0, 128, -page]))
        dst_base = dst_r.addr + int(rng.choice([0, 0, 512]))
        n = int(rng.integers(0, 20))
        src_top, dst_top = max(src_r.length // page, 1), max(dst_r.length // page, 1)
        src = rng.integers(-1 if rng.random() < 0.1 else 0, src_top + (rng.random() < 0.1), n)
        dst = rng.integers(0, dst_top + (rng.random() < 0.1), n)
        ranges = coalesce_pages(src.tolist(), dst.tolist(), page, src_base, dst_base)
        expected = reference_group(ranges, local, peer)
        out = np.zeros((32, 3), dtype=np.int64)
        planned = plan_pages(src, dst, page, (src_base, dst_base), local, peer_regions, (), out)
        one_gpu_pair = isinstance(expected, dict) and len(expected) == 1 and local[
            next(iter(expected))[0]].on_gpu  # fmt: skip
        assert (planned is not None) == (one_gpu_pair and n > 0), (src, dst, expected)
        if planned is None:
            continue
        taken += 1
        [(li, pi)] = expected
        assert (planned.local_index, planned.peer_index) == (li, pi)
        src_bytes = rng.integers(0, 256, local[li].length, dtype=np.uint8)
        want = np.full(peer_regions[pi].length, 0xA5, dtype=np.uint8)
        got = want.copy()
        for s, d, length in expected[(li, pi)]:
            s, d = s - local[li].addr, d - peer_regions[pi].addr
            want[d : d + length] = src_bytes[s : s + length]
        apply_rows(src_bytes, got, planned.plan)
        assert np.array_equal(got, want)
        assert planned.plan.max_chunks == int(planned.plan.rows[:, 2].max())
    assert taken > 100
    with pytest.raises(ValueError, match="destination pages"):
        plan_pages([1, 2], [3], 64, (0, 0), local, peer_regions)


def test_write_pages_by_default_writes_the_coalesced_ranges() -> None:
    """KVTransferEngine.write_pages (additive): backends without a page path (NIXL, Mooncake,
    the TP and fault wrappers) get `write` of the pages' coalesced ranges, ids as ints."""
    engine = RecordingEngine()
    engine.write_pages("d", np.array([3, 4, 9]), [7, 8, 1], 4096, 1 << 20, 1 << 30)
    [ranges] = engine.writes
    assert engine.peer_ids == ["d"]
    assert ranges == coalesce_pages([3, 4, 9], [7, 8, 1], 4096, 1 << 20, 1 << 30)
    assert all(type(r.src_addr) is int for r in ranges)


def endpoint() -> IpcEndpoint:
    return IpcEndpoint(
        "decode-1",
        "boot-a",
        4242,
        (
            ExportedRegion("kv", 0x7F0000000000, 1 << 30, "cuda:1", bytes(range(64)), 512),
            ExportedRegion("aux", 0x5500, 4096, "cpu"),
        ),
    )


def test_endpoint_round_trips_and_finds_regions() -> None:
    ep = endpoint()
    back = IpcEndpoint.from_bytes(ep.to_bytes(), "decode-1")
    assert back == ep
    assert back.regions[0].device_index == 1 and back.regions[0].on_gpu
    assert back.region_for(0x7F0000000000 + 4096, 4096) == ep.regions[0]
    assert back.region_for(0x5500 + 4000, 200) is None  # past the aux region's end
    ep.check_same_host("decode-1", "boot-a")


def test_endpoint_of_another_backend_or_host_is_refused_naming_the_flag() -> None:
    with pytest.raises(TransferError, match=f"did not publish a cuda_ipc endpoint.*{BACKEND_FLAG}"):
        IpcEndpoint.from_bytes(b"127.0.0.1:15001", "decode-1")  # a Mooncake endpoint
    with pytest.raises(TransferError, match="did not publish"):
        IpcEndpoint.from_bytes(b'{"cuda_ipc": 1, "regions": [{"name": "kv"}]}', "decode-1")
    with pytest.raises(TransferError, match=r"another host.*one host only.*nixl or mooncake"):
        endpoint().check_same_host("decode-1", "boot-b")


def test_cpu_kv_pool_is_refused_aux_slots_are_not() -> None:
    check_registrable(MemoryRegion("aux", 0x1000, 4096, "cpu"))
    check_registrable(MemoryRegion("kv", 0x1000, 4096, "cuda:0"))
    with pytest.raises(TransferError, match=r"KV pool in GPU memory.*--device cuda"):
        check_registrable(MemoryRegion("kv", 0x1000, 4096, "cpu"))
    with pytest.raises(TransferError, match="only 'cpu'"):
        check_registrable(MemoryRegion("kv", 0x1000, 4096, "mps"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a host without GPUs")
def test_engine_on_a_host_without_gpus_is_refused_naming_the_flag() -> None:
    with pytest.raises(TransferError, match=f"{BACKEND_FLAG} needs CUDA GPUs.*nixl or mooncake"):
        create_engine(TransferConfig(backend="cuda_ipc", node_name="prefill"))


def test_ipc_handle_struct_keeps_its_64_bytes() -> None:
    import ctypes

    from kvtransfer.cuda_driver import IpcMemHandle

    raw = bytes(range(64))
    assert ctypes.sizeof(IpcMemHandle) == 64
    assert bytes(IpcMemHandle.from_buffer_copy(raw)) == raw


def test_driver_on_a_host_without_one_is_refused_naming_the_flag() -> None:
    import ctypes

    from kvtransfer.cuda_driver import CudaDriver

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("this host has the NVIDIA driver")
    with pytest.raises(TransferError, match=f"{BACKEND_FLAG} needs the NVIDIA driver"):
        CudaDriver()


def test_node_flag_accepts_cuda_ipc() -> None:
    import argparse

    from engine.node.args import add_disagg_args

    parser = argparse.ArgumentParser()
    add_disagg_args(parser)  # both node kinds' transfer flags (no grpc import: runs on GPU hosts)
    assert parser.parse_args(["--transfer-backend", "cuda_ipc"]).transfer_backend == "cuda_ipc"


class FakeDriver:
    """The driver calls of kvtransfer/cuda_driver.py, recorded (no GPU needed)."""

    MAPPED_AT = 0x7F00_0000_0000
    batch_copier = None  # no cuMemcpyBatchAsync: --cuda-ipc-copy batch falls back to the kernel
    batch_missing = "the stand-in driver has no batched copy"
    version = 12060  # cuDriverGetVersion: CUDA 12.6

    def __init__(self) -> None:
        self.opened: list[tuple[bytes, int]] = []
        self.closed: list[int] = []

    def export(self, addr: int, device: int) -> tuple[bytes, int]:
        return bytes([device + 1] * 64), 512

    def open(self, handle: bytes, device: int) -> int:
        self.opened.append((handle, device))
        return self.MAPPED_AT

    def close(self, addr: int, device: int) -> None:
        self.closed.append(addr)

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        import ctypes

        ctypes.memmove(dst, src, nbytes)  # the stand-in GPU's memory is this process's


class CpuTables:
    """RowTables' slots in CPU memory (no pinning without a GPU)."""

    def __init__(self) -> None:
        from kvtransfer.cuda_ipc_queue import TableSlot

        host = torch.zeros((64, 3), dtype=torch.int64)
        self.slot = TableSlot(host, host.numpy(), torch.zeros_like(host))

    def take(self):  # type: ignore[no-untyped-def]
        return self.slot


@pytest.fixture
def fake_gpu_engine(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A CudaIpcEngine whose driver, kernel launch and CPU writes are recorded."""
    from kvtransfer import cuda_ipc

    monkeypatch.setattr(cuda_ipc.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_ipc, "CudaDriver", FakeDriver)
    monkeypatch.setattr(cuda_ipc, "boot_id", lambda: "boot-a")
    engine = cuda_ipc.CudaIpcEngine(TransferConfig(backend="cuda_ipc", node_name="prefill"))
    launches: list = []
    cpu_writes: list = []
    tables = CpuTables()
    monkeypatch.setattr(engine, "_tables", lambda device: tables)
    monkeypatch.setattr(engine, "_launch", lambda h, plan, local, base, slot: launches.append(
        (plan, local.addr, base, slot)))  # fmt: skip
    monkeypatch.setattr(cuda_ipc, "write_process_memory", lambda pid, rows: cpu_writes.append(
        (pid, rows)))  # fmt: skip
    engine.register([MemoryRegion("kv", 0x1000_0000, 1 << 24, "cuda:0"),
                     MemoryRegion("aux", 0x2000, 4096, "cpu")])  # fmt: skip
    return engine, launches, cpu_writes


def test_engine_maps_the_peer_once_and_plans_one_launch_per_write(fake_gpu_engine) -> None:  # type: ignore[no-untyped-def]
    engine, launches, cpu_writes = fake_gpu_engine
    ours = IpcEndpoint.from_bytes(engine.local_endpoint(), "prefill")
    assert ours.regions[0].ipc_handle == bytes([1] * 64) and ours.regions[0].offset == 512
    assert ours.regions[1].ipc_handle == b"" and ours.pid == os.getpid()
    peer = endpoint()  # decode-1: kv on cuda:1 at offset 512 of its allocation, pid 4242
    peer = IpcEndpoint(peer.node_name, "boot-a", peer.pid, peer.regions)
    info = PeerInfo("decode-1", peer.to_bytes(), {})
    engine.connect(info)
    engine.connect(info)  # idempotent: one mapping
    assert engine._driver.opened == [(bytes(range(64)), 0)]  # mapped into our GPU, cuda:0
    kv, aux = peer.regions
    page = 64 << 10
    ranges = coalesce_pages([3, 4, 9], [7, 8, 1], page, 0x1000_0000, kv.addr)
    ranges.append(TransferRange(0x2000 + 128, aux.addr + 256, 200))
    handle = engine.write("decode-1", ranges)
    assert engine.poll(handle) is TransferState.DONE  # no kernel was really queued
    [(plan, src_base, dst_base, slot)] = launches
    assert (src_base, dst_base) == (0x1000_0000, FakeDriver.MAPPED_AT + 512)
    per_page = page // MAX_CHUNK_BYTES  # pages 3-4 -> 7-8 are one row, 9 -> 1 another
    assert plan.chunk_bytes == MAX_CHUNK_BYTES
    assert plan.rows.tolist() == [[3 * per_page, 7 * per_page, 2 * per_page],
                                  [9 * per_page, 1 * per_page, per_page]]  # fmt: skip
    assert np.shares_memory(plan.rows, slot.host_rows)  # planned into the upload buffer
    assert cpu_writes == [(4242, [(0x2000 + 128, aux.addr + 256, 200)])]
    engine.release(handle)
    # the page-index form: the same rows, one a page (no coalescing needed)
    launches.clear()
    handle = engine.write_pages("decode-1", [3, 4, 9], np.array([7, 8, 1]), page,
                                0x1000_0000, kv.addr)  # fmt: skip
    [(pages_plan, src_base, dst_base, _)] = launches
    assert (src_base, dst_base) == (0x1000_0000, FakeDriver.MAPPED_AT + 512)
    assert pages_plan.rows.tolist() == [[3 * per_page, 7 * per_page, per_page],
                                        [4 * per_page, 8 * per_page, per_page],
                                        [9 * per_page, 1 * per_page, per_page]]  # fmt: skip
    assert pages_plan.word_bytes == 8
    engine.release(handle)
    restarted = IpcEndpoint("decode-1", "boot-a", 4343, (replace(kv, ipc_handle=bytes(64)),))
    engine.connect(PeerInfo("decode-1", restarted.to_bytes(), {}))  # the old mapping goes
    assert engine._driver.closed == [FakeDriver.MAPPED_AT]
    engine.close()
    assert engine._driver.closed == [FakeDriver.MAPPED_AT] * 2


class FakeEvent:
    def __init__(self, passed: bool) -> None:
        self.passed = passed

    def query(self) -> bool:
        return self.passed


class CountingEvent(FakeEvent):
    def __init__(self, passed: bool) -> None:
        super().__init__(passed)
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.passed


def test_a_write_polled_done_is_released_without_asking_its_events_again() -> None:
    """A room's last poll reads every write's events, then releases them: one query each
    (a prefill node polls G + 1 writes of a streamed room as its first token is reported)."""
    from kvtransfer.cuda_ipc import CudaIpcEngine, CudaIpcHandle

    engine = CudaIpcEngine.__new__(CudaIpcEngine)  # poll and release touch no GPU
    engine.config = TransferConfig(backend="cuda_ipc", node_name="prefill")
    event = CountingEvent(False)
    handle = CudaIpcHandle("decode-1", events=[event])
    assert engine.poll(handle) is TransferState.PENDING
    with pytest.raises(TransferError, match="still in flight"):
        engine.release(handle)
    event.passed = True
    assert engine.poll(handle) is TransferState.DONE
    queries = event.queries
    engine.release(handle)
    assert event.queries == queries and handle.events == []


def test_row_tables_reuse_a_slot_only_once_its_kernel_is_done() -> None:
    """A slot's host buffer is read by its upload and its device buffer by its kernel: both
    are done once the event after the kernel has passed, and not before."""
    from kvtransfer.cuda_ipc_queue import RowTables, TableSlot

    tables = RowTables.__new__(RowTables)  # no pinned memory without a GPU: slots by hand
    host = torch.zeros((8, 3), dtype=torch.int64)
    tables.slots = [TableSlot(host, host.numpy(), host) for _ in range(3)]
    tables._next = 0
    first, second = tables.take(), tables.take()
    assert first is tables.slots[0] and second is tables.slots[1]
    first.done, second.done = FakeEvent(False), FakeEvent(True)
    assert tables.take() is tables.slots[2]  # round robin
    tables.slots[2].done = FakeEvent(False)
    assert tables.take() is second  # slot 0 still busy: its kernel has not run
    second.done = FakeEvent(False)
    assert tables.take() is None  # every slot busy: the write takes fresh buffers
    first.done.passed = True
    assert tables.take() is first


def test_engine_refuses_bad_writes_and_peers_naming_what_to_do(fake_gpu_engine) -> None:  # type: ignore[no-untyped-def]
    engine, launches, _ = fake_gpu_engine
    with pytest.raises(TransferError, match="not connected"):
        engine.write("decode-1", [])
    elsewhere = replace(endpoint(), boot_id="boot-b")
    with pytest.raises(TransferError, match="another host"):
        engine.connect(PeerInfo("decode-1", elsewhere.to_bytes(), {}))
    with pytest.raises(TransferError, match="did not publish a cuda_ipc endpoint"):
        engine.connect(PeerInfo("decode-1", b"nixl agent metadata", {}))
    peer = replace(endpoint(), boot_id="boot-a")
    engine.connect(PeerInfo("decode-1", peer.to_bytes(), {}))
    kv, aux = peer.regions
    with pytest.raises(TransferError, match="outside every registered local region"):
        engine.write("decode-1", [TransferRange(0x10, kv.addr, 64)])
    with pytest.raises(TransferError, match="outside every registered peer 'decode-1' region"):
        engine.write("decode-1", [TransferRange(0x1000_0000, kv.addr + kv.length, 64)])
    with pytest.raises(TransferError, match=r"GPU to GPU \(KV\) and CPU to CPU \(aux\) only"):
        engine.write("decode-1", [TransferRange(0x1000_0000, aux.addr, 64)])
    with pytest.raises(TransferError, match="KV pool in GPU memory"):
        engine.register([MemoryRegion("kv", 0x9000, 4096, "cpu")])
    # page ids past either pool: the range path refuses them, naming the range
    page = 64 << 10
    past_local = (1 << 24) // page
    with pytest.raises(TransferError, match="outside every registered local region"):
        engine.write_pages("decode-1", [0, past_local], [1, 2], page, 0x1000_0000, kv.addr)
    with pytest.raises(TransferError, match="outside every registered peer 'decode-1' region"):
        engine.write_pages("decode-1", [0, 1], [-1, 2], page, 0x1000_0000, kv.addr)
    with pytest.raises(TransferError, match=r"GPU to GPU \(KV\) and CPU to CPU \(aux\) only"):
        engine.write_pages("decode-1", [0], [0], 64, 0x1000_0000, aux.addr)
    assert launches == []


AUX_TARGET = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from kvtransfer.process_memory import allow_peer_writes
    slots = np.zeros(64, dtype=np.uint8)
    allow_peer_writes()  # what a receiving engine does (needed under Yama ptrace_scope 1)
    print(os.getpid(), int(slots.ctypes.data), flush=True)
    sys.stdin.readline()
    print(slots.tobytes().hex(), flush=True)
    """
)


def test_aux_bytes_land_in_another_process() -> None:
    target = subprocess.Popen(
        [sys.executable, "-c", AUX_TARGET],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert target.stdin is not None and target.stdout is not None
    try:
        pid, addr = map(int, target.stdout.readline().split())
        src = np.arange(1, 33, dtype=np.uint8)
        write_process_memory(pid, [(int(src.ctypes.data), addr + 8, 16),
                                   (int(src.ctypes.data) + 16, addr + 40, 16)])  # fmt: skip
        target.stdin.write("read\n")
        target.stdin.flush()
        got = np.frombuffer(bytes.fromhex(target.stdout.readline().strip()), dtype=np.uint8)
    finally:
        target.wait(timeout=30)
    expected = np.zeros(64, dtype=np.uint8)
    expected[8:24], expected[40:56] = src[:16], src[16:]
    assert (got == expected).all()


def test_aux_write_into_a_gone_process_fails_with_errno() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    src = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ProcessMemoryError, match=f"pid {proc.pid}"):
        write_process_memory(proc.pid, [(int(src.ctypes.data), 0x1000, 8)])


# --- with a GPU: two processes through the engine itself --------------------------------------

PAGE_BYTES = 64 << 10
POOL_PAGES = 64
POISON = 0xA5
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _pool(device: str, fill: int | None) -> torch.Tensor:
    if fill is None:
        gen = torch.Generator(device=device).manual_seed(5)
        return torch.randint(0, 256, (POOL_PAGES, PAGE_BYTES), dtype=torch.uint8,
                             device=device, generator=gen)  # fmt: skip
    return torch.full((POOL_PAGES, PAGE_BYTES), fill, dtype=torch.uint8, device=device)


def _receiver(device: str, conn: Connection) -> None:
    torch.cuda.set_device(device)
    pool = _pool(device, POISON)
    aux = np.zeros(256, dtype=np.uint8)
    engine = create_engine(TransferConfig(backend="cuda_ipc", node_name="decode"))
    regions = [MemoryRegion("kv", pool.data_ptr(), pool.numel(), device),
               MemoryRegion("aux", int(aux.ctypes.data), aux.nbytes, "cpu")]  # fmt: skip
    engine.register(regions)
    conn.send((engine.local_endpoint(), regions))
    src_pages, dst_pages = conn.recv()
    torch.cuda.synchronize()
    expected = _pool(device, None)[src_pages]
    untouched = [p for p in range(POOL_PAGES) if p not in set(dst_pages)]
    landed = torch.equal(pool[dst_pages], expected)
    conn.send((landed, bool((pool[untouched] == POISON).all()), aux[:16].tolist()))
    engine.close()


@needs_cuda
@pytest.mark.parametrize("copy", ["kernel", "batch"])
@pytest.mark.parametrize("second_gpu", [False, True])
def test_two_processes_move_scattered_pages_and_aux(second_gpu: bool, copy: str) -> None:
    """`copy`: how the page-id writes copy (--cuda-ipc-copy); the ranges take the kernel."""
    if second_gpu and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    receiver_device = "cuda:1" if second_gpu else "cuda:0"
    engine = create_engine(TransferConfig("cuda_ipc", "prefill", ipc_copy=copy))
    if engine.copy_fallback:  # type: ignore[attr-defined]
        pytest.skip(engine.copy_fallback)  # type: ignore[attr-defined]
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    receiver = ctx.Process(target=_receiver, args=(receiver_device, there), daemon=True)
    receiver.start()
    try:
        assert here.poll(120), "the receiver did not start"
        endpoint_bytes, regions = here.recv()
        pool = _pool("cuda:0", None)
        aux = np.arange(1, 17, dtype=np.uint8)
        engine.register([MemoryRegion("kv", pool.data_ptr(), pool.numel(), "cuda:0"),
                         MemoryRegion("aux", int(aux.ctypes.data), aux.nbytes, "cpu")])  # fmt: skip
        engine.connect(PeerInfo("decode", endpoint_bytes, {r.name: r for r in regions}))
        rng = np.random.default_rng(1)
        src_pages = rng.permutation(POOL_PAGES)[:24].tolist()
        dst_pages = rng.permutation(POOL_PAGES)[:24].tolist()
        # the first 12 pages as ranges (with the aux slot), the others by page ids in six
        # writes queued back to back: more than RowTables' slots, so some take fresh buffers
        bases = (pool.data_ptr(), regions[0].addr)
        ranges = coalesce_pages(src_pages[:12], dst_pages[:12], PAGE_BYTES, *bases)
        ranges.append(TransferRange(int(aux.ctypes.data), regions[1].addr, 16))
        handles = [engine.write("decode", ranges)]
        for i in range(12, 24, 2):
            pages = (src_pages[i : i + 2], np.array(dst_pages[i : i + 2]))
            handles.append(engine.write_pages("decode", *pages, PAGE_BYTES, *bases))
        for handle in handles:
            while (state := engine.poll(handle)) is TransferState.PENDING:
                pass
            engine.release(handle)
            assert state is TransferState.DONE
        assert len(engine._launcher._compiled) == 1  # one variant, launched compiled
        here.send((src_pages, dst_pages))
        landed, untouched, aux_got = here.recv()
        engine.close()
    finally:
        receiver.join(timeout=60)
    assert landed and untouched
    assert aux_got == aux.tolist()


# --- the engine's whole write path with a CPU stand-in for the GPU ------------------------------
# Everything of a write but the CUDA calls themselves: the engine's checks and plans, the copy
# queue's slots, upload and launch arguments, and the benchmark's inlined paths, with CPU memory
# registered as "cuda:0", torch's streams and events replaced by stand-ins, and the kernel by a
# memmove per row of the table it is given (read from the address it is given).


class StandInStream:
    cuda_stream = 0

    def __init__(self, *args: object) -> None:
        self.waited = 0

    def wait_event(self, event: object) -> None:
        self.waited += 1

    def synchronize(self) -> None:
        pass


class StandInEvent:
    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True


def stand_in_kernel(launches: list) -> object:  # type: ignore[type-arg]
    import ctypes

    from kvtransfer.cuda_ipc_kernel import MAX_GRID_ROWS, WORD_BYTES

    def launch(stream, device, word, addrs, chunk_words, grid):  # type: ignore[no-untyped-def]
        src, dst, table = addrs
        assert device == 0 and stream == 0 and 0 < grid[1] <= MAX_GRID_ROWS
        chunk = chunk_words * WORD_BYTES[word]
        rows = np.ctypeslib.as_array((ctypes.c_int64 * (3 * grid[1])).from_address(table))
        rows = rows.reshape(-1, 3)
        assert grid[0] == rows[:, 2].max()  # the grid covers the longest row, no more
        assert src % WORD_BYTES[word] == 0 and dst % WORD_BYTES[word] == 0
        for s, d, n in rows.tolist():
            ctypes.memmove(dst + d * chunk, src + s * chunk, n * chunk)
        launches.append((word, chunk_words, grid))

    return launch


@pytest.fixture
def stand_in_engines(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A sender and a receiver engine in this process over two CPU pools registered as
    cuda:0, and the launches the sender's copy queue made."""
    from kvtransfer import cuda_ipc, cuda_ipc_queue

    class CpuRowTables(cuda_ipc_queue.RowTables):
        def __init__(self, device: torch.device) -> None:
            self.slots = []
            for _ in range(self.SLOTS):
                host = torch.zeros((self.CAPACITY, 3), dtype=torch.int64)
                self.slots.append(cuda_ipc_queue.TableSlot(host, host.numpy(), host.clone()))
            self._next = 0

    monkeypatch.setattr(cuda_ipc.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_ipc.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_ipc.torch.cuda, "current_stream", StandInStream)
    monkeypatch.setattr(cuda_ipc.torch.cuda, "Stream", StandInStream)
    monkeypatch.setattr(cuda_ipc.torch.cuda, "Event", StandInEvent)
    monkeypatch.setattr(cuda_ipc.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(cuda_ipc_queue, "RowTables", CpuRowTables)
    monkeypatch.setattr(cuda_ipc, "CudaDriver", FakeDriver)
    monkeypatch.setattr(cuda_ipc, "boot_id", lambda: "boot-a")
    pools = _pool("cpu", None).clone(), _pool("cpu", POISON)
    launches: list = []
    engines = []
    for name, pool in zip(("prefill", "decode"), pools, strict=True):
        engine = create_engine(TransferConfig(backend="cuda_ipc", node_name=name))
        engine._launcher.launch = stand_in_kernel(launches)
        engine.register([MemoryRegion("kv", pool.data_ptr(), pool.numel(), "cuda:0")])
        engines.append(engine)
    sender, receiver = engines
    sender.connect(PeerInfo("decode", receiver.local_endpoint(), {}))
    yield sender, pools, launches
    for engine in engines:
        engine.close()


def test_engine_write_paths_move_pages_through_the_copy_queue(stand_in_engines) -> None:  # type: ignore[no-untyped-def]
    sender, (src_pool, dst_pool), launches = stand_in_engines
    bases = (src_pool.data_ptr(), dst_pool.data_ptr())
    rng = np.random.default_rng(4)
    expected = dst_pool.clone()
    for way in ("write", "write_pages"):
        src = rng.permutation(POOL_PAGES)[:20].tolist()
        dst = rng.permutation(POOL_PAGES)[:20].tolist()
        if way == "write":
            handle = sender.write("decode", coalesce_pages(src, dst, PAGE_BYTES, *bases))
        else:
            handle = sender.write_pages("decode", src, np.array(dst), PAGE_BYTES, *bases)
        assert sender.poll(handle) is TransferState.DONE
        sender.release(handle)
        expected[dst] = src_pool[src]
        assert torch.equal(dst_pool, expected), way
    # one launch a write, 16 KiB chunks of 8-byte words, a row per page (or run of pages)
    assert len(launches) == 2 and {(w, c) for w, c, _ in launches} == {(torch.int64, 2048)}
    assert [g[0] for _, _, g in launches[1:]] == [PAGE_BYTES // MAX_CHUNK_BYTES]
    assert sender._copy_queue(0).stream.waited == 2  # each after the caller's stream


def test_batched_copy_knob_falls_back_to_the_kernel_where_the_driver_has_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtransfer import cuda_ipc
    from kvtransfer.cuda_batch_copy import CopyMethod

    monkeypatch.setattr(cuda_ipc.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_ipc, "CudaDriver", FakeDriver)
    engine = cuda_ipc.CudaIpcEngine(TransferConfig("cuda_ipc", "prefill", ipc_copy="batch"))
    assert engine.copy_method is CopyMethod.KERNEL
    assert engine.copy_fallback == (
        "--cuda-ipc-copy batch asked, but the stand-in driver has no batched copy: page-id "
        "writes use the copy kernel"
    )
    default = cuda_ipc.CudaIpcEngine(TransferConfig("cuda_ipc", "prefill"))
    assert default.copy_method is CopyMethod.KERNEL and default.copy_fallback == ""
    with pytest.raises(TransferError, match="--cuda-ipc-copy must be one of kernel, batch"):
        cuda_ipc.CudaIpcEngine(TransferConfig("cuda_ipc", "prefill", ipc_copy="memcpy"))


def test_engine_batched_page_writes_move_pages_by_one_driver_call(stand_in_engines) -> None:  # type: ignore[no-untyped-def]
    """--cuda-ipc-copy batch on the stand-in GPU: one batched call a write (a descriptor a run
    of pages, the peer's mapped addresses), after the caller's stream, no kernel; pages
    beyond the pool take the range path, which refuses them naming the range."""
    import ctypes

    from kvtransfer.cuda_batch_copy import _ARGS_13_0, BatchCopier, CopyMethod

    sender, (src_pool, dst_pool), launches = stand_in_engines
    calls: list = []

    def batch(dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream):  # type: ignore[no-untyped-def]
        rows = [np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(a)).tolist()
                for a in (dsts, srcs, sizes)]  # fmt: skip
        for d, s, n in zip(*rows, strict=True):
            ctypes.memmove(d, s, n)
        calls.append((count, stream))
        return 0

    fn = ctypes.CFUNCTYPE(ctypes.c_int, *_ARGS_13_0)(batch)
    sender._driver.batch_copier = BatchCopier(fn, "cuMemcpyBatchAsync_v2", 13000, False)
    sender.copy_method = CopyMethod.BATCH
    launches.clear()
    bases = (src_pool.data_ptr(), dst_pool.data_ptr())
    expected = dst_pool.clone()
    src, dst = [5, 6, 7, 30, 2], [40, 41, 42, 1, 9]
    handle = sender.write_pages("decode", src, np.array(dst), PAGE_BYTES, *bases)
    assert sender.poll(handle) is TransferState.DONE
    sender.release(handle)
    expected[dst] = src_pool[src]
    assert torch.equal(dst_pool, expected) and launches == []
    assert calls == [(3, None)]  # pages 5-7 -> 40-42 one descriptor, then two; stream 0
    assert sender._copy_queue(0).stream.waited == 1
    with pytest.raises(TransferError, match="lies outside every registered peer"):
        sender.write_pages_batched("decode", [3], [POOL_PAGES], PAGE_BYTES, bases)
    assert len(calls) == 1  # not batched: the range path refused it


def test_engine_write_with_every_table_slot_busy_takes_fresh_buffers(
    stand_in_engines, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    sender, (src_pool, dst_pool), launches = stand_in_engines
    launches.clear()
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch, "empty_like", lambda t, device=None: torch.zeros_like(t))
    for slot in sender._tables(0).slots:
        slot.done = FakeEvent(False)  # their kernels still running
    src, dst = [5, 9, 11], [1, 2, 40]
    handle = sender.write_pages("decode", src, dst, PAGE_BYTES, src_pool.data_ptr(),
                                dst_pool.data_ptr())  # fmt: skip
    assert len(handle.keep) == 2  # the fresh host and device tables, kept until released
    assert sender.poll(handle) is TransferState.DONE
    sender.release(handle)
    assert handle.keep == [] and torch.equal(dst_pool[dst], src_pool[src])
    assert all(not slot.free() for slot in sender._tables(0).slots)  # none was touched
    assert len(launches) == 1


def test_pd_check_says_whether_the_prefill_node_wrote_by_page_ids() -> None:
    from types import SimpleNamespace

    from proto import node_pb2
    from scripts.gpu.check_pd import page_id_use

    def reply(writes: int) -> SimpleNamespace:
        return SimpleNamespace(prefill=node_pb2.PrefillResponse(page_id_writes=writes))

    assert (
        page_id_use([reply(2), reply(1)])
        == "write_pages used: yes (2/2 requests, 3 page-id writes)"
    )
    assert page_id_use([reply(0), reply(0)]).startswith("write_pages used: NO (0/2")
    assert page_id_use([reply(0), reply(4)]).startswith("write_pages used: partly (1/2")
    assert page_id_use([SimpleNamespace(prefill=None)]).startswith("write_pages used: NO (0/0")
