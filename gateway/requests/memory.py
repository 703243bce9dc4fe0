"""Memory handed back to the system after large requests; start-up objects frozen (issue 25).

A 4 MB body, its parsed copy and a long prompt's tokenization are garbage once their request
ends, but glibc keeps freed memory in the process's arenas (each thread that allocated has
one), so the gateway's RSS would stay at its peak after a burst of long prompts.
`glibc malloc_trim(0)` hands the free pages of every arena back.

When: once the last large request in progress has ended (`MemoryReturn.large`), not after
each one. During a burst, trimming per request would hand pages back only for the next body
to fault them in again, and `malloc_trim` holds each arena's lock while it walks it, which
would stall the event loop's own allocations. It runs in a worker thread (ctypes releases the
GIL), scheduled from the event loop after the request's objects are gone.

Start-up objects out of the cyclic GC's way (`freeze_startup_objects`): a started gateway holds
~95,000 objects (modules, the tokenizer's wrappers, pydantic's validators, gRPC) that live as
long as it does. A full collection walks them all, on the event loop, holding the GIL: 50-120
ms on the 2-core shared test host (load 4-7), a stall for every client whenever one runs.
Frozen once start-up is done (after a collection, so no start-up garbage is kept), they are
never walked again; requests' objects are collected as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
from collections.abc import Callable, Iterator
from concurrent.futures import Executor

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
HEAP_BLOCK_BYTES = 32 << 20  # the largest block served from the heap: glibc's maximum
AUTO_TRIM_BYTES = 256 << 20  # free memory at a heap's top handed back without malloc_trim


def _libc_function(symbol: str) -> Callable[..., int] | None:
    name = ctypes.util.find_library("c")
    function = getattr(ctypes.CDLL(name), symbol, None) if name else None
    return function  # type: ignore[no-any-return]


def _malloc_trim() -> Callable[[], object]:
    """glibc's `malloc_trim(0)`, or a no-op elsewhere (musl, macOS)."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return lambda: None
    return lambda: trim(0)


malloc_trim = _malloc_trim()


def reuse_freed_memory() -> bool:
    """Large blocks from the heap, and freed memory kept for reuse until `malloc_trim`
    (glibc only; whether it applied). Once per process, at start-up.

    By default glibc maps every block of 128 kB or more afresh (its threshold grows only with
    the blocks freed) and unmaps it when freed: each of the 250 kB pieces that uvloop and
    httptools copy a large body into, each body joined, each copy sent to a parse process
    page-faults all its pages in again, on the event loop: 32 MB of such copies (a burst of
    eight 3.9 MB bodies) took the 2-core test host 20 ms, against 5-6 ms reusing freed memory
    (benchmarks/serving-2026-11-26-hostile-clients-3.md). The memory a burst leaves free is
    handed back once it ends (`MemoryReturn`)."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, AUTO_TRIM_BYTES)
    )


def freeze_startup_objects() -> int:
    """Collect start-up garbage, then move every object left to the GC's permanent generation
    (`gc.freeze`); once, when the server is ready. Returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class MemoryReturn:
    """Counts the large requests in progress; trims once when the last one ends."""

    def __init__(self, executor: Executor, trim: Callable[[], object] = malloc_trim) -> None:
        self._executor = executor
        self._trim = trim
        self.in_progress = 0
        self.trims = 0  # how many times memory was handed back (tests read it)

    @contextlib.contextmanager
    def large(self) -> Iterator[None]:
        """Around a large request's handling, on the event loop."""
        self.in_progress += 1
        try:
            yield
        finally:
            self.in_progress -= 1
            if self.in_progress == 0:
                # call_soon: the request's frame (its body, its token lists) is gone by then
                asyncio.get_running_loop().call_soon(self._trim_if_idle)

    def _trim_if_idle(self) -> None:
        if self.in_progress == 0:
            self.trims += 1
            self._executor.submit(self._trim)
