"""Staging pages: scattered KV pages moved as one contiguous span.

A transfer engine pays per descriptor (one copy launch each: ~3-4 us on a GPU), so a prompt
whose pages are scattered over the pool moves at a fraction of the rate of one contiguous run
(256 scattered 2 MiB pages: 59-64% of it between two H100s). A node started with staging pages
(`PagedKVCache(staging_pages=...)`, after the pool in the same registered allocation) instead:

- prefill side: gathers a chunk's scattered pages into a span of staging pages with one kernel
  (`PageStager.gather`, all layers and heads of each page at once: a page holds them all) and
  writes from the span, contiguous on its side;
- decode side: publishes a span of staging pages as the room's destination instead of its
  scattered pool pages, and when the prefill node reports DONE scatters the span into those
  pages with one kernel (`PageStager.scatter`) before the request's KV is used.

Each side decides alone from its own pages (more runs than `min_runs`), so either, both or
neither stage; a room that finds no free span uses its pool pages as before.

Invariant (`StagingArea.check_integrity`, and `ModelRunner.check_integrity` after every test):

    free + held + fenced == total staging pages, the spans disjoint,

and every held span is owned by exactly one live request (`Req.staging`). A span is held from
the moment a room takes it until nothing can read or write it any more: on the prefill node
until the room's writes settled (released with the request's pages); on the decode node until
the scatter was issued, or, for a failed room, until its pages are freed (a quarantined room's
late writes can still land in its span). On a GPU the scatter runs on the compute stream, so a
span it reads is *fenced* (an event) until the kernel finished, and only then free again.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.memory.allocator import IntegrityError
from engine.memory.kv_cache import PagedKVCache

Fence = Callable[[], bool]  # True once the kernels that read a span have finished


@dataclass(frozen=True)
class StagingSpan:
    start: int  # first page id (staging page ids follow the pool's)
    length: int  # pages

    def ids(self, lo: int, hi: int) -> list[int]:
        """Page ids of the span's pages [lo, hi)."""
        if not 0 <= lo <= hi <= self.length:
            raise ValueError(f"pages [{lo}, {hi}) outside a span of {self.length}")
        return list(range(self.start + lo, self.start + hi))


def count_runs(src: Sequence[int], dst: Sequence[int] | None = None) -> int:
    """Descriptors a write of `src` pages (into `dst`) takes: runs contiguous on both sides."""
    runs = 0
    for i, page in enumerate(src):
        follows = i > 0 and page == src[i - 1] + 1
        if dst is not None:
            follows = follows and dst[i] == dst[i - 1] + 1
        runs += not follows
    return runs


class StagingArea:
    """First-fit spans over `num_pages` staging pages whose ids start at `first_page`."""

    def __init__(self, first_page: int, num_pages: int) -> None:
        self.first_page = first_page
        self.total = num_pages
        self._free: list[tuple[int, int]] = [(first_page, num_pages)] if num_pages else []
        self._held: set[StagingSpan] = set()
        self._fenced: list[tuple[StagingSpan, Fence]] = []

    @property
    def num_free(self) -> int:
        return sum(length for _, length in self._free)

    @property
    def num_held(self) -> int:
        return sum(span.length for span in self._held)

    @property
    def num_fenced(self) -> int:
        return sum(span.length for span, _ in self._fenced)

    @property
    def held(self) -> frozenset[StagingSpan]:
        return frozenset(self._held)

    def acquire(self, n: int) -> StagingSpan | None:
        """A span of `n` contiguous staging pages, or None when none is free (the caller then
        writes from or into its pool pages)."""
        if n <= 0:
            raise ValueError(f"a staging span needs at least one page, asked for {n}")
        self._reap()
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                span = StagingSpan(start, n)
                self._held.add(span)
                return span
        return None

    def release(self, span: StagingSpan, fence: Fence | None = None) -> None:
        """Give `span` back; with `fence`, it stays out of use until `fence()` says True."""
        if span not in self._held:
            raise IntegrityError(f"staging span {span} released but not held (double release?)")
        self._held.remove(span)
        if fence is None or fence():
            self._give_back(span)
        else:
            self._fenced.append((span, fence))

    def _reap(self) -> None:
        waiting = []
        for span, fence in self._fenced:
            if fence():
                self._give_back(span)
            else:
                waiting.append((span, fence))
        self._fenced = waiting

    def _give_back(self, span: StagingSpan) -> None:
        i = bisect.bisect(self._free, (span.start, span.length))
        self._free.insert(i, (span.start, span.length))
        # merge with the neighbours so that large spans form again
        if i + 1 < len(self._free) and span.start + span.length == self._free[i + 1][0]:
            self._free[i] = (span.start, span.length + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            start, length = self._free.pop(i - 1)
            self._free[i - 1] = (start, length + self._free[i - 1][1])

    def check_integrity(self) -> None:
        spans = sorted(
            [*self._free, *((s.start, s.length) for s in self._held)]
            + [(s.start, s.length) for s, _ in self._fenced]
        )
        counted = self.num_free + self.num_held + self.num_fenced
        if counted != self.total:
            raise IntegrityError(
                f"staging pages: free {self.num_free} + held {self.num_held} + fenced "
                f"{self.num_fenced} != {self.total} (a span leaked or was given back twice)"
            )
        end = self.first_page
        for start, length in spans:
            if start < end:
                raise IntegrityError(f"staging spans overlap at page {start}: {spans[:8]}")
            end = start + length
        if end > self.first_page + self.total:
            raise IntegrityError(f"a staging span ends at page {end}, past the staging pages")


class PageStager:
    """Gather into and scatter out of a KV cache's staging pages (one kernel each)."""

    def __init__(self, cache: PagedKVCache, min_runs: int) -> None:
        if cache.staging_pages <= 0:
            raise ValueError("a PageStager needs a PagedKVCache built with staging_pages > 0")
        self.cache = cache
        self.min_runs = min_runs  # stage a write that would take more descriptors than this
        self.area = StagingArea(cache.num_pages, cache.staging_pages)
        self.device = cache.storage.device
        # Pages as rows of 8-byte words: the kernels copy whole pages, whatever the KV dtype,
        # and wide elements copy faster than bf16 ones (on the CPU, several times).
        word = torch.int64 if cache.layout.page_bytes % 8 == 0 else torch.uint8
        self._pool_rows = cache.buffer.reshape(cache.num_pages, -1).view(word)
        self._staging_rows = cache.staging.reshape(cache.staging_pages, -1).view(word)

    def worth_staging(self, src: Sequence[int], dst: Sequence[int] | None = None) -> bool:
        return count_runs(src, dst) > self.min_runs

    def _rows(self, span: StagingSpan, offset: int, n: int) -> torch.Tensor:
        lo = span.start - self.cache.num_pages + offset
        if offset < 0 or offset + n > span.length:
            raise ValueError(f"pages [{offset}, {offset + n}) outside a span of {span.length}")
        return self._staging_rows[lo : lo + n]

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(pages), dtype=torch.int64).to(self.device, non_blocking=True)

    def gather(self, pages: Sequence[int], span: StagingSpan, offset: int) -> None:
        """Pool `pages` -> the span's pages [offset, offset + len(pages)); returns once the
        copy is in memory (a transfer engine reads it on streams of its own)."""
        out = self._rows(span, offset, len(pages))
        torch.index_select(self._pool_rows, 0, self._index(pages), out=out)
        if self.device.type == "cuda":  # this stream only: the engine's copies go on meanwhile
            torch.cuda.current_stream(self.device).synchronize()

    def scatter(self, span: StagingSpan, offset: int, pages: Sequence[int]) -> Fence | None:
        """The span's pages [offset, offset + len(pages)) -> pool `pages`, queued on the
        compute stream (every later kernel sees them). Returns the fence to release the span
        with (None on the CPU, where the copy is done on return)."""
        rows = self._rows(span, offset, len(pages))
        self._pool_rows.index_copy_(0, self._index(pages), rows)
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done.query
