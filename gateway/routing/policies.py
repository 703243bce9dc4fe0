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
- `kv_aware` (the default of both sides): routes on what the nodes' caches really hold, from
  the global prefix index their KV events feed (gateway/routing/prefix_index.py,
  gateway/routing/kv_feed.py). Each candidate costs `kv_compute_weight` x the prompt tokens it would
  have to compute (those past its cached prefix) + the side's load weight x its load in tokens
  (`LiveNode.load_tokens`: running and queued, not the evictable cache); the cheapest wins. On the
  prefill side load is compute queued (weight 1: the same unit as the hit); on the decode side it is
  the running streams' context, which costs bandwidth per step rather than compute once, so its
  weight is small (0.01) and a follow-up turn stays with the node holding its history unless that
  node carries a hundred times the history in extra streams. When no candidate publishes events (or
  none is synced yet) it is the side's old default: `prefix_aware` for prefill, `least_load`
  for decode.
- `worker_affinity` (never the default): gateway worker i (`gateway-server --workers N`, 0 for a
  single process) sends everything to node i mod M of the side's M nodes in id order, and to
  the least-loaded candidate only when that node cannot take the request (draining, cooling
  down after a failed connection, already failed for this request, full, or at its
  running-request cap: `Router.choose`). Why: with W workers and D nodes, every node
  otherwise keeps a stream to every worker and sends W small per-step messages (each worker's
  share of its running requests); pinned, a node sends fewer, larger messages, and both the
  gateway and the node spend less CPU per token (each message has a fixed cost, paid per
  message rather than per token). The cost: a node's load is
  only as even as SO_REUSEPORT's spread of client connections over the workers, and no cache
  or load signal moves a request off its node until the node refuses it.

`Router.choose` applies them to the decode nodes below their running-request cap (the
heartbeat's `max_running_requests`; all of them when none is below it: a request on a node at
its cap waits for one of its streams to end), and the conditional disaggregation rule: a
prompt of at most `local_prefill_max_tokens` tokens (with `kv_aware` on the decode side:
tokens beyond what the chosen decode node already holds, per the prefix index: a follow-up
turn whose history the node keeps), or one arriving when no prefill node is live, goes to the
decode node alone (it prefills locally); with no prefill nodes at all the cluster is simply
colocated.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from gateway.config import RoutingConfig
from gateway.errors import unavailable
from gateway.routing.nodes import COLOCATED, DECODE, PREFILL, LiveNode, NodeDirectory
from gateway.routing.prefix_index import PrefixIndex


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


class KVAware(RoutingPolicy):
    def __init__(
        self, config: RoutingConfig, index: PrefixIndex, fallback: RoutingPolicy, side: str
    ) -> None:
        super().__init__(config)
        self.index = index
        self.fallback = fallback
        self.load_weight = config.kv_load_weight(side)
        self._tiebreak = itertools.count()

    def cost(self, node: LiveNode, prompt_ids: Sequence[int]) -> float:
        to_compute = len(prompt_ids) - self.index.cached_tokens(node.node_id, prompt_ids)
        return self.config.kv_compute_weight * to_compute + self.load_weight * node.load_tokens

    def pick(self, nodes: Sequence[LiveNode], prompt_ids: Sequence[int]) -> LiveNode:
        if not any(self.index.tracked(n.node_id) for n in nodes):
            return self.fallback.pick(nodes, prompt_ids)
        start = next(self._tiebreak) % len(nodes)
        rotated = [*nodes[start:], *nodes[:start]]
        return min(rotated, key=lambda n: (self.cost(n, prompt_ids), n.busy))


class WorkerAffinity(RoutingPolicy):
    """Each gateway worker keeps to one node of the side (see the module docstring).

    The preferred node is `members()[worker_index % len(members())]`: `members` lists every
    node of the side in id order, routable or not, so that a node draining or failing moves
    only its own workers' requests (to the least-loaded candidate), not every worker's pin.
    Without `members` the candidates themselves are the list."""

    def __init__(
        self,
        config: RoutingConfig,
        worker_index: int = 0,
        members: Callable[[], Sequence[LiveNode]] | None = None,
    ) -> None:
        super().__init__(config)
        self.worker_index = worker_index
        self.members = members
        self.spill = LeastLoad(config)

    def preferred(self, nodes: Sequence[LiveNode]) -> LiveNode:
        pool = self.members() if self.members is not None else nodes
        pool = pool or nodes  # (never empty: the candidates are members too)
        return pool[self.worker_index % len(pool)]

    def pick(self, nodes: Sequence[LiveNode], prompt_ids: Sequence[int]) -> LiveNode:
        preferred = self.preferred(nodes).node_id
        candidate = next((n for n in nodes if n.node_id == preferred), None)
        if candidate is not None and not candidate.full:
            return candidate
        others = [n for n in nodes if n.node_id != preferred]  # a full one only if alone
        return self.spill.pick(others or nodes, prompt_ids)


POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "prefix_aware": PrefixAware,
    "kv_aware": KVAware,
    "worker_affinity": WorkerAffinity,
}
# What `kv_aware` does on a side where no node publishes KV events.
KV_AWARE_FALLBACK = {"prefill": "prefix_aware", "decode": "least_load"}


def make_policy(
    name: str,
    config: RoutingConfig,
    index: PrefixIndex | None = None,
    side: str = "prefill",
    *,
    worker_index: int = 0,
    members: Callable[[], Sequence[LiveNode]] | None = None,
) -> RoutingPolicy:
    """`worker_index` and `members` (every node of the side, by id): for `worker_affinity`."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}: use one of {sorted(POLICIES)}")
    if name == "kv_aware":
        fallback = make_policy(KV_AWARE_FALLBACK[side], config)
        return KVAware(config, index if index is not None else PrefixIndex(), fallback, side)
    if name == "worker_affinity":
        return WorkerAffinity(config, worker_index, members)
    return POLICIES[name](config)


@dataclass(frozen=True)
class Route:
    decode: LiveNode
    prefill: LiveNode | None  # None: the decode node prefills locally

    @property
    def nodes(self) -> tuple[LiveNode, ...]:
        return (self.decode,) if self.prefill is None else (self.prefill, self.decode)


class Router:
    def __init__(
        self,
        directory: NodeDirectory,
        config: RoutingConfig,
        index: PrefixIndex | None = None,
        worker_index: int = 0,
    ) -> None:
        """`worker_index`: which gateway worker this process is (`worker_affinity`)."""
        self.directory = directory
        self.config = config
        self.index = index if index is not None else PrefixIndex()
        self.prefill_policy = make_policy(
            config.prefill_policy, config, self.index, "prefill", worker_index=worker_index,
            members=lambda: directory.members((PREFILL,)),
        )  # fmt: skip
        self.decode_policy = make_policy(
            config.decode_policy, config, self.index, "decode", worker_index=worker_index,
            members=lambda: directory.members((DECODE, COLOCATED)),
        )  # fmt: skip

    def decode_blocked(self, excluded: Collection[str] = ()) -> bool:
        """Every routable decode node is at its running-request cap (never when there is
        none: then `choose` fails at once)."""
        decodes = self.directory.live((DECODE, COLOCATED), excluded)
        return bool(decodes) and all(n.at_cap for n in decodes)

    def choose(self, prompt_ids: Sequence[int], excluded: Collection[str] = ()) -> Route:
        decodes = self.directory.live((DECODE, COLOCATED), excluded)
        if not decodes:
            known = self.directory.count(DECODE) + self.directory.count(COLOCATED)
            raise unavailable(
                f"no decode node can take the request ({known} registered, "
                f"{len(excluded)} failed for it): start a decode-server or retry later"
            )
        # A stream holds its decode slot for its whole generation: on a node at its cap the
        # request would wait for one to finish, so every policy picks among the nodes below
        # their cap while there is one.
        open_ = [n for n in decodes if not n.at_cap]
        decode = self.decode_policy.pick(open_ or decodes, prompt_ids)
        to_compute = len(prompt_ids)
        if isinstance(self.decode_policy, KVAware):  # the index says what the node holds
            to_compute -= self.index.cached_tokens(decode.node_id, prompt_ids)
        if decode.role != DECODE or to_compute <= self.config.local_prefill_max_tokens:
            return Route(decode, None)
        prefills = self.directory.live((PREFILL,), excluded)
        if not prefills:
            return Route(decode, None)
        return Route(decode, self.prefill_policy.pick(prefills, prompt_ids))
