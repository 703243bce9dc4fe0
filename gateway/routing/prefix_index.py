"""The gateway's global prefix index: which node holds which KV block, from the nodes' events.

Fed by `gateway/routing/kv_feed.py` (one feed per node) and read by the `kv_aware` routing policy
(`gateway/routing/policies.py`). A block is a page of token ids named by its chained hash
(`engine/kv_events.py`), so a prompt's hashes, computed here from its token ids, are looked up
directly: a node holds the first k blocks of a prompt when it holds each of their hashes (it
cannot hold a block without the ones before it, as its radix cache is a tree).

A node is *tracked* from the moment its feed has a consistent view (a snapshot applied) until
its feed stops (the node left, re-registered or its events went bad); an untracked node holds
nothing as far as routing is concerned. Each gateway worker keeps its own index.

*Expected* blocks bridge the events' lag: when a request this gateway routed ends, the blocks
its nodes cache for it (the prompt on a prefill node; prompt and output on the decode node) are
counted as held for `EXPECT_S` seconds or until the node's events say otherwise (a removal or a
clear drops them at once). Without them a conversation's next turn, sent as soon as the last
one ended, could be routed before the decode node's events arrived, as if nothing were cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, prefix_hashes

EXPECT_S = 5.0  # an expected block counts this long unless the node's events come first


@dataclass
class NodeBlocks:
    block_size: int
    hashes: set[int] = field(default_factory=set)
    expected: dict[int, float] = field(default_factory=dict)  # hash -> until (monotonic)

    def holds(self, block_hash: int, now: float) -> bool:
        return block_hash in self.hashes or self.expected.get(block_hash, 0.0) > now


class PrefixIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._nodes: dict[str, NodeBlocks] = {}
        self._hash_memo: tuple[tuple[int, ...], int, list[int]] | None = None

    def track(self, node_id: str, block_size: int) -> None:
        """Start (or restart) holding `node_id`'s blocks, from none."""
        self._nodes[node_id] = NodeBlocks(block_size)

    def drop(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)

    def tracked(self, node_id: str) -> bool:
        return node_id in self._nodes

    def num_blocks(self, node_id: str) -> int:
        node = self._nodes.get(node_id)
        return len(node.hashes) if node is not None else 0

    @property
    def node_ids(self) -> list[str]:
        return sorted(self._nodes)

    def apply(self, node_id: str, events: Iterable[KVEvent]) -> None:
        node = self._nodes[node_id]
        for event in events:
            if isinstance(event, BlockStored):
                node.hashes.update(event.block_hashes)
                for h in event.block_hashes:
                    node.expected.pop(h, None)  # confirmed
            elif isinstance(event, BlockRemoved):
                node.hashes.difference_update(event.block_hashes)
                for h in event.block_hashes:
                    node.expected.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                node.hashes.clear()
                node.expected.clear()

    def expect(self, node_id: str, token_ids: Sequence[int]) -> None:
        """`node_id` is about to hold the whole blocks of `token_ids` (a request this gateway
        routed there just ended): count them as held until its events confirm them or
        `EXPECT_S` passes. Nothing for an untracked node."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        now = self._clock()
        until = now + EXPECT_S
        node.expected = {h: t for h, t in node.expected.items() if t > now}  # expired out
        for h in prefix_hashes(token_ids, node.block_size):
            if h not in node.hashes:
                node.expected[h] = until

    def cached_tokens(self, node_id: str, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens `node_id` holds the KV of (whole blocks, a prefix of the prompt); never
        all of them, since a node runs at least the last prompt token to get its logits."""
        node = self._nodes.get(node_id)
        if node is None or not (node.hashes or node.expected):
            return 0
        now = self._clock()
        matched = 0
        for h in self._hashes(prompt_ids, node.block_size):
            if not node.holds(h, now):
                break
            matched += 1
        return min(matched * node.block_size, max(len(prompt_ids) - 1, 0))

    def _hashes(self, prompt_ids: Sequence[int], block_size: int) -> list[int]:
        # One routing decision asks for several nodes (and both sides) with one prompt.
        key = tuple(prompt_ids)
        memo = self._hash_memo
        if memo is None or memo[1] != block_size or memo[0] != key:
            memo = self._hash_memo = (key, block_size, prefix_hashes(prompt_ids, block_size))
        return memo[2]
