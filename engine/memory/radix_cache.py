"""Radix (prefix) cache over KV pages, at page granularity.

Edges are labelled with token runs whose length is a multiple of `page_size`; each node owns the
pages holding those tokens' KV. Pages in the tree are CACHED in the allocator. A request that
reuses a prefix locks the path to its node (`lock_ref` counts users along the path), so eviction,
which frees the least recently used unlocked leaves, never takes pages a live request reads.

Invariants (`check_integrity`): the tree's pages are exactly the allocator's CACHED pages, each
once; lock counts are non-negative and a parent is locked at least as often as any child;
`evictable_pages` equals the pages of unlocked nodes; every page has its block hash
(`engine/kv_events.py`: chained over the pages before it).

KV events: after `record_events()` every change of the tree's block set is recorded (pages
stored by `insert`, removed by `evict`; a split changes no block) and `take_events` hands them
over, once per engine step, to the node's publisher (`engine/node/kv_publisher.py`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv_events import ROOT_HASH, BlockRemoved, BlockStored, KVEvent, block_hash
from engine.memory.allocator import IntegrityError, PageAllocator, PageState


@dataclass(eq=False)
class RadixNode:
    key: list[int]
    pages: list[int]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hashes: list[int] = field(default_factory=list)  # block hash of each page

    @property
    def last_hash(self) -> int:
        """The hash the next block below this node chains on."""
        return self.hashes[-1] if self.hashes else ROOT_HASH


@dataclass
class PrefixMatch:
    pages: list[int]
    node: RadixNode

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, medium: str = "GPU") -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.medium = medium  # where the pages live, as KV events name it: GPU or CPU
        self.root = RadixNode(key=[], pages=[], parent=None, lock_ref=1)
        self.evictable_pages = 0
        self._clock = itertools.count(1)
        self._events: list[KVEvent] | None = None  # None: not recording

    def record_events(self) -> None:
        """Record every block stored and removed from now on (the tree must be empty)."""
        if self.root.children:
            raise IntegrityError("record_events on a non-empty cache: its blocks would be unknown")
        self._events = []

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def _page_key(self, tokens: Sequence[int], page: int) -> tuple[int, ...]:
        return tuple(tokens[page * self.page_size : (page + 1) * self.page_size])

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of `tokens` in whole pages; the returned node ends right there."""
        node, pages = self.root, []
        n_pages = len(tokens) // self.page_size
        done = 0
        now = next(self._clock)
        while done < n_pages:
            child = node.children.get(self._page_key(tokens, done))
            if child is None:
                break
            shared = self._shared_pages(child, tokens, done)
            if shared < len(child.pages):
                child = self._split(child, shared)
            # Stamped after the split: the unused lower half keeps its old time for LRU eviction.
            child.last_access = now
            pages.extend(child.pages)
            done += shared
            node = child
        return PrefixMatch(pages=pages, node=node)

    def _shared_pages(self, node: RadixNode, tokens: Sequence[int], start_page: int) -> int:
        ps = self.page_size
        limit = min(len(node.pages), len(tokens) // ps - start_page)
        base = start_page * ps
        for i in range(limit):
            if node.key[i * ps : (i + 1) * ps] != list(tokens[base + i * ps : base + (i + 1) * ps]):
                return i
        return limit

    def _split(self, node: RadixNode, at_page: int) -> RadixNode:
        """Cut `node` after `at_page` pages; returns the new upper half (a parent of `node`)."""
        ps = self.page_size
        assert node.parent is not None
        upper = RadixNode(
            key=node.key[: at_page * ps],
            pages=node.pages[:at_page],
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            hashes=node.hashes[:at_page],
        )
        node.parent.children[tuple(upper.key[:ps])] = upper
        node.key, node.pages = node.key[at_page * ps :], node.pages[at_page:]
        node.hashes = node.hashes[at_page:]
        node.parent = upper
        upper.children[tuple(node.key[:ps])] = node
        return upper

    def insert(self, tokens: Sequence[int], pages: Sequence[int], owned_from: int) -> RadixNode:
        """Cache `pages` (one per full page of `tokens`).

        `pages[owned_from:]` are USED pages the caller owns; each either joins the tree (CACHED)
        or, when the tree already holds that prefix, is freed. `pages[:owned_from]` must be the
        pages the caller got from `match_prefix` (already in the tree).
        """
        n_pages = len(tokens) // self.page_size
        if len(pages) != n_pages:
            raise ValueError(f"{n_pages} full pages of tokens but {len(pages)} page ids")
        match = self.match_prefix(tokens)
        dup = match.num_pages
        if dup < owned_from:
            raise IntegrityError(f"caller claims {owned_from} cached pages, tree holds {dup}")
        self.allocator.free(pages[owned_from:dup])
        if dup == n_pages:
            return match.node
        rest = list(pages[dup:])
        self.allocator.mark_cached(rest)
        key = list(tokens[dup * self.page_size : n_pages * self.page_size])
        leaf = RadixNode(
            key=key,
            pages=rest,
            parent=match.node,
            last_access=next(self._clock),
            hashes=self._chain(match.node, key),
        )
        if self._events is not None:
            parent = match.node.hashes[-1] if match.node.hashes else None
            self._events.append(
                BlockStored(list(leaf.hashes), parent, list(key), self.page_size, self.medium)
            )
        match.node.children[self._page_key(leaf.key, 0)] = leaf
        self.evictable_pages += len(rest)
        return leaf

    def _chain(self, parent: RadixNode, key: list[int]) -> list[int]:
        hashes, last, ps = [], parent.last_hash, self.page_size
        for start in range(0, len(key), ps):
            last = block_hash(last, key[start : start + ps])
            hashes.append(last)
        return hashes

    def lock(self, node: RadixNode) -> None:
        cur: RadixNode | None = node
        while cur is not None and cur is not self.root:
            if cur.lock_ref == 0:
                self.evictable_pages -= len(cur.pages)
            cur.lock_ref += 1
            cur = cur.parent

    def unlock(self, node: RadixNode) -> None:
        cur: RadixNode | None = node
        while cur is not None and cur is not self.root:
            if cur.lock_ref <= 0:
                raise IntegrityError("radix node unlocked more often than locked")
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self.evictable_pages += len(cur.pages)
            cur = cur.parent

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages from unlocked LRU leaves if possible; returns freed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[self._page_key(node.key, 0)]
            self.allocator.free_cached(node.pages)
            self.evictable_pages -= len(node.pages)
            if self._events is not None:
                self._events.append(BlockRemoved(list(node.hashes), self.medium))
            freed += len(node.pages)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> None:
        """Drop every unlocked page (flush); locked paths stay."""
        self.evict(self.allocator.total)

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _leaves(self) -> list[RadixNode]:
        return [n for n in self._nodes() if not n.children and n is not self.root]

    @property
    def cached_pages(self) -> int:
        return sum(len(n.pages) for n in self._nodes())

    def check_integrity(self) -> None:
        seen: list[int] = []
        evictable = 0
        for node in self._nodes():
            seen.extend(node.pages)
            if node is self.root:
                continue
            if len(node.key) != len(node.pages) * self.page_size or not node.pages:
                raise IntegrityError("radix node key/pages length mismatch or empty node")
            if len(node.hashes) != len(node.pages):
                raise IntegrityError("radix node without a block hash for each page")
            assert node.parent is not None
            parent_locks = node.parent.lock_ref if node.parent is not self.root else node.lock_ref
            if node.lock_ref < 0 or parent_locks < node.lock_ref:
                raise IntegrityError("radix lock counts are inconsistent")
            if node.lock_ref == 0:
                evictable += len(node.pages)
        if len(seen) != len(set(seen)):
            raise IntegrityError("a page appears twice in the radix cache")
        if set(seen) != self.allocator.pages_in(PageState.CACHED):
            raise IntegrityError("radix cache pages != allocator CACHED pages")
        if evictable != self.evictable_pages:
            raise IntegrityError(f"evictable_pages {self.evictable_pages} != counted {evictable}")
