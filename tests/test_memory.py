"""Page allocator and radix prefix cache: unit scenarios plus a stateful model of request traffic.

Every scenario ends with both integrity checks, as STYLE.md asks; the stateful machine also checks
that each page is in exactly one place (free, owned by one live request, or in the tree) and that
`match_prefix` returns the very pages that were inserted for a prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_events import BlockSet, prefix_hashes
from engine.kv_manager import KVManager
from engine.memory.allocator import IntegrityError, OutOfPagesError, PageAllocator, PageState
from engine.memory.kv_cache import ReqToTokenPool
from engine.memory.radix_cache import RadixCache, RadixNode
from engine.request import Req
from engine.sampling import SamplingParams


def check(allocator: PageAllocator, cache: RadixCache | None = None) -> None:
    allocator.check_integrity()
    if cache is not None:
        cache.check_integrity()


def cached_request(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Run one request to completion: reuse the cached prefix, allocate the rest, insert."""
    match = cache.match_prefix(tokens)
    cache.lock(match.node)
    own = cache.allocator.allocate(len(tokens) // cache.page_size - match.num_pages)
    cache.insert(tokens, match.pages + own, owned_from=match.num_pages)
    cache.unlock(match.node)
    return match.pages + own


@pytest.fixture
def allocator() -> PageAllocator:
    return PageAllocator(16)


@pytest.fixture
def cache(allocator: PageAllocator) -> RadixCache:
    return RadixCache(allocator, page_size=4)


# --- PageAllocator ------------------------------------------------------------------------------


def test_allocate_and_free_basics(allocator: PageAllocator) -> None:
    assert (allocator.total, allocator.num_free) == (15, 15)
    pages = allocator.allocate(4)
    assert pages == [1, 2, 3, 4]
    assert all(allocator.state_of(p) is PageState.USED for p in pages)
    assert (allocator.num_free, allocator.num_used) == (11, 4)
    check(allocator)
    allocator.free(pages)
    assert (allocator.num_free, allocator.num_used) == (15, 0)
    assert allocator.allocate(0) == []
    check(allocator)


def test_scratch_page_is_never_handed_out(allocator: PageAllocator) -> None:
    pages = allocator.allocate(allocator.total)
    assert PageAllocator.SCRATCH_PAGE not in pages
    assert sorted(pages) == list(range(1, 16))
    check(allocator)


def test_allocate_more_than_free_raises_and_allocates_nothing(allocator: PageAllocator) -> None:
    allocator.allocate(10)
    with pytest.raises(OutOfPagesError, match="need 6 pages, 5 free"):
        allocator.allocate(6)
    assert (allocator.num_free, allocator.num_used) == (5, 10)
    assert allocator.allocate(5) == [11, 12, 13, 14, 15]
    check(allocator)


def test_allocate_negative_raises(allocator: PageAllocator) -> None:
    with pytest.raises(ValueError):
        allocator.allocate(-1)


def test_too_small_pool_raises() -> None:
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        PageAllocator(1)


@pytest.mark.parametrize(
    "bad_free",
    [
        pytest.param(lambda a, pages: a.free([pages[0]]), id="double-free"),
        pytest.param(lambda a, pages: a.free([9]), id="free-a-free-page"),
        pytest.param(lambda a, pages: a.free([0]), id="free-scratch"),
        pytest.param(lambda a, pages: a.free([16]), id="out-of-range"),
        pytest.param(lambda a, pages: a.free([pages[1], pages[1]]), id="duplicate-in-call"),
        pytest.param(lambda a, pages: a.free_cached([pages[1]]), id="free-cached-of-used"),
    ],
)
def test_bad_frees_raise_integrity_error(
    allocator: PageAllocator, bad_free: Callable[[PageAllocator, list[int]], None]
) -> None:
    pages = allocator.allocate(3)
    allocator.free([pages[0]])
    before = (allocator.num_free, allocator.num_used)
    with pytest.raises(IntegrityError):
        bad_free(allocator, pages)
    # A rejected call changes nothing.
    assert (allocator.num_free, allocator.num_used) == before
    check(allocator)


def test_allocations_after_frees_are_ascending_and_contiguous(allocator: PageAllocator) -> None:
    pages = allocator.allocate(12)
    allocator.free([pages[9], pages[2], pages[7], pages[3], pages[4], pages[5], pages[6]])
    # Freed out of order: 3..8 and 10, plus the never-used tail 13..15.
    again = allocator.allocate(5)
    assert again == [3, 4, 5, 6, 7]
    allocator.free([12, 11, 9])
    run = allocator.allocate(4)
    assert run == sorted(run)
    assert run == [8, 9, 10, 11]
    check(allocator)


def test_cached_transitions(allocator: PageAllocator) -> None:
    pages = allocator.allocate(4)
    allocator.mark_cached(pages[:2])
    assert allocator.pages_in(PageState.CACHED) == set(pages[:2])
    assert (allocator.num_used, allocator.num_cached) == (2, 2)
    with pytest.raises(IntegrityError):
        allocator.free(pages[:1])  # CACHED pages go back via free_cached only
    with pytest.raises(IntegrityError):
        allocator.mark_cached(pages[:1])  # already CACHED
    allocator.free_cached(pages[:2])
    allocator.free(pages[2:])
    assert (allocator.num_free, allocator.num_used, allocator.num_cached) == (15, 0, 0)
    check(allocator)


# --- RadixCache ---------------------------------------------------------------------------------


def test_match_on_empty_tree(cache: RadixCache) -> None:
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert match.pages == [] and match.node is cache.root
    check(cache.allocator, cache)


def test_insert_then_match_returns_same_pages(cache: RadixCache) -> None:
    tokens = list(range(12))
    pages = cached_request(cache, tokens)
    assert cache.match_prefix(tokens).pages == pages
    assert cache.match_prefix([*tokens, 99, 98, 97, 96]).pages == pages
    assert cache.allocator.num_cached == 3 and cache.evictable_pages == 3
    check(cache.allocator, cache)


def test_partial_page_tail_is_ignored(cache: RadixCache) -> None:
    tokens = list(range(10))
    pages = cached_request(cache, tokens)
    assert len(pages) == 2
    assert cache.cached_pages == 2
    assert cache.match_prefix(tokens).pages == pages
    assert cache.match_prefix(tokens[:7]).pages == pages[:1]
    assert cache.match_prefix(tokens[:3]).pages == []
    check(cache.allocator, cache)


def test_insert_rejects_page_count_mismatch(cache: RadixCache) -> None:
    own = cache.allocator.allocate(3)
    with pytest.raises(ValueError, match="2 full pages of tokens but 3 page ids"):
        cache.insert(list(range(10)), own, owned_from=0)


def test_match_ending_inside_a_node_splits_it(cache: RadixCache) -> None:
    tokens = list(range(16))
    pages = cached_request(cache, tokens)
    # Diverges inside the third page: the 4-page node splits after 2 pages.
    match = cache.match_prefix([*tokens[:9], 77, 77, 77])
    assert match.pages == pages[:2]
    assert match.node.pages == pages[:2] and match.node.key == tokens[:8]
    (lower,) = match.node.children.values()
    assert lower.pages == pages[2:] and lower.key == tokens[8:]
    assert cache.match_prefix(tokens).pages == pages
    check(cache.allocator, cache)


def test_insert_of_cached_prefix_frees_duplicate_pages(cache: RadixCache) -> None:
    tokens = list(range(8))
    first = cached_request(cache, tokens)
    # A second request computed the same prefix itself (it started before the first finished).
    longer = [*tokens, 8, 9, 10, 11]
    own = cache.allocator.allocate(3)
    assert cache.allocator.num_used == 3
    cache.insert(longer, own, owned_from=0)
    assert cache.allocator.num_used == 0
    assert cache.allocator.state_of(own[0]) is PageState.FREE
    assert cache.allocator.state_of(own[1]) is PageState.FREE
    assert cache.match_prefix(longer).pages == [*first, own[2]]
    check(cache.allocator, cache)


def test_insert_claiming_more_cached_pages_than_tree_holds_raises(cache: RadixCache) -> None:
    own = cache.allocator.allocate(2)
    with pytest.raises(IntegrityError, match="claims 1 cached pages, tree holds 0"):
        cache.insert(list(range(8)), own, owned_from=1)


def test_lock_prevents_eviction_and_unlock_allows_it(cache: RadixCache) -> None:
    tokens = list(range(8))
    cached_request(cache, tokens)
    node = cache.match_prefix(tokens).node
    cache.lock(node)
    assert cache.evictable_pages == 0
    assert cache.evict(100) == 0
    cache.reset()
    assert cache.allocator.num_cached == 2
    check(cache.allocator, cache)
    cache.unlock(node)
    assert cache.evictable_pages == 2
    assert cache.evict(1) == 2  # whole leaves go, so at least the requested number
    assert cache.allocator.num_cached == 0 and cache.allocator.num_free == 15
    check(cache.allocator, cache)
    with pytest.raises(IntegrityError, match="unlocked more often than locked"):
        cache.unlock(node)


def test_lock_on_shared_prefix_keeps_only_that_path(cache: RadixCache) -> None:
    base = list(range(4))
    cached_request(cache, [*base, 10, 11, 12, 13])
    cached_request(cache, [*base, 20, 21, 22, 23])
    shared = cache.match_prefix(base).node
    cache.lock(shared)
    assert cache.evictable_pages == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([*base, 10, 11, 12, 13]).num_pages == 1
    cache.unlock(shared)
    check(cache.allocator, cache)


def test_evict_frees_least_recently_used_leaves_first(cache: RadixCache) -> None:
    old, mid, new = [1] * 8, [2] * 8, [3] * 8
    for tokens in (old, mid, new):
        cached_request(cache, tokens)
    cache.match_prefix(old)  # touch: `mid` is now the least recently used, then `new`
    # Survivors are read off the root's children: matching would touch them.
    assert cache.evict(2) == 2
    assert set(cache.root.children) == {(1,) * 4, (3,) * 4}
    assert cache.evict(2) == 2
    assert set(cache.root.children) == {(1,) * 4}
    assert cache.match_prefix(old).num_pages == 2
    check(cache.allocator, cache)


def test_split_does_not_refresh_the_unused_lower_half(cache: RadixCache) -> None:
    old, newer = [1] * 8, [2] * 8
    cached_request(cache, old)
    cached_request(cache, newer)
    cache.match_prefix([1, 1, 1, 1, 9, 9, 9, 9])  # uses only the first page of `old`: splits
    # `old`'s second page was last used before `newer` was inserted, so it goes first.
    assert cache.evict(1) == 1
    assert cache.match_prefix(newer).num_pages == 2
    assert cache.match_prefix(old).num_pages == 1
    check(cache.allocator, cache)


def test_evict_climbs_to_parent_once_its_children_are_gone(cache: RadixCache) -> None:
    base = [5] * 4
    cached_request(cache, [*base, 1, 1, 1, 1])
    cached_request(cache, [*base, 2, 2, 2, 2])
    assert cache.evict(3) == 3
    assert cache.cached_pages == 0 and cache.evictable_pages == 0
    check(cache.allocator, cache)


def test_evictable_pages_bookkeeping(cache: RadixCache) -> None:
    a = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    b = [1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4]
    cached_request(cache, a)
    assert cache.evictable_pages == 3
    node_a = cache.match_prefix(a).node
    cache.lock(node_a)
    assert cache.evictable_pages == 0
    cached_request(cache, b)  # splits a's node after 2 pages, adds one unlocked page
    assert cache.evictable_pages == 1
    node_b = cache.match_prefix(b).node
    cache.lock(node_b)
    assert cache.evictable_pages == 0
    cache.unlock(node_a)
    assert cache.evictable_pages == 1
    check(cache.allocator, cache)
    cache.unlock(node_b)
    assert cache.evictable_pages == 4 == cache.cached_pages
    cache.reset()
    assert cache.evictable_pages == 0 and cache.cached_pages == 0
    check(cache.allocator, cache)


# --- Stateful model -----------------------------------------------------------------------------

VOCAB = st.integers(min_value=0, max_value=3)
POOL_PAGES = 64
MAX_REQUEST_PAGES = 10
MAX_LIVE_REQUESTS = 6  # the scheduler's cap on running requests


@dataclass
class LiveRequest:
    tokens: list[int]  # truncated to whole pages
    node: RadixNode
    matched_pages: list[int]
    own_pages: list[int]


class MemoryMachine(RuleBasedStateMachine):
    """Requests start (reuse prefix, lock, allocate), finish (insert), abort; eviction and reset
    interleave. `reference` maps each cached prefix (a tuple of tokens, whole pages) to the id of
    its last page: it mirrors the tree and checks what `match_prefix` returns."""

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.allocator = PageAllocator(POOL_PAGES)
        self.cache = RadixCache(self.allocator, self.page_size)
        self.cache.record_events()
        self.published = BlockSet()  # what a consumer of the cache's KV events knows
        self.live: dict[int, LiveRequest] = {}
        self.next_id = 0
        self.started_tokens: list[list[int]] = []
        self.reference: dict[tuple[int, ...], int] = {}

    # -- helpers --

    def draw_tokens(self, data: st.DataObject, shared: bool) -> list[int]:
        ps = self.page_size
        max_len = MAX_REQUEST_PAGES * ps + ps - 1
        num_pages = data.draw(st.integers(1, MAX_REQUEST_PAGES), label="pages")
        suffix = data.draw(
            st.lists(VOCAB, min_size=num_pages * ps, max_size=num_pages * ps + ps - 1)
        )
        # Bases: cached prefixes; live requests' tokens (cutting inside their locked path splits
        # locked nodes); recent requests (two requests compute the same prefix, the later insert
        # finds it cached).
        sources = [
            sorted(self.reference),
            [tuple(req.tokens) for req in self.live.values()],
            [tuple(t) for t in self.started_tokens[-4:]],
        ]
        sources = [bases for bases in sources if bases]
        if not shared or not sources:
            return suffix
        bases = data.draw(st.sampled_from(sources), label="source")
        base = list(data.draw(st.sampled_from(bases), label="base"))
        cut = data.draw(st.integers(0, len(base)), label="cut")
        tail = data.draw(st.sampled_from([[], suffix[:ps], suffix]), label="tail")
        return (base[:cut] + tail)[:max_len]

    def prefix(self, tokens: list[int], num_pages: int) -> tuple[int, ...]:
        return tuple(tokens[: num_pages * self.page_size])

    def checked_match(self, tokens: list[int]) -> tuple[RadixNode, list[int]]:
        match = self.cache.match_prefix(tokens)
        for k, page in enumerate(match.pages, start=1):
            assert self.reference[self.prefix(tokens, k)] == page
        longer = match.num_pages + 1
        if longer * self.page_size <= len(tokens):
            assert self.prefix(tokens, longer) not in self.reference, "match stopped too early"
        return match.node, match.pages

    def evict(self, num_pages: int) -> int:
        freed = self.cache.evict(num_pages)
        self.reference = {
            key: page
            for key, page in self.reference.items()
            if self.allocator.state_of(page) is PageState.CACHED
        }
        return freed

    def record_insert(self, tokens: list[int], pages: list[int], owned_from: int) -> None:
        for k, page in enumerate(pages, start=1):
            key = self.prefix(tokens, k)
            if k <= owned_from:
                assert self.reference[key] == page
            self.reference.setdefault(key, page)

    # -- rules --

    @precondition(lambda self: len(self.live) < MAX_LIVE_REQUESTS)
    @rule(data=st.data(), shared=st.booleans())
    def start_request(self, data: st.DataObject, shared: bool) -> None:
        self.start(self.draw_tokens(data, shared))

    def start(self, tokens: list[int]) -> None:
        self.started_tokens.append(tokens)
        tokens = tokens[: len(tokens) // self.page_size * self.page_size]
        node, matched = self.checked_match(tokens)
        self.cache.lock(node)
        need = len(tokens) // self.page_size - len(matched)
        if need > self.allocator.num_free:
            self.evict(need - self.allocator.num_free)
        if need > self.allocator.num_free:
            self.cache.unlock(node)  # would wait in the scheduler's queue
            return
        own = self.allocator.allocate(need)
        self.live[self.next_id] = LiveRequest(tokens, node, matched, own)
        self.next_id += 1

    def pick_request(self, data: st.DataObject) -> LiveRequest:
        return self.live.pop(data.draw(st.sampled_from(sorted(self.live)), label="request"))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        req = self.pick_request(data)
        pages = req.matched_pages + req.own_pages
        self.cache.insert(req.tokens, pages, owned_from=len(req.matched_pages))
        self.record_insert(req.tokens, pages, len(req.matched_pages))
        self.cache.unlock(req.node)
        self.checked_match(req.tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort_request(self, data: st.DataObject) -> None:
        req = self.pick_request(data)
        self.allocator.free(req.own_pages)
        self.cache.unlock(req.node)

    # Hypothesis tries argument-less rules first; on an empty tree they would waste steps.
    @precondition(lambda self: self.cache.evictable_pages > 0)
    @rule(num_pages=st.integers(0, MAX_REQUEST_PAGES))
    def evict_pages(self, num_pages: int) -> None:
        evictable = self.cache.evictable_pages
        freed = self.evict(num_pages)
        assert min(num_pages, evictable) <= freed <= evictable
        assert self.cache.evictable_pages == evictable - freed

    @precondition(lambda self: self.cache.evictable_pages > 0)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.evict(0)  # prune the reference
        assert self.cache.evictable_pages == 0
        locked = {p for req in self.live.values() for p in req.matched_pages}
        assert locked == self.path_pages()
        assert self.allocator.pages_in(PageState.CACHED) == locked

    def path_pages(self) -> set[int]:
        """Pages on the root paths of live requests' nodes: what a reset must keep."""
        pages: set[int] = set()
        for req in self.live.values():
            node: RadixNode | None = req.node
            while node is not None:
                pages.update(node.pages)
                node = node.parent
        return pages

    # -- invariants --

    @invariant()
    def integrity(self) -> None:
        check(self.allocator, self.cache)

    @invariant()
    def every_page_in_exactly_one_place(self) -> None:
        owned = [p for req in self.live.values() for p in req.own_pages]
        assert len(owned) == len(set(owned)), "a page is owned by two requests"
        assert set(owned) == self.allocator.pages_in(PageState.USED), "USED page leaked"
        cached = self.allocator.pages_in(PageState.CACHED)
        assert set(self.reference.values()) == cached
        assert len(self.reference) == len(cached), "two prefixes map to one page"
        free = self.allocator.pages_in(PageState.FREE)
        assert len(free) + len(owned) + len(cached) == self.allocator.total

    @invariant()
    def kv_events_describe_the_tree(self) -> None:
        """Applied in order, the recorded events give exactly the tree's blocks, each with the
        hash `prefix_hashes` computes from its prefix's tokens and its parent's hash."""
        self.published.apply(self.cache.take_events())
        by_prefix = {key: prefix_hashes(key, self.page_size)[-1] for key in self.reference if key}
        assert set(self.published.blocks) == set(by_prefix.values())
        for key, h in by_prefix.items():
            parent, tokens = self.published.blocks[h]
            assert tokens == key[-self.page_size :]
            expected_parent = by_prefix.get(key[: -self.page_size])
            assert parent == expected_parent
        rebuilt = BlockSet()
        rebuilt.apply(self.published.snapshot(self.page_size, "CPU"))
        assert rebuilt.blocks == self.published.blocks

    @invariant()
    def locked_pages_stay_cached(self) -> None:
        for req in self.live.values():
            for k, page in enumerate(req.matched_pages, start=1):
                assert self.allocator.state_of(page) is PageState.CACHED
                assert self.reference.get(self.prefix(req.tokens, k)) == page
            assert req.node is self.cache.root or req.node.lock_ref > 0


def machine_for(size: int) -> type[MemoryMachine]:
    class Machine(MemoryMachine):
        page_size = size

    Machine.__name__ = Machine.__qualname__ = f"MemoryMachinePageSize{size}"
    Machine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
    return Machine


TestMemoryPageSize1 = machine_for(1).TestCase
TestMemoryPageSize4 = machine_for(4).TestCase


def decode_ready_requests(kv: KVManager, lens: list[int]) -> list[Req]:
    """Requests whose `lens` tokens are in the KV, each about to decode one more."""
    reqs = []
    for i, n in enumerate(lens):
        req = Req(rid=f"r{i}", prompt_ids=list(range(n)), params=SamplingParams(), sampler=None)  # type: ignore[arg-type]
        req.slot = kv.req_to_token.alloc_slot()
        assert kv.reserve(req, n)
        req.kv_len = n
        reqs.append(req)
    kv.flush_table()
    return reqs


def test_a_decode_steps_batched_reservation_equals_one_at_a_time() -> None:
    """`reserve_decodes` (one allocation per step) gives every request the same pages and
    table entries as `reserve(req, 1)` request by request, and is all or nothing."""
    lens = [4, 3, 8, 1, 7, 4]  # page size 4: full last pages need a new page
    results = []
    for batched in (False, True):
        kv = KVManager(PageAllocator(16), ReqToTokenPool(8, 32, torch.device("cpu")), 4, None)
        reqs = decode_ready_requests(kv, lens)
        if batched:
            assert kv.reserve_decodes(reqs)
        else:
            assert all(kv.reserve(req, 1) for req in reqs)
        kv.flush_table()
        results.append(([r.pages for r in reqs], kv.req_to_token.table.clone()))
        kv.allocator.check_integrity()
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])

    kv = KVManager(PageAllocator(8), ReqToTokenPool(8, 32, torch.device("cpu")), 4, None)
    reqs = decode_ready_requests(kv, [4, 8, 4])  # 4 pages used, 3 free; each needs one more
    kv.allocator.allocate(1)  # 2 free for the 3 new pages the step needs
    before = [list(r.pages) for r in reqs]
    assert not kv.reserve_decodes(reqs)
    assert [r.pages for r in reqs] == before and kv.allocator.num_free == 2


def test_token_ids_is_a_slice_of_all_ids_without_the_copy() -> None:
    req = Req(rid="r", prompt_ids=[1, 2, 3], params=SamplingParams(), sampler=None)  # type: ignore[arg-type]
    req.output_ids = [4, 5]
    for start in range(6):
        for end in range(start, 6):
            assert req.token_ids(start, end) == req.all_ids[start:end], (start, end)
