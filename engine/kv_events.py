"""KV-cache events: the block hash and the wire format, shared by the nodes and the gateway.

Imports neither torch nor zmq, so the gateway (which must not load torch) and the node's
publisher (`engine/node/kv_publisher.py`) read and write the same bytes from this one module.

**Block hash.** A block is one page of `page_size` token ids. Its hash chains on its parent's
(the block before it in the sequence; the first block's parent is `ROOT_HASH`, 0):

    block_hash(parent, tokens) = uint64, little-endian, of
        blake2b(digest_size=8, data = parent as 8 bytes little-endian
                                      + each token id as 4 bytes little-endian)

so a hash stands for the whole prefix up to and including its block, and any process that
knows the page size computes the same hashes from token ids alone (`prefix_hashes`).

**Wire format** (vLLM's documented KV-event format, so an llm-d or Dynamo router can consume
a node unchanged). A batch goes out on a ZMQ PUB socket as three frames:

    topic (b"kv-events") | seq (8 bytes, big-endian, from 0) | payload (msgpack)

and the payload is msgspec's array-like, tagged encoding of vLLM's `KVEventBatch`:

    [ts (float, unix seconds), [event, ...]]
    event: ["BlockStored", [hash, ...], parent_hash | nil, [token id, ...], block_size,
            lora_id (nil), medium ("GPU" | "CPU")]
         | ["BlockRemoved", [hash, ...], medium]
         | ["AllBlocksCleared"]

A node's first batch (seq 0) is `AllBlocksCleared`: a consumer that sees seq 0 knows the node
(re)started with an empty cache. Replay and snapshot: see `engine/node/kv_publisher.py`.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

ROOT_HASH = 0
TOPIC = b"kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay answer (its payload is empty)
SNAPSHOT_REQUEST = b"snapshot"  # a replay request frame asking for every block instead


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    data = struct.pack(f"<Q{len(tokens)}I", parent, *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_hashes(token_ids: Sequence[int], page_size: int, parent: int = ROOT_HASH) -> list[int]:
    """The chained hash of every full page of `token_ids` (a partial last page has none)."""
    hashes = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = block_hash(parent, token_ids[start : start + page_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None  # None: the first block follows the root
    token_ids: list[int]  # all blocks' tokens, in order
    block_size: int
    medium: str = "GPU"
    lora_id: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    events: list[KVEvent]
    ts: float = field(default_factory=time.time)


class MalformedEvent(ValueError):
    """A payload that is not a KV-event batch; the consumer resyncs that node."""


def encode_batch(batch: KVEventBatch) -> bytes:
    return msgpack.packb([batch.ts, [_event_fields(e) for e in batch.events]])


def _event_fields(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch in `payload`; `MalformedEvent` names what is wrong. Extra trailing fields of
    an event (newer vLLM versions add some) are ignored."""
    try:
        raw = msgpack.unpackb(payload, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedEvent(f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise MalformedEvent("payload is not [ts, [events]]")
    ts = raw[0]
    if not isinstance(ts, int | float):
        raise MalformedEvent(f"batch timestamp {ts!r} is not a number")
    return KVEventBatch([_event(e) for e in raw[1]], float(ts))


def _event(raw: Any) -> KVEvent:
    if not isinstance(raw, list) or not raw:
        raise MalformedEvent(f"event {raw!r} is not a tagged array")
    tag = raw[0]
    if tag == "BlockStored" and len(raw) >= 5:
        hashes, parent, tokens, size = raw[1], raw[2], raw[3], raw[4]
        medium = raw[6] if len(raw) > 6 and isinstance(raw[6], str) else "GPU"
        if (
            _ints(hashes)
            and (parent is None or isinstance(parent, int))
            and _ints(tokens)
            and isinstance(size, int)
        ):
            return BlockStored(list(hashes), parent, list(tokens), size, medium)
    elif tag == "BlockRemoved" and len(raw) >= 2 and _ints(raw[1]):
        medium = raw[2] if len(raw) > 2 and isinstance(raw[2], str) else "GPU"
        return BlockRemoved(list(raw[1]), medium)
    elif tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise MalformedEvent(f"not a KV event: {str(raw)[:120]}")


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) for v in value)


class BlockSet:
    """The blocks one node holds, as its events describe them: hash -> (parent, tokens).

    Kept in insertion order, which is parent-first (a block is stored after its parent and
    removed before it), so `snapshot` can rebuild the set in one pass. The publisher keeps one
    to serve snapshots; tests compare it with the node's radix cache.
    """

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                size = event.block_size
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    self.blocks[h] = (parent, tuple(event.token_ids[i * size : (i + 1) * size]))
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.blocks.pop(h, None)
            else:
                self.blocks.clear()

    def snapshot(self, block_size: int, medium: str) -> list[KVEvent]:
        """`AllBlocksCleared`, then every block, chains of consecutive blocks merged into one
        `BlockStored`."""
        events: list[KVEvent] = [AllBlocksCleared()]
        for run in self._runs():
            parent = self.blocks[run[0]][0]
            tokens = [t for h in run for t in self.blocks[h][1]]
            events.append(BlockStored(run, parent, tokens, block_size, medium))
        return events

    def _runs(self) -> Iterator[list[int]]:
        run: list[int] = []
        for h, (parent, _) in self.blocks.items():
            if run and parent != run[-1]:
                yield run
                run = []
            run.append(h)
        if run:
            yield run
