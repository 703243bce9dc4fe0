"""The KV-event block hash and wire format (engine/kv_events.py), without processes."""

from __future__ import annotations

import hashlib
import struct

import msgpack
import pytest

from engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockSet,
    BlockStored,
    KVEventBatch,
    MalformedEvent,
    block_hash,
    decode_batch,
    encode_batch,
    prefix_hashes,
)


def test_block_hash_is_the_documented_function() -> None:
    tokens = [1, 2, 70000, 4]
    data = (7).to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in tokens)
    expected = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    assert block_hash(7, tokens) == expected
    assert struct.pack("<Q4I", 7, *tokens) == data


def test_prefix_hashes_chain_and_skip_a_partial_page() -> None:
    ids = list(range(10))
    hashes = prefix_hashes(ids, 4)
    assert len(hashes) == 2
    assert hashes[0] == block_hash(0, ids[:4])
    assert hashes[1] == block_hash(hashes[0], ids[4:8])
    # A hash stands for the whole prefix: the same page after another prefix differs.
    assert prefix_hashes([9, 9, 9, 9, *ids[4:8]], 4)[1] != hashes[1]


def test_batch_is_vllms_array_like_tagged_encoding() -> None:
    batch = KVEventBatch(
        [
            AllBlocksCleared(),
            BlockStored([11, 12], None, [1, 2, 3, 4], 2, "CPU"),
            BlockRemoved([12], "CPU"),
        ],
        ts=5.5,
    )
    raw = msgpack.unpackb(encode_batch(batch))
    assert raw == [
        5.5,
        [
            ["AllBlocksCleared"],
            ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "CPU"],
            ["BlockRemoved", [12], "CPU"],
        ],
    ]
    assert decode_batch(encode_batch(batch)) == batch


def test_decode_ignores_extra_trailing_fields_of_newer_senders() -> None:
    payload = msgpack.packb([1.0, [["BlockStored", [3], 2, [1, 1], 2, None, "GPU", "lora"]]])
    assert decode_batch(payload).events == [BlockStored([3], 2, [1, 1], 2, "GPU")]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never used in msgpack
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0, "events"]),
        msgpack.packb(["soon", []]),
        msgpack.packb([1.0, [["BlockStored", ["x"], None, [], 1]]]),
        msgpack.packb([1.0, [["Unknown", 1]]]),
        msgpack.packb([1.0, [[]]]),
    ],
)
def test_malformed_payloads_raise_malformed_event(payload: bytes) -> None:
    with pytest.raises(MalformedEvent):
        decode_batch(payload)


def test_snapshot_merges_chains_and_rebuilds_the_same_set() -> None:
    blocks = BlockSet()
    a, b, c = prefix_hashes(list(range(6)), 2)
    d = block_hash(a, [9, 9])
    blocks.apply([BlockStored([a, b, c], None, list(range(6)), 2)])
    blocks.apply([BlockStored([d], a, [9, 9], 2)])
    blocks.apply([BlockRemoved([c])])
    snapshot = blocks.snapshot(2, "CPU")
    assert snapshot == [
        AllBlocksCleared(),
        BlockStored([a, b], None, [0, 1, 2, 3], 2, "CPU"),
        BlockStored([d], a, [9, 9], 2, "CPU"),
    ]
    rebuilt = BlockSet()
    rebuilt.apply([BlockStored([99], None, [5, 5], 2), *snapshot])
    assert rebuilt.blocks == blocks.blocks
