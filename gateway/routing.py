"""Routing: which prefill node and which decode node take a request.

One small interface, `RoutingPolicy.pick(nodes, prompt_ids)`, and a registry of policies by
name; the prefill and decode sides each get their own policy instance (flags
`--prefill-policy`, `--decode-policy`).

- `round_robin`: the next node in id order.
- `least_load`: the node with the fewest requests (`LiveNode.busy`: the gateway's own in-flight
  count or the bootstrap heartbeat's, whichever is higher), then the lowest KV usage.
- `prefix_aware`: prompts are cut into blocks of `prefix_block_tokens`; each block's hash chains
  the hashes before it, so a hash stands for a whole prefix. The policy remembers (LRU, bounded)
  which node last ran each prefix and sends a prompt to the node holding its longest known
  prefix: that node's radix cache has those pages, so the prompt skips that much prefill. With
  no match, or when the matching node is busier than the idlest by more than
  `prefix_balance_slack` requests, it falls back to `least_load`.

`Router.choose` applies them and the conditional disaggregation rule: a prompt of at most
`local_prefill_max_tokens`, or one arriving when no prefill node is live, goes to the decode
node alone (it prefills locally); with no prefill nodes at all the cluster is simply colocated.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from gateway.config import RoutingConfig
from gateway.errors import unavailable
from gateway.nodes import COLOCATED, DECODE, PREFILL, LiveNode, NodeDirectory


class RoutingPolicy(ABC):
    def __init__(self, config: RoutingConfig) -> None:
        self.config = config

    @abstractmethod
    def pick(self, nodes: Sequence[LiveNode], prompt_ids: Sequence[int]) -> LiveNode:
        """One of `nodes` (never empty, sorted by id) for this prompt."""


class RoundRobin(RoutingPolicy):
    def __init__(self, config: RoutingConfig) -> None:
        super().__init__(config)
        self._counter = itertools.count()

    def pick(self, nodes: Sequence[LiveNode], prompt_ids: Sequence[int]) -> LiveNode:
        return nodes[next(self._counter) % len(nodes)]


class LeastLoad(RoutingPolicy):
    def __init__(self, config: RoutingConfig) -> None:
        super().__init__(config)
        self._tiebreak = itertools.count()

    def pick(self, nodes: Sequence[LiveNode], prompt_ids: Sequence[int]) -> LiveNode:
        # Rotate the start so equally loaded nodes share the work.
        start = next(self._tiebreak) % len(nodes)
        rotated = [*nodes[start:], *nodes[:start]]
        return min(rotated, key=lambda n: (n.busy, n.kv_usage))


class PrefixAware(RoutingPolicy):
    def __init__(self, config: RoutingConfig) -> None:
        super().__init__(config)
        self.block_tokens = config.prefix_block_tokens
        self.max_blocks = config.prefix_max_blocks
        self.balance_slack = config.prefix_balance_slack
        self.fallback = LeastLoad(config)
        self._owner: OrderedDict[int, str] = OrderedDict()  # prefix hash -> node id

    def prefix_hashes(self, prompt_ids: Sequence[int]) -> list[int]:
        hashes, running, size = [], 0, self.block_tokens
        for start in range(0, len(prompt_ids) - size + 1, size):
            running = hash((running, tuple(prompt_ids[start : start + size])))
            hashes.append(running)
        return hashes

    def pick(self, nodes: Sequence[LiveNode], prompt_ids: Sequence[int]) -> LiveNode:
        hashes = self.prefix_hashes(prompt_ids)
        by_id = {n.node_id: n for n in nodes}
        chosen = None
        for h in reversed(hashes):  # longest known prefix first
            owner = by_id.get(self._owner.get(h, ""))
            if owner is not None:
                chosen = owner
                break
        idlest = min(n.busy for n in nodes)
        if chosen is None or chosen.busy > idlest + self.balance_slack:
            chosen = self.fallback.pick(nodes, prompt_ids)
        self._remember(hashes, chosen.node_id)
        return chosen

    def _remember(self, hashes: list[int], node_id: str) -> None:
        for h in hashes:
            self._owner[h] = node_id
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_blocks:
            self._owner.popitem(last=False)


POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "prefix_aware": PrefixAware,
}


def make_policy(name: str, config: RoutingConfig) -> RoutingPolicy:
    try:
        return POLICIES[name](config)
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}: use one of {sorted(POLICIES)}"
        ) from None


@dataclass(frozen=True)
class Route:
    decode: LiveNode
    prefill: LiveNode | None  # None: the decode node prefills locally

    @property
    def nodes(self) -> tuple[LiveNode, ...]:
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)


class Router:
    def __init__(self, directory: NodeDirectory, config: RoutingConfig) -> None:
        self.directory = directory
        self.config = config
        self.prefill_policy = make_policy(config.prefill_policy, config)
        self.decode_policy = make_policy(config.decode_policy, config)

    def choose(self, prompt_ids: Sequence[int], excluded: Collection[str] = ()) -> Route:
        decodes = self.directory.live((DECODE, COLOCATED), excluded)
        if not decodes:
            known = self.directory.count(DECODE) + self.directory.count(COLOCATED)
            raise unavailable(
                f"no decode node can take the request ({known} registered, "
                f"{len(excluded)} failed for it): start a decode-server or retry later"
            )
        decode = self.decode_policy.pick(decodes, prompt_ids)
        if decode.role != DECODE or len(prompt_ids) <= self.config.local_prefill_max_tokens:
            return Route(decode, None)
        prefills = self.directory.live((PREFILL,), excluded)
        if not prefills:
            return Route(decode, None)
        return Route(decode, self.prefill_policy.pick(prefills, prompt_ids))
