"""The `cuda_ipc` backend's batched driver copy (kvtransfer/cuda_batch_copy.py), on a CPU.

Its descriptors against `coalesce_pages`, its attributes' layout, the choice of the symbol and
signature by the driver's version (12.8: `failIdx`; 13: `_v2` without it), the refusal where
the driver has none, and the call itself through a ctypes stand-in for libcuda that reads the
arrays and attributes from the addresses it is given and copies host memory by them.
"""

from __future__ import annotations

import argparse
import ctypes
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtransfer.base import coalesce_pages
from kvtransfer.cuda_batch_copy import (
    _ARGS_12_8,
    _ARGS_13_0,
    COPY_METHODS,
    NO_FAILURE,
    SRC_ACCESS_ORDER_STREAM,
    BatchCopyError,
    CopyMethod,
    MemcpyAttributes,
    batch_attributes,
    bind_batch_copy,
    page_descriptors,
    parse_copy_method,
)

PAGE = 4096


def test_descriptors_are_the_coalesced_runs_of_pages() -> None:
    rng = np.random.default_rng(3)
    for src, dst in (
        ([3, 4, 5, 9, 10, 2], [7, 8, 9, 1, 2, 30]),  # runs on both sides, then a lone page
        ([1, 2, 3], [5, 6, 8]),  # adjacent on one side only: no run
        (rng.permutation(500)[:256].tolist(), rng.permutation(500)[:256].tolist()),
        (list(range(10, 266)), list(range(300, 556))),  # one run: one descriptor
    ):
        desc = page_descriptors(np.array(src), np.array(dst), PAGE, 1 << 40, 1 << 41)
        want = coalesce_pages(src, dst, PAGE, 1 << 40, 1 << 41)
        got = list(zip(desc.srcs.tolist(), desc.dsts.tolist(), desc.sizes.tolist(), strict=True))
        assert got == [tuple(r) for r in want]
        assert desc.dsts.dtype == desc.srcs.dtype == desc.sizes.dtype == np.uint64
        assert desc.count == len(want) and desc.nbytes == len(src) * PAGE
    empty = page_descriptors(np.array([], dtype=np.int64), np.array([], dtype=np.int64), PAGE,
                             0, 0)  # fmt: skip
    assert empty.count == 0


def test_attributes_have_the_driver_layout_and_read_the_source_in_stream_order() -> None:
    assert ctypes.sizeof(MemcpyAttributes) == 24  # int, {int, int}, {int, int}, unsigned int
    assert MemcpyAttributes.flags.offset == 20
    plain, overlap = batch_attributes(False), batch_attributes(True)
    assert plain.srcAccessOrder == overlap.srcAccessOrder == SRC_ACCESS_ORDER_STREAM
    assert (plain.flags, overlap.flags) == (0, 1)
    assert plain.srcLocHint.type == plain.dstLocHint.type == 0  # no hint


def test_copy_method_knob_parses_and_names_its_choices() -> None:
    assert [parse_copy_method(v) for v in COPY_METHODS] == list(CopyMethod)
    assert not CopyMethod.KERNEL.batched and CopyMethod.BATCH_OVERLAP.batched
    with pytest.raises(ValueError, match="--cuda-ipc-copy must be one of kernel, batch, batch-o"):
        parse_copy_method("memcpy")


def test_node_flag_builds_the_transfer_config_with_the_copy_method() -> None:
    from engine.node.args import add_disagg_args, transfer_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--advertise-host", default="")
    parser.add_argument("--port", type=int, default=7000)
    add_disagg_args(parser)
    assert transfer_config(parser.parse_args([]), "prefill").ipc_copy == "kernel"
    args = parser.parse_args(["--transfer-backend", "cuda_ipc", "--cuda-ipc-copy", "batch"])
    assert transfer_config(args, "prefill").ipc_copy == "batch"
    with pytest.raises(SystemExit):  # argparse names the choices
        parser.parse_args(["--cuda-ipc-copy", "memcpy"])


class StandInLibcuda:
    """libcuda's batched copy as a ctypes function around Python: it reads the arrays and the
    attributes from the addresses the binding passes and copies host memory by them."""

    def __init__(self, symbols: tuple[str, ...], fail_at: int | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail_at = fail_at
        for symbol in symbols:
            with_fail = symbol == "cuMemcpyBatchAsync"
            args = _ARGS_12_8 if with_fail else _ARGS_13_0
            proto = ctypes.CFUNCTYPE(ctypes.c_int, *args)

            def fn(*a: Any, with_fail: bool = with_fail) -> int:
                return self._call(with_fail, *a)

            setattr(self, symbol, proto(fn))

    def _call(self, with_fail: bool, dsts: int, srcs: int, sizes: int, count: int, attrs: int,
              idxs: int, num_attrs: int, *rest: Any) -> int:  # fmt: skip
        def array(addr: int) -> list[int]:
            return list((ctypes.c_uint64 * count).from_address(addr))

        attr = MemcpyAttributes.from_address(attrs)
        first = ctypes.c_size_t.from_address(idxs).value
        self.calls.append({"with_fail": with_fail, "count": count, "num_attrs": num_attrs,
                           "first": first, "order": attr.srcAccessOrder, "flags": attr.flags,
                           "stream": rest[-1]})  # fmt: skip
        if self.fail_at is not None:
            if with_fail:
                ctypes.c_size_t.from_address(rest[0]).value = self.fail_at
            return 1  # CUDA_ERROR_INVALID_VALUE
        for d, s, n in zip(array(dsts), array(srcs), array(sizes), strict=True):
            ctypes.memmove(d, s, n)
        return 0


def test_binding_picks_the_signature_by_driver_version_and_symbols() -> None:
    assert bind_batch_copy(None, 13000) == (None, "libcuda.so.1 could not be loaded")
    both = StandInLibcuda(("cuMemcpyBatchAsync", "cuMemcpyBatchAsync_v2"))
    copier, why = bind_batch_copy(both, 12060)
    assert copier is None and "CUDA 12.6; cuMemcpyBatchAsync needs 12.8" in why
    copier, _ = bind_batch_copy(both, 13000)  # CUDA 13: the _v2 symbol, no failIdx
    assert copier is not None and copier.symbol == "cuMemcpyBatchAsync_v2"
    assert not copier.with_fail_index
    copier, _ = bind_batch_copy(both, 12080)  # 12.8: the plain symbol with failIdx
    assert copier is not None and copier.symbol == "cuMemcpyBatchAsync" and copier.with_fail_index
    plain = StandInLibcuda(("cuMemcpyBatchAsync",))
    copier, _ = bind_batch_copy(plain, 13010)  # a 13 driver without _v2: the old signature
    assert copier is not None and copier.with_fail_index
    copier, why = bind_batch_copy(SimpleNamespace(), 13000)
    assert copier is None and "exports no cuMemcpyBatchAsync_v2 or cuMemcpyBatchAsync" in why


@pytest.mark.parametrize("version", [12080, 13000])
def test_batched_copy_moves_the_pages_its_descriptors_name(version: int) -> None:
    lib = StandInLibcuda(("cuMemcpyBatchAsync", "cuMemcpyBatchAsync_v2"))
    copier, _ = bind_batch_copy(lib, version)
    assert copier is not None
    rng = np.random.default_rng(9)
    src_pool = rng.integers(0, 256, (64, PAGE), dtype=np.uint8)
    dst_pool = np.zeros_like(src_pool)
    src, dst = rng.permutation(64)[:20], rng.permutation(64)[:20]
    src[5:8], dst[5:8] = [40, 41, 42], [10, 11, 12]  # one run of three pages
    desc = page_descriptors(src, dst, PAGE, src_pool.ctypes.data, dst_pool.ctypes.data)
    copier.copy(desc, stream=0x1234, overlap=version == 13000)
    expected = np.zeros_like(src_pool)
    expected[dst] = src_pool[src]
    assert np.array_equal(dst_pool, expected)
    [call] = lib.calls
    assert call["with_fail"] == (version == 12080) and call["count"] == desc.count == 18
    assert (call["num_attrs"], call["first"], call["order"]) == (1, 0, SRC_ACCESS_ORDER_STREAM)
    assert call["flags"] == (version == 13000) and call["stream"] == 0x1234


def test_a_refused_batch_names_the_copy_and_the_way_back() -> None:
    lib = StandInLibcuda(("cuMemcpyBatchAsync",), fail_at=2)
    copier, _ = bind_batch_copy(lib, 12080, describe=lambda rc: f"CUDA error {rc}")
    assert copier is not None
    desc = page_descriptors(np.array([1, 5, 9]), np.array([2, 6, 10]), PAGE, 0x10000, 0x90000)
    with pytest.raises(BatchCopyError, match=r"at copy 2: 4096 bytes 0x19000 -> 0x9a000 \(CUDA "
                       r"error 1\); run the nodes with --cuda-ipc-copy kernel"):  # fmt: skip
        copier.copy(desc, 0, False)
    lib13 = StandInLibcuda(("cuMemcpyBatchAsync_v2",), fail_at=0)
    copier, _ = bind_batch_copy(lib13, 13000)
    assert copier is not None
    with pytest.raises(BatchCopyError, match=r"of 3 copies \(12288 bytes\) failed \(1\)"):
        copier.copy(desc, 0, False)  # no failIdx in CUDA 13: no copy named
    assert NO_FAILURE == 2**64 - 1
