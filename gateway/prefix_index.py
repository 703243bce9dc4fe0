"""The gateway's global prefix index: which node holds which KV block, from the nodes' events.

Fed by `gateway/kv_feed.py` (one feed per node) and read by the `kv_aware` routing policy
(`gateway/routing.py`). A block is a page of token ids named by its chained hash
(`engine/kv_events.py`), so a prompt's hashes, computed here from its token ids, are looked up
directly: a node holds the first k blocks of a prompt when it holds each of their hashes (it
cannot hold a block without the ones before it, as its radix cache is a tree).

A node is *tracked* from the moment its feed has a consistent view (a snapshot applied) until
its feed stops (the node left, re-registered or its events went bad); an untracked node holds
nothing as far as routing is concerned. Each gateway worker keeps its own index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, prefix_hashes


@dataclass
class NodeBlocks:
    block_size: int
    hashes: set[int] = field(default_factory=set)


class PrefixIndex:
    def __init__(self) -> None:
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
            elif isinstance(event, BlockRemoved):
                node.hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                node.hashes.clear()

    def cached_tokens(self, node_id: str, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens `node_id` holds the KV of (whole blocks, a prefix of the prompt); never
        all of them, since a node runs at least the last prompt token to get its logits."""
        node = self._nodes.get(node_id)
        if node is None or not node.hashes:
            return 0
        matched = 0
        for h in self._hashes(prompt_ids, node.block_size):
            if h not in node.hashes:
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
