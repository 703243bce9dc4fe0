"""KV-cache events from real nodes: a bootstrap, a prefill and a decode process on 127.0.0.1.

Read the way a vLLM KV-event consumer reads them (raw ZMQ: SUB for `topic | seq | payload`,
DEALER for replay and snapshot), from the endpoints the nodes registered with bootstrap:
- every batch arrives, numbered without a gap, under concurrent load;
- the blocks they describe are exactly the prompt (P) and prompt + output (D) pages, hashed
  with the shared `prefix_hashes`;
- evictions under memory pressure arrive: once the node is idle, the blocks a consumer holds
  are as many as the node's cached pages (CheckIntegrity);
- replay from seq 0 returns the same batches, and a snapshot rebuilds the same block set.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import zmq

from engine.kv_events import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    TOPIC,
    AllBlocksCleared,
    BlockSet,
    KVEventBatch,
    decode_batch,
    prefix_hashes,
)
from gateway.process.launcher import PDTrio, pd_trio
from proto import bootstrap_pb2, bootstrap_pb2_grpc, node_pb2

PAGE = 4
MAX_NEW = 5
SERVER_ENV = {"OMP_NUM_THREADS": "1"}


@dataclass
class Consumer:
    """A subscriber of one node: every batch in order, and the blocks they describe."""

    endpoint: bootstrap_pb2.KVEventsEndpoint
    ctx: zmq.Context[zmq.Socket[bytes]]
    seqs: list[int] = field(default_factory=list)
    blocks: BlockSet = field(default_factory=BlockSet)

    def __post_init__(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.endpoint.topic.encode())
        self.sub.connect(self.endpoint.publisher)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(self.endpoint.replay)

    def request(self, body: bytes) -> list[tuple[int, KVEventBatch]]:
        self.dealer.send_multipart((b"", body))
        out = []
        while True:
            assert self.dealer.poll(10_000), "no replay answer in 10 s"
            empty, seq, payload = self.dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), decode_batch(payload)))

    def start(self) -> None:
        """Subscribe, then catch up from a snapshot (PUB drops what came before SUB joined)."""
        time.sleep(0.3)  # the subscription reaches the publisher
        [(seq, snapshot)] = self.request(SNAPSHOT_REQUEST)
        assert snapshot.events[0] == AllBlocksCleared()
        self.seqs.append(seq)
        self.blocks.apply(snapshot.events)

    def drain(self, quiet_s: float = 1.0) -> None:
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.seqs[-1]:
                continue  # published before the snapshot, already in it
            assert seq == self.seqs[-1] + 1, f"gap: {self.seqs[-1]} -> {seq}"
            self.seqs.append(seq)
            self.blocks.apply(decode_batch(payload).events)


def registered_endpoints(trio: PDTrio) -> dict[str, bootstrap_pb2.KVEventsEndpoint]:
    with grpc.insecure_channel(trio.bootstrap.address) as channel:
        stub = bootstrap_pb2_grpc.BootstrapStub(channel)
        nodes = stub.ListNodes(bootstrap_pb2.ListNodesRequest(), timeout=10).nodes
    return {s.node.node_id: s.node.kv_events for s in nodes if s.node.HasField("kv_events")}


@pytest.fixture(scope="module")
def trio(tiny_model_dir, tmp_path_factory) -> Iterator[PDTrio]:
    log_dir = tmp_path_factory.mktemp("kv-events")
    node_args = ["--page-size", str(PAGE), "--max-total-tokens", "160"]
    with pd_trio(log_dir, tiny_model_dir("llama"), "mooncake", node_args, env=SERVER_ENV) as t:
        yield t


def prompt(i: int, n: int = 22) -> list[int]:
    return [(i * 37 + k * 11) % 250 + 1 for k in range(n)]


def greedy() -> node_pb2.SamplingParams:
    return node_pb2.SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def test_endpoints_are_registered_with_the_page_size(trio: PDTrio) -> None:
    endpoints = registered_endpoints(trio)
    assert set(endpoints) == {trio.prefill_id, trio.decode_id}
    for ep in endpoints.values():
        assert ep.publisher.startswith("tcp://127.0.0.1:")
        assert ep.replay.startswith("tcp://127.0.0.1:")
        assert ep.block_size == PAGE and ep.topic == TOPIC.decode()


def test_events_describe_both_caches_in_order_with_evictions(trio: PDTrio) -> None:
    endpoints = registered_endpoints(trio)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        prefill = Consumer(endpoints[trio.prefill_id], ctx)
        decode = Consumer(endpoints[trio.decode_id], ctx)
        prefill.start()
        decode.start()
        # One request: its blocks on both nodes, hashed from the token ids alone.
        first = prompt(0)
        result = trio.generate(first, greedy())
        assert result.finished is not None and len(result.token_ids) == MAX_NEW
        trio.check_no_leaks()
        prefill.drain()
        decode.drain()
        assert set(prefix_hashes(first, PAGE)) <= set(prefill.blocks.blocks)
        # D's KV holds the prompt and every output token but the last (never run through).
        history = first + result.token_ids[:-1]
        assert set(prefix_hashes(history, PAGE)) <= set(decode.blocks.blocks)
        # Load: more distinct prompts, some concurrent, than the 160-token pools hold.
        for batch in range(4):
            trio.generate_many([prompt(10 + batch * 3 + k) for k in range(3)], greedy())
        trio.check_no_leaks()
        for consumer, node in ((prefill, trio.prefill), (decode, trio.decode)):
            consumer.drain()
            cached = node.integrity().cached_pages
            assert len(consumer.blocks) == cached, f"{node.address}: events != cache"
        assert not set(prefix_hashes(first, PAGE)) <= set(decode.blocks.blocks), "no eviction"
        # Replay from seq 0 is every batch this consumer saw live, in order; a fresh
        # snapshot is the same block set.
        replayed = decode.request((0).to_bytes(8, "big"))
        assert [seq for seq, _ in replayed] == list(range(decode.seqs[-1] + 1))
        assert replayed[0][1].events == [AllBlocksCleared()]
        late = Consumer(endpoints[trio.decode_id], ctx)
        late.start()
        assert late.blocks.blocks == decode.blocks.blocks
        assert late.seqs == [decode.seqs[-1]]
    finally:
        ctx.destroy(linger=0)


def test_malformed_replay_requests_are_ignored(trio: PDTrio) -> None:
    endpoint = registered_endpoints(trio)[trio.decode_id]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        consumer = Consumer(endpoint, ctx)
        assert consumer.request(b"abc") == []  # only END comes back
        consumer.dealer.send_multipart((b"x", b"y", b"z"))  # no reply at all
        consumer.start()  # the publisher still serves
    finally:
        ctx.destroy(linger=0)


def test_no_kv_events_registers_no_endpoint(tiny_model_dir, tmp_path: Path) -> None:
    node_args = ["--page-size", str(PAGE), "--no-kv-events"]
    with pd_trio(tmp_path, tiny_model_dir("llama"), "mooncake", node_args, env=SERVER_ENV) as t:
        assert registered_endpoints(t) == {}


def test_turn_two_sends_only_the_pages_the_decode_node_lacks(trio: PDTrio, tiny_model_dir) -> None:
    """D keeps turn 1's prompt and output in its cache; turn 2 (the whole history plus a new
    message) is prefilled by P, which writes only the pages past D's cached prefix, and the
    output still equals HF on the full history."""
    from scripts.tiny_models import hf_greedy

    turn1 = prompt(77, 30)
    first = trio.generate(turn1, greedy())
    assert first.prefill is not None and first.prefill.sent_pages == -(-len(turn1) // PAGE)
    assert first.prefill.page_id_writes >= 1  # whole pages, one rank each side: by page ids
    turn2 = turn1 + first.token_ids + prompt(78, 13)  # 30 + 5 + 13 = 48 tokens, 12 pages
    second = trio.generate(turn2, greedy())
    assert second.finished is not None and second.prefill is not None
    held = (len(turn1) + MAX_NEW - 1) // PAGE  # D's full pages of turn 1's KV: 8
    assert second.prefill.sent_pages == -(-len(turn2) // PAGE) - held == 4
    # Not computed for this request: P's own hit, turn 1's prompt pages (D's hit saved the
    # writes, not compute).
    assert second.finished.usage.cached_tokens == len(turn1) // PAGE * PAGE
    assert second.prefill.cached_tokens == len(turn1) // PAGE * PAGE
    assert second.token_ids == hf_greedy(tiny_model_dir("llama"), [turn2], MAX_NEW)[0]
    trio.check_no_leaks()


def test_a_tensor_parallel_node_publishes_from_rank_zero(tiny_model_dir, tmp_path: Path) -> None:
    """A prefill node of 2 TP ranks registers one KV-event endpoint (rank 0 runs the scheduler
    and its radix cache), and its events describe that cache exactly."""
    node_args = ["--page-size", str(PAGE), "--max-total-tokens", "512"]
    with pd_trio(
        tmp_path,
        tiny_model_dir("llama"),
        "mooncake",
        node_args,
        prefill_args=["--tp-size", "2"],
        env=SERVER_ENV,
    ) as t:
        endpoints = registered_endpoints(t)
        assert set(endpoints) == {t.prefill_id, t.decode_id}
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            consumer = Consumer(endpoints[t.prefill_id], ctx)
            consumer.start()
            ids = prompt(5, 26)
            assert t.generate(ids, greedy()).finished is not None
            t.check_no_leaks()
            consumer.drain()
            assert set(prefix_hashes(ids, PAGE)) <= set(consumer.blocks.blocks)
            assert len(consumer.blocks) == t.prefill.integrity().cached_pages
        finally:
            ctx.destroy(linger=0)
