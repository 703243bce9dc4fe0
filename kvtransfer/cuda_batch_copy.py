"""The driver's batched copy (`cuMemcpyBatchAsync`, CUDA 12.8+): the `cuda_ipc` backend's second
way to copy a page-id write, beside its Triton kernel (kvtransfer/cuda_ipc_kernel.py).

One call queues every copy of a write on the engine's stream: a descriptor (destination,
source, size) per run of pages adjacent on both sides, one set of attributes for all (the
source read in stream order, after the caller's work). No row table to upload, no kernel to
launch; the driver picks how to copy (copy engines or its own kernels; the overlap hint asks
for the copy engines, leaving the SMs to compute). Which method a node uses is its
`TransferConfig.ipc_copy` (`--cuda-ipc-copy`): `CopyMethod`.

The symbol's signature changed with CUDA 13: the 12.8 one ends `..., numAttrs, failIdx,
hStream)`; CUDA 13 exports `cuMemcpyBatchAsync_v2` without `failIdx` (cuda.h maps the plain
name to it) and keeps the plain symbol with the old signature for old binaries.
`bind_batch_copy` picks by the driver's version (`cuDriverGetVersion`) and the symbols
present; where neither is there (a driver before 12.8, no libcuda) it says why and the engine
copies with its kernel.

No CUDA here beyond that binding: descriptors are numpy arrays, the attributes ctypes
structures (the tests build and check both on a CPU).
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DRIVER_12_8 = 12080
DRIVER_13_0 = 13000
SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
NO_FAILURE = ctypes.c_size_t(-1).value  # failIdx when no copy of the batch is to blame


class CopyMethod(enum.Enum):
    """How a `cuda_ipc` page-id write copies (`--cuda-ipc-copy`)."""

    KERNEL = "kernel"  # the Triton kernel: one launch, a program per chunk of each page
    BATCH = "batch"  # cuMemcpyBatchAsync, the driver's choice of copy
    BATCH_OVERLAP = "batch-overlap"  # the same, hinting to overlap with compute (copy engines)

    @property
    def batched(self) -> bool:
        return self is not CopyMethod.KERNEL


COPY_METHODS = tuple(m.value for m in CopyMethod)


def parse_copy_method(value: str) -> CopyMethod:
    """`value` as a CopyMethod; a ValueError naming the choices otherwise."""
    try:
        return CopyMethod(value)
    except ValueError:
        raise ValueError(
            f"--cuda-ipc-copy must be one of {', '.join(COPY_METHODS)}, got {value!r}"
        ) from None


class MemLocation(ctypes.Structure):
    """CUmemLocation: a type (CUmemLocationType) and an id; zero = no hint."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (CUDA 12.8 and 13): 24 bytes."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


def batch_attributes(overlap: bool) -> MemcpyAttributes:
    """One set for every copy of a write: its source is read in stream order (the engine's
    stream waited for the caller's, which wrote the pages); no location hints (they matter
    for managed memory only)."""
    flags = FLAG_PREFER_OVERLAP_WITH_COMPUTE if overlap else 0
    return MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, MemLocation(), MemLocation(), flags)


@dataclass(frozen=True)
class PageDescriptors:
    """A page-id write as the driver's arrays: uint64 addresses and sizes, one a run of
    pages adjacent on both sides."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray

    @property
    def count(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())


def page_descriptors(
    src_pages: np.ndarray, dst_pages: np.ndarray, page_bytes: int, src_base: int, dst_base: int
) -> PageDescriptors:
    """Page `s` at `src_base + s * page_bytes` to page `d` at `dst_base + d * page_bytes`,
    pairwise (int64 id arrays of one length), runs adjacent on both sides merged into one
    descriptor; vectorised (256 scattered pages: a few numpy calls)."""
    n = len(src_pages)
    if not n:
        empty = np.empty(0, dtype=np.uint64)
        return PageDescriptors(empty, empty, empty)
    # int64 arithmetic viewed as uint64 (addresses are below 2**62): no conversion pass
    breaks = ((src_pages[1:] - src_pages[:-1]) != 1) | ((dst_pages[1:] - dst_pages[:-1]) != 1)
    if breaks.all():  # every page a run of its own (scattered pages): no gather
        srcs, dsts = src_pages * page_bytes, dst_pages * page_bytes
        sizes = np.full(n, page_bytes, dtype=np.int64)
    else:
        starts = np.empty(int(np.count_nonzero(breaks)) + 2, dtype=np.int64)
        starts[0], starts[-1] = 0, n
        starts[1:-1] = np.flatnonzero(breaks) + 1
        first = starts[:-1]
        srcs, dsts = src_pages[first] * page_bytes, dst_pages[first] * page_bytes
        sizes = (starts[1:] - first) * page_bytes
    srcs += src_base
    dsts += dst_base
    return PageDescriptors(dsts.view(np.uint64), srcs.view(np.uint64), sizes.view(np.uint64))


def _pointer(array: np.ndarray) -> int:
    return int(array.ctypes.data)


@dataclass(frozen=True)
class BatchCopier:
    """`cuMemcpyBatchAsync` bound for this driver: `copy` queues a write's descriptors on a
    stream of the current context. `with_fail_index`: the 12.8 signature (CUDA 13's `_v2`
    has none)."""

    fn: Callable[..., int]
    symbol: str
    driver_version: int
    with_fail_index: bool
    describe: Callable[[int], str] = str

    def copy(self, desc: PageDescriptors, stream: int, overlap: bool) -> None:
        if not desc.count:
            return
        attrs = batch_attributes(overlap)
        first = ctypes.c_size_t(0)  # attrs[0] applies from copy 0 on
        ptrs = (_pointer(desc.dsts), _pointer(desc.srcs), _pointer(desc.sizes))
        if self.with_fail_index:
            failed = ctypes.c_size_t(NO_FAILURE)
            rc = self.fn(*ptrs, desc.count, ctypes.byref(attrs), ctypes.byref(first), 1,
                         ctypes.byref(failed), stream)  # fmt: skip
            culprit = failed.value
        else:
            rc = self.fn(*ptrs, desc.count, ctypes.byref(attrs), ctypes.byref(first), 1, stream)
            culprit = NO_FAILURE
        if rc != 0:
            raise BatchCopyError(self._failure(rc, desc, culprit))

    def _failure(self, rc: int, desc: PageDescriptors, culprit: int) -> str:
        what = f"{self.symbol} of {desc.count} copies ({desc.nbytes} bytes) failed"
        if culprit != NO_FAILURE and culprit < desc.count:
            what += (f" at copy {culprit}: {int(desc.sizes[culprit])} bytes "
                     f"{int(desc.srcs[culprit]):#x} -> {int(desc.dsts[culprit]):#x}")  # fmt: skip
        return f"{what} ({self.describe(rc)}); run the nodes with --cuda-ipc-copy kernel"


class BatchCopyError(RuntimeError):
    """The driver refused a batched copy; the message names the copy when it knows it."""


_ARGS_12_8 = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
              ctypes.c_void_p]  # fmt: skip
_ARGS_13_0 = [*_ARGS_12_8[:7], ctypes.c_void_p]  # no failIdx


def bind_batch_copy(
    lib: Any, driver_version: int, describe: Callable[[int], str] = str
) -> tuple[BatchCopier | None, str]:
    """(the batched copy of `lib` (libcuda, or None where it could not be loaded), "") or
    (None, why not). `driver_version`: cuDriverGetVersion's answer (12080 for 12.8)."""
    if lib is None:
        return None, "libcuda.so.1 could not be loaded"
    if driver_version < DRIVER_12_8:
        return None, f"the driver is CUDA {_version(driver_version)}; cuMemcpyBatchAsync needs 12.8"
    candidates: Sequence[tuple[str, list[Any], bool]] = [("cuMemcpyBatchAsync", _ARGS_12_8, True)]
    if driver_version >= DRIVER_13_0:
        candidates = [("cuMemcpyBatchAsync_v2", _ARGS_13_0, False), *candidates]
    for symbol, args, with_fail_index in candidates:
        fn = getattr(lib, symbol, None)
        if fn is not None:
            fn.argtypes = args
            fn.restype = ctypes.c_int
            return BatchCopier(fn, symbol, driver_version, with_fail_index, describe), ""
    names = " or ".join(c[0] for c in candidates)
    return None, f"libcuda (CUDA {_version(driver_version)}) exports no {names}"


def _version(driver_version: int) -> str:
    return f"{driver_version // 1000}.{driver_version % 1000 // 10}"
