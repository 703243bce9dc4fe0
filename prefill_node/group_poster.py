"""The layer-group poster: a thread of the prefill node that posts a forward's layer-group KV
writes, so that the thread launching the forward never waits for a group nor posts one.

With a transfer engine that copies as soon as a write is posted (NIXL), a group may go out only
once the GPU passed its event. Posting from the launching thread cost the forward its pace: on
one H100 at `--kv-stream-layers 8` NIXL's posts nearly doubled a 2k prompt's prefill (49 ->
87-90 ms), the GPU idling while the host posted. Here the launching thread only queues
(group, post) and goes on; this thread waits on each group's event in order (the wait and
NIXL's `transfer()` let go of the GIL) and posts it. Groups are posted in the order they were
queued, one at a time; when the poster falls behind, the groups of one forward that are ready
by the time it gets to them go out as one write of their layers together. NIXL's post costs
per descriptor (~5 us on the CPU) and a span of several groups is as many descriptors as one
group's, so the poster catches up instead of falling further behind.

`drain` is the hand-back: it returns once every queued group is posted, and raises what a post
raised (a bug; a write that cannot start is the post's own business, kept as a room failure).
The role calls it (through `LayerStreamer.finish`) after the step and before the next forward
begins, so the senders and the failures are the engine thread's again whenever it reads them.
The engine must allow a write on this thread while it polls on its own (`concurrent_writes`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.layer_groups import GroupCallback, GroupDone


@dataclass
class PosterStats:
    groups: int = 0  # groups posted
    writes: int = 0  # writes they went out in (groups ready together go as one)
    wait_s: float = 0.0  # waiting for groups' events (the GPU computing them)
    post_s: float = 0.0  # posting them (planning, the engine's write)


class GroupPoster:
    def __init__(self, device: torch.device, name: str = "kv-group-poster") -> None:
        self.device = device  # a CUDA device is made current on the thread (UCX's copies)
        self.name = name
        self.stats = PosterStats()
        self._jobs: deque[tuple[GroupDone, GroupCallback]] = deque()
        self._changed = threading.Condition()
        self._unposted = 0  # queued or being posted
        self._error: Exception | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, done: GroupDone, post: GroupCallback) -> None:
        """Post `done` with `post` once its KV is in memory (`done.wait()`), on the poster."""
        with self._changed:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed, cannot post layer group {done.index}")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.append((done, post))
            self._unposted += 1
            self._changed.notify_all()

    def drain(self) -> None:
        """Block until every submitted group is posted; re-raise the first error a post raised."""
        with self._changed:
            while self._unposted:
                self._changed.wait()
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"{self.name}: posting a layer group failed: {error!r}") from error

    def close(self) -> None:
        """Post what is queued, then stop the thread."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the thread posting copies needs its context
        while True:
            with self._changed:
                while not self._jobs and not self._closed:
                    self._changed.wait()
                if not self._jobs:
                    return
                done, post = self._jobs.popleft()
            taken = 1
            try:
                start = time.perf_counter()
                done.wait()
                waited = time.perf_counter()
                done, merged = self._merge_ready(done, post)
                taken += merged
                post(done)
                self.stats.writes += 1
                self.stats.groups += taken
                self.stats.wait_s += waited - start
                self.stats.post_s += time.perf_counter() - waited
            except Exception as exc:  # handed to the engine thread by `drain`
                with self._changed:
                    self._error = self._error or exc
            finally:
                with self._changed:
                    self._unposted -= taken
                    self._changed.notify_all()

    def _merge_ready(self, done: GroupDone, post: GroupCallback) -> tuple[GroupDone, int]:
        """`done` widened by the groups queued behind it for the same forward whose layers
        follow on and whose KV is in memory already: one write of their layers together (a
        layer span of several groups is still one range per page and head), and how many
        groups were merged into it."""
        merged = 0
        with self._changed:
            while self._jobs:
                after, its_post = self._jobs[0]
                if its_post != post or after.layers.start != done.layers.stop:
                    break
                try:
                    if not after.ready():
                        break
                except Exception:  # its own turn waits on it and reports the error
                    break
                self._jobs.popleft()
                layers = range(done.layers.start, after.layers.stop)
                done, merged = GroupDone(after.index, layers, after.event), merged + 1
        return done, merged
