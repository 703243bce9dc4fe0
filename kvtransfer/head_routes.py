"""Which prefill rank writes which KV heads into which decode rank, as byte ranges.

Both sides use the page layout of engine/memory/kv_cache.py: page `p` of a rank starts at
`kv_base + p * page_bytes` (`page_bytes` = that rank's KV heads x `head_page_bytes`), and its
local KV head `i` at `+ i * head_page_bytes`, all layers' K and V of that head together. So a
run of consecutive KV heads of one page is one contiguous range on both sides:

- when a route carries every KV head of both ranks (equal TP sizes), whole pages move and
  pages contiguous on both sides coalesce into one descriptor per run, as with TP=1;
- otherwise one descriptor per (page, run of heads): never one per layer or per token.

Layer streaming (prefill_node/layer_stream.py) sends a chunk's pages one layer group at a time:
inside a head's part of a page the layers are outermost, so layers [a, b) of one head of one
page are one contiguous `LayerSpan` of it, and such a write is one descriptor per (page, head)
(`route_pages` with a span), merged where consecutive heads or pages happen to touch on both sides
(a span of every layer: whole pages again). Those ranges are computed with numpy and handed over
as columns (`RangeColumns`, kvtransfer/base.py): an 8k-token prompt's group is 4,096 of them.

Routes are planned once per (prefill node, decode node) pair: every KV head a decode rank holds
is written by exactly one prefill rank that holds it (with replicated heads on the prefill side,
decode rank `d` takes replica `d % replicas`, so the writes spread over the replicas), and
consecutive heads with the same source merge into one route.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtransfer.base import (
    PeerInfo,
    RangeColumns,
    TransferRange,
    coalesce_pages,
    columns_of,
)


class HeadRouteError(ValueError):
    """The two nodes' KV heads do not cover each other (different models or TP plans)."""


@dataclass(frozen=True)
class RankKV:
    """Where one rank's KV shard lives, as seen by a writer."""

    tp_rank: int
    peer_id: str  # transfer-engine peer id of this rank (the node id for rank 0)
    kv_base: int
    kv_heads: range  # global KV heads this rank holds, in local order
    head_page_bytes: int  # one KV head's part of a page

    @property
    def page_bytes(self) -> int:
        return len(self.kv_heads) * self.head_page_bytes


@dataclass(frozen=True)
class LayerSpan:
    """Layers [first, first + count) inside one KV head's part of a page, in bytes."""

    offset: int
    length: int

    @classmethod
    def of(cls, layers: range, layer_page_bytes: int) -> LayerSpan:
        return cls(layers.start * layer_page_bytes, len(layers) * layer_page_bytes)


def merge_touching(ranges: RangeColumns) -> RangeColumns:
    """Consecutive ranges that continue each other on both sides, as one."""
    src, dst, length = ranges.columns
    if len(ranges) < 2:
        return ranges
    touching = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~touching)))
    if len(starts) == len(ranges):
        return ranges
    return RangeColumns(np.stack([src[starts], dst[starts], np.add.reduceat(length, starts)]))


@dataclass(frozen=True)
class HeadRoute:
    """A run of consecutive KV heads from a prefill rank's pages into a decode rank's pages."""

    src: RankKV
    dst: RankKV
    src_head: int  # first head, local index on the prefill rank
    dst_head: int  # first head, local index on the decode rank
    num_heads: int

    @property
    def whole_pages(self) -> bool:
        return self.num_heads == len(self.src.kv_heads) == len(self.dst.kv_heads)

    def layer_ranges(
        self, src_pages: Sequence[int], dst_pages: Sequence[int], span: LayerSpan
    ) -> RangeColumns:
        """The ranges of `span` (a layer group) of every head of the route, page by page (the
        heads of a page in order), computed as columns: pages x heads ranges, no Python
        object per range."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} dest pages")
        src, dst = self.src, self.dst
        heads = np.arange(self.num_heads, dtype=np.int64)
        src_heads = (self.src_head + heads) * src.head_page_bytes + span.offset
        dst_heads = (self.dst_head + heads) * dst.head_page_bytes + span.offset
        src_at = np.asarray(src_pages, dtype=np.int64) * src.page_bytes + src.kv_base
        dst_at = np.asarray(dst_pages, dtype=np.int64) * dst.page_bytes + dst.kv_base
        columns = np.empty((3, len(src_at) * self.num_heads), dtype=np.int64)
        columns[0] = (src_at[:, None] + src_heads).ravel()
        columns[1] = (dst_at[:, None] + dst_heads).ravel()
        columns[2] = span.length
        ranges = RangeColumns(columns)
        # Spans of heads or pages are a head's share apart: only a span of every layer touches.
        return merge_touching(ranges) if span.length == src.head_page_bytes else ranges

    def ranges(self, src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[TransferRange]:
        src, dst = self.src, self.dst
        if self.whole_pages:
            return coalesce_pages(src_pages, dst_pages, src.page_bytes, src.kv_base, dst.kv_base)
        src_off = src.kv_base + self.src_head * src.head_page_bytes
        dst_off = dst.kv_base + self.dst_head * dst.head_page_bytes
        length = self.num_heads * src.head_page_bytes
        return [
            TransferRange(src_off + s * src.page_bytes, dst_off + d * dst.page_bytes, length)
            for s, d in zip(src_pages, dst_pages, strict=True)
        ]


def plan_routes(src: Sequence[RankKV], dst: Sequence[RankKV]) -> list[HeadRoute]:
    routes: list[HeadRoute] = []
    for d in dst:
        for local_d, head in enumerate(d.kv_heads):
            holders = [s for s in src if head in s.kv_heads]
            if not holders:
                raise HeadRouteError(
                    f"KV head {head} of decode rank {d.tp_rank} is held by no prefill rank "
                    f"(prefill ranks hold {[list(s.kv_heads) for s in src]}); the nodes serve "
                    "different models"
                )
            s = holders[d.tp_rank % len(holders)]
            local_s = head - s.kv_heads.start
            last = routes[-1] if routes else None
            if (
                last is not None
                and last.src is s
                and last.dst is d
                and last.src_head + last.num_heads == local_s
                and last.dst_head + last.num_heads == local_d
            ):
                routes[-1] = HeadRoute(s, d, last.src_head, last.dst_head, last.num_heads + 1)
            else:
                routes.append(HeadRoute(s, d, local_s, local_d, 1))
    return routes


WritePlan = dict[int, dict[str, Sequence[TransferRange]]]  # prefill rank -> decode peer -> ranges


def route_pages(
    routes: Sequence[HeadRoute],
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    span: LayerSpan | None = None,
) -> WritePlan:
    """The ranges that move `src_pages` into `dst_pages` along every route: every layer, or
    only layer span `span` of each page (layer streaming)."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    parts: dict[int, dict[str, list[Sequence[TransferRange]]]] = {}
    for route in routes:
        ranges = (
            route.ranges(src_pages, dst_pages)
            if span is None
            else route.layer_ranges(src_pages, dst_pages, span)
        )
        parts.setdefault(route.src.tp_rank, {}).setdefault(route.dst.peer_id, []).append(ranges)
    return {
        rank: {peer: _joined(found) for peer, found in by_peer.items()}
        for rank, by_peer in parts.items()
    }


def _joined(parts: list[Sequence[TransferRange]]) -> Sequence[TransferRange]:
    """The ranges of several routes between the same two ranks, in route order."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, RangeColumns) for p in parts):
        return RangeColumns(np.concatenate([columns_of(p) for p in parts], axis=1))
    return [r for p in parts for r in p]


@dataclass(frozen=True)
class NodeKV:
    """A prefill node's own KV shards (every TP rank's), as its writer needs them."""

    ranks: tuple[RankKV, ...]
    head_page_bytes: int
    num_kv_heads: int  # the model's

    @classmethod
    def single(cls, kv_base: int, head_page_bytes: int, num_kv_heads: int) -> NodeKV:
        """A TP=1 node: one buffer with every KV head."""
        return cls(
            (RankKV(0, "", kv_base, range(num_kv_heads), head_page_bytes),),
            head_page_bytes,
            num_kv_heads,
        )


def peer_ranks(peer: PeerInfo, num_kv_heads: int, head_page_bytes: int) -> list[RankKV]:
    """The decode node's KV shards from its registration (a TP=1 peer holds every head)."""
    if not peer.ranks:
        kv = peer.regions["kv"]
        return [RankKV(0, peer.node_id, kv.addr, range(num_kv_heads), head_page_bytes)]
    return [
        RankKV(r.tp_rank, peer.rank_peer_id(r.tp_rank), r.kv.addr, r.kv_heads, head_page_bytes)
        for r in peer.ranks
    ]
