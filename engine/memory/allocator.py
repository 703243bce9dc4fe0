"""Page allocator for the paged KV store.

Every page of the pool is in exactly one state at any time:

    FREE    on the free list, owned by nobody;
    USED    owned by exactly one live request (its own, not-yet-cached pages);
    CACHED  owned by the radix cache (requests may lock them, they stay CACHED).

Invariant (checked by `check_integrity`, which tests call after every scenario):

    free + used + cached == total        and each page id appears in exactly one state.

Page 0 is never handed out: it is the scratch page that padded or dummy writes may hit, so a
late or padded write can never land in a live request's memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import IntEnum

import numpy as np


class PageState(IntEnum):
    FREE = 0
    USED = 1
    CACHED = 2


class OutOfPagesError(RuntimeError):
    """Not enough free pages; the scheduler retracts or waits instead of failing a request."""


class IntegrityError(AssertionError):
    """A memory invariant is broken: a page was leaked, double-freed or is in two places."""


class PageAllocator:
    SCRATCH_PAGE = 0

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self._state = np.full(num_pages, PageState.FREE, dtype=np.int8)
        self._state[self.SCRATCH_PAGE] = -1
        # Kept sorted descending (lazily) so allocations pop the lowest ids off the end and hand
        # out ascending, mostly contiguous page runs: contiguous runs coalesce into few transfer
        # descriptors.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._free_sorted = True
        self._counts = {PageState.FREE: num_pages - 1, PageState.USED: 0, PageState.CACHED: 0}

    @property
    def total(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return self._counts[PageState.FREE]

    @property
    def num_used(self) -> int:
        return self._counts[PageState.USED]

    @property
    def num_cached(self) -> int:
        return self._counts[PageState.CACHED]

    def allocate(self, n: int) -> list[int]:
        """n pages, ascending; raises OutOfPagesError (allocating nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free of {self.total}")
        if not self._free_sorted:
            self._free.sort(reverse=True)
            self._free_sorted = True
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        self._transition(pages, PageState.FREE, PageState.USED)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """USED -> FREE (a request gives back pages it owns)."""
        self._release(list(pages), PageState.USED)

    def free_cached(self, pages: Iterable[int]) -> None:
        """CACHED -> FREE (the radix cache evicts)."""
        self._release(list(pages), PageState.CACHED)

    def mark_cached(self, pages: Sequence[int]) -> None:
        """USED -> CACHED (a finished request's pages are adopted by the radix cache)."""
        self._transition(pages, PageState.USED, PageState.CACHED)

    def state_of(self, page: int) -> PageState:
        return PageState(int(self._state[page]))

    def pages_in(self, state: PageState) -> set[int]:
        return set(np.flatnonzero(self._state == state).tolist())

    def _release(self, pages: list[int], expected: PageState) -> None:
        self._transition(pages, expected, PageState.FREE)
        # Ascending order is restored lazily; appending keeps frees O(n).
        self._free.extend(pages)
        self._free_sorted = False

    def _transition(self, pages: Sequence[int], src: PageState, dst: PageState) -> None:
        if not pages:
            return
        idx = np.asarray(pages, dtype=np.int64)
        if idx.min() < 1 or idx.max() >= self.num_pages:
            raise IntegrityError(f"page ids out of range 1..{self.num_pages - 1}: {pages[:8]}")
        if len(np.unique(idx)) != len(idx):
            raise IntegrityError(f"duplicate page ids in one call: {pages[:8]}")
        wrong = idx[self._state[idx] != src]
        if len(wrong):
            states = [self.state_of(int(p)).name for p in wrong[:4]]
            raise IntegrityError(
                f"pages {wrong[:4].tolist()} are {states}, expected {src.name} (-> {dst.name})"
            )
        self._state[idx] = dst
        self._counts[src] -= len(idx)
        self._counts[dst] += len(idx)

    def check_integrity(self) -> None:
        counts = {s: int((self._state == s).sum()) for s in PageState}
        if counts != self._counts:
            raise IntegrityError(f"state counts {counts} != bookkeeping {self._counts}")
        if sum(counts.values()) != self.total:
            raise IntegrityError(f"free + used + cached = {sum(counts.values())} != {self.total}")
        if len(self._free) != counts[PageState.FREE] or set(self._free) != self.pages_in(
            PageState.FREE
        ):
            raise IntegrityError("free list disagrees with page states (leak or double free)")
