"""What an `EngineLoop` emitted, per request: the tests' output sink (engine/engine_loop.py)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

from engine.engine_loop import EngineLoop, OutputBatch, RequestFinish


class LoopOutput:
    """Binds itself as `loop`'s output sink and records every batch, on the engine thread.

    `events` is the order in which requests got output: ("tokens" | "finish", rid) pairs.
    `on_batch` runs after each batch is recorded (e.g. to abort a request mid-stream).
    """

    def __init__(self, loop: EngineLoop, on_batch: Callable[[LoopOutput], None] | None = None):
        self.batches: list[OutputBatch] = []
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finishes: dict[str, RequestFinish] = {}
        self.events: list[tuple[str, str]] = []
        self._on_batch = on_batch
        self._changed = threading.Condition()
        loop.bind_output(self.take)

    def take(self, batch: OutputBatch) -> None:
        with self._changed:
            self.batches.append(batch)
            for rid, token_ids in zip(batch.rids, batch.token_ids, strict=True):
                self.tokens[rid].extend(token_ids)
                self.events.append(("tokens", rid))
            for finish in batch.finishes:
                assert finish.rid not in self.finishes, f"{finish.rid} finished twice"
                self.finishes[finish.rid] = finish
                self.events.append(("finish", finish.rid))
            self._changed.notify_all()
        if self._on_batch is not None:
            self._on_batch(self)

    def wait_finished(self, rids: list[str], timeout: float = 60) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: all(r in self.finishes for r in rids), timeout)
