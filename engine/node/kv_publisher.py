"""Publishing a node's KV-cache events (vLLM's wire format, `engine/kv_events.py`) over ZMQ.

The engine thread records its radix cache's changes and hands them over once per step
(`EngineLoop.bind_kv_events`); one batch per step, numbered from 0 (seq 0 is always
`AllBlocksCleared`: the node started empty). A thread of its own owns the two sockets:

- **PUB** (`publisher` endpoint): every batch as `topic | seq | payload`.
- **ROUTER** (`replay` endpoint): a consumer that saw a gap sends (from a DEALER, or REQ)
  `b"" | start seq (8 bytes big-endian)` and gets `b"" | seq | payload` for every batch from
  `start seq` still in the replay window (the last `buffer_steps` batches), then
  `b"" | END_SEQ | b""`. A consumer that fell out of the window, or just started, sends
  `b"" | b"snapshot"` instead and gets one batch: `AllBlocksCleared` then every block the node
  holds, numbered with the seq of the last batch published (continue from seq + 1), then END.
  The snapshot comes from the publisher's own `BlockSet`, built from the batches it sent, so
  it is consistent with the seq it carries without touching the engine's tree.

Only rank 0 of a tensor-parallel node runs the scheduler, so only it publishes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass

import zmq

from engine.kv_events import (
    END_SEQ,
    SNAPSHOT_REQUEST,
    TOPIC,
    AllBlocksCleared,
    BlockSet,
    KVEvent,
    KVEventBatch,
    encode_batch,
)
from engine.scheduler import Scheduler

logger = logging.getLogger("pdserve.kv_events")


@dataclass(frozen=True)
class KVEventsConfig:
    bind_host: str  # where the sockets listen
    advertise_host: str  # where consumers reach them
    port: int = 0  # PUB; 0: any free port
    replay_port: int = 0  # ROUTER; 0: any free port
    buffer_steps: int = 10_000  # batches kept for replay


@dataclass(frozen=True)
class KVEventsEndpoints:
    publisher: str  # tcp://host:port
    replay: str
    block_size: int
    topic: bytes = TOPIC


def add_kv_events_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV-cache events (engine/node/kv_publisher.py)")
    g.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="publish the prefix cache's block changes (vLLM's KV-event format, ZMQ) and "
        "register their endpoints, so the gateway routes on what each node holds",
    )
    g.add_argument("--kv-events-port", type=int, default=0, help="PUB port (0: any free)")
    g.add_argument(
        "--kv-events-replay-port", type=int, default=0, help="replay ROUTER port (0: any free)"
    )
    g.add_argument(
        "--kv-events-buffer",
        type=int,
        default=10_000,
        help="batches (one per engine step) kept for consumers that missed some",
    )


def kv_events_config(args: argparse.Namespace, advertise_host: str) -> KVEventsConfig | None:
    if not args.kv_events:
        return None
    if args.kv_events_buffer < 1:
        raise ValueError(f"--kv-events-buffer must be at least 1, got {args.kv_events_buffer}")
    return KVEventsConfig(
        bind_host=args.host,
        advertise_host=advertise_host,
        port=args.kv_events_port,
        replay_port=args.kv_events_replay_port,
        buffer_steps=args.kv_events_buffer,
    )


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, block_size: int, medium: str) -> None:
        self.config = config
        self.block_size = block_size
        self.medium = medium
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        pub_port = _bind(self._pub, config.bind_host, config.port)
        replay_port = _bind(self._router, config.bind_host, config.replay_port)
        host = config.advertise_host
        self.endpoints = KVEventsEndpoints(
            f"tcp://{host}:{pub_port}", f"tcp://{host}:{replay_port}", block_size
        )
        self._inbox: queue.SimpleQueue[list[KVEvent] | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._blocks = BlockSet()
        self._seq = -1
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.publish([AllBlocksCleared()])

    def start(self) -> None:
        self._thread.start()
        logger.info(
            "KV events on %s (replay and snapshot: %s)",
            self.endpoints.publisher,
            self.endpoints.replay,
        )

    def publish(self, events: list[KVEvent]) -> None:
        """One batch (thread-safe, never blocks): called by the engine thread once per step."""
        self._inbox.put(events)
        self._wake()

    def close(self) -> None:
        self._inbox.put(None)
        self._wake()
        self._thread.join(timeout=2.0)
        self._pub.close()
        self._router.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe: the thread is awake anyway
            os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
                if not self._send_pending():
                    return
            if self._router in ready:
                self._answer_replay()

    def _send_pending(self) -> bool:
        while True:
            try:
                events = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if events is None:
                return False
            self._seq += 1
            payload = encode_batch(KVEventBatch(events))
            seq_bytes = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((TOPIC, seq_bytes, payload))
            self._buffer.append((self._seq, payload))
            self._blocks.apply(events)

    def _answer_replay(self) -> None:
        frames = self._router.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            logger.warning("ignored a malformed KV-event replay request (%d frames)", len(frames))
            return
        client, _, request = frames
        if request == SNAPSHOT_REQUEST:
            self._send_pending()  # the snapshot must carry the newest seq
            snapshot = KVEventBatch(self._blocks.snapshot(self.block_size, self.medium))
            seq_bytes = max(self._seq, 0).to_bytes(8, "big")
            self._router.send_multipart((client, b"", seq_bytes, encode_batch(snapshot)))
        elif len(request) == 8:
            start = int.from_bytes(request, "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        else:
            logger.warning("ignored a KV-event replay request of %d bytes", len(request))
        self._router.send_multipart((client, b"", END_SEQ, b""))


def _bind(socket: zmq.Socket[bytes], host: str, port: int) -> int:
    address = f"tcp://{host}"
    try:
        if port == 0:
            return socket.bind_to_random_port(address)
        socket.bind(f"{address}:{port}")
    except zmq.ZMQError as exc:
        raise OSError(
            f"cannot listen for KV events on {host}:{port or 'any'}: {exc}; pick another "
            "--kv-events-port / --kv-events-replay-port or pass --no-kv-events"
        ) from None
    return port


def start_kv_events(args: argparse.Namespace, scheduler: Scheduler) -> KVEventPublisher | None:
    """The node's publisher, started (None with --no-kv-events or no prefix cache); the caller
    binds `publish` to its engine loop before the loop starts, and closes it at the end."""
    from engine.node.args import advertised_host  # args imports this module for its flags

    try:
        host = advertised_host(args)
    except ValueError:  # a colocated node on a wildcard: registered nowhere, so any name does
        host = args.host
    config = kv_events_config(args, host)
    radix = scheduler.kv.radix
    if config is None or radix is None:
        return None
    publisher = KVEventPublisher(config, radix.page_size, radix.medium)
    publisher.start()
    return publisher
