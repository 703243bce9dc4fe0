"""Layer-wise KV streaming: a chunk's KV leaves one layer group at a time, while the chunk's later
layers still compute (`--kv-stream-layers G`; 0, the default, writes a chunk's pages after its
whole forward).

The layers are split into G groups (engine/layer_groups.py). For each extend batch the streamer
takes the ACTIVE rooms in it and the prompt pages their chunk completes: from the sender's next
page to the chunk's last full page, and on the prompt's last chunk to its last, partial page.
After each group's last layer it writes that group's layers of those pages (a `LayerSpan` of
each KV head's part of each page, kvtransfer/head_routes.py); after the last group the pages
count as sent, so the after-step `send_computed` / `send_rest` find nothing left but the aux
slot, posted after every KV write of the room. D decides that a room is complete only on P's
DONE, which the role posts once every write it started (the streamed ones among them) settled.

Who posts a group, and when (its KV is in memory at once on the CPU; on a GPU once its event
passed):
- A stream-ordered backend on a GPU (cuda_ipc: its copies wait for the caller's current CUDA
  stream): the engine thread issues the write from a side stream that waits for the group's
  event; the host waits for nothing.
- A backend that copies as soon as posted and may be written from another thread
  (`concurrent_writes`: NIXL), CPU or GPU: the poster thread (prefill_node/group_poster.py)
  waits for the group and posts it; the engine thread neither waits nor posts. (When it did
  post, a 2k prompt's prefill on one H100 went from 49 to 87-90 ms at G=8; on the CPU a NIXL
  post costs ~5 us a descriptor, 1,024 descriptors a group for a 2k prompt of the 8B shape,
  benchmarks/cpu-2026-11-26-nixl-group-post.md.) `finish` returns once the poster has posted
  every group signalled so far.
- The others (Mooncake): on the CPU the group is written at once. On a GPU the engine thread
  only queues kernels, so while it queues the forward it posts only the groups whose event
  already passed and never waits (a wait there would leave the GPU with nothing queued while
  a post runs). Once the last group is queued, it waits for each earlier group in turn and
  posts it while the later groups compute; the last group is left to `finish`, which the role
  calls after the step, so the sampling kernels are queued before the host waits for it.

Refused at start (`check_streamable`): a TP prefill node (its other ranks compute in other
processes, rank 0's signal says nothing about them) and KV staging (it gathers whole pages
after the chunk). The decode node may have any TP size: the spans follow the head routes.
A write that cannot start is kept in `failures` (room -> reason); the role dooms the room after
the step, since nothing may be parked or freed while the forward runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.layer_groups import GroupCallback, GroupDone, LayerStream
from engine.request import Req
from kvtransfer.base import TransferError
from kvtransfer.head_routes import LayerSpan
from kvtransfer.sender import KVSender
from prefill_node.group_poster import GroupPoster


@dataclass(frozen=True)
class StreamConfig:
    groups: tuple[range, ...]  # engine.layer_groups.split_layers
    layer_page_bytes: int  # one layer of one KV head of one page (KVLayout.layer_page_bytes)
    page_size: int
    stream_ordered: bool  # the backend's writes wait for the caller's current CUDA stream
    device: torch.device
    poster: bool = False  # post from a poster thread (a backend with `concurrent_writes`)


def check_streamable(groups: int, num_layers: int, tp_size: int, staging_pages: int) -> None:
    """Raise ValueError, naming the flag to change, when `--kv-stream-layers` cannot run."""
    if groups < 0 or groups > num_layers:
        raise ValueError(
            f"--kv-stream-layers {groups}: use 0 (off) or 1..{num_layers}, the model's layers"
        )
    if groups and tp_size > 1:
        raise ValueError(
            f"--kv-stream-layers needs --tp-size 1 on the prefill node (got {tp_size}): the "
            "other ranks' layers run in other processes; use --kv-stream-layers 0 with TP"
        )
    if groups and staging_pages:
        raise ValueError(
            "--kv-stream-layers cannot be combined with --kv-staging-pages (staging gathers "
            "whole pages after the chunk): set one of them to 0"
        )


@dataclass
class ChunkPages:
    """One room's pages that this forward completes: prompt pages [sender.next_page, upto)."""

    room: int
    sender: KVSender
    pages: list[int]  # the request's page list
    upto: int


# The sender of a request's room while its pages may be streamed (ACTIVE, not doomed, not
# fenced), else None: the role's judgement.
FindSender = Callable[[Req], KVSender | None]


class LayerStreamer:
    def __init__(self, config: StreamConfig, find_sender: FindSender) -> None:
        self.config = config
        self.find_sender = find_sender
        self.failures: dict[int, str] = {}  # room -> why a streamed write could not start
        self.unfinished: list[ForwardWrites] = []  # forwards with groups left to post (GPU)
        on_gpu = config.device.type == "cuda"
        self.side_stream = torch.cuda.Stream(config.device) if on_gpu else None
        posts_off_thread = config.poster and not config.stream_ordered
        self.poster = GroupPoster(config.device) if posts_off_thread else None

    def layer_stream(self) -> LayerStream:
        """What the runner calls for each extend batch (ModelRunner.layer_stream)."""
        return LayerStream(self.config.groups, self.begin)

    def begin(self, reqs: Sequence[Req], extend_lens: Sequence[int]) -> GroupCallback | None:
        self.finish()  # an earlier forward's last group first (the role had no turn between)
        chunks = []
        for req, n in zip(reqs, extend_lens, strict=True):
            chunk = self._chunk(req, n)
            if chunk is not None:
                chunks.append(chunk)
        return ForwardWrites(self, chunks).on_group if chunks else None

    def finish(self) -> None:
        """Post the groups the step's forwards left waiting (each forward's last group, on a GPU
        with a backend that copies as soon as posted, or the poster's queue); the role calls
        it after the step."""
        if self.poster is not None:
            self.poster.drain()
        for writes in self.unfinished:
            writes.post_waiting(keep=0)
        self.unfinished.clear()

    def close(self) -> None:
        """Post what is left and stop the poster thread, if any."""
        self.finish()
        if self.poster is not None:
            self.poster.close()

    def take_failures(self) -> dict[int, str]:
        taken, self.failures = self.failures, {}
        return taken

    def _chunk(self, req: Req, extend_len: int) -> ChunkPages | None:
        sender = self.find_sender(req)
        if sender is None:
            return None
        end = req.kv_len + extend_len  # kv_len: before this forward
        last_chunk = end >= sender.dest.prompt_len
        upto = sender.num_prompt_pages if last_chunk else end // self.config.page_size
        if upto <= sender.next_page:
            return None
        return ChunkPages(req.room, sender, list(req.pages), upto)


@dataclass
class ForwardWrites:
    """One forward's streamed writes: `on_group` is its layer-group callback."""

    streamer: LayerStreamer
    chunks: list[ChunkPages]
    waiting: list[GroupDone] = field(default_factory=list)  # signalled, not yet posted (GPU)

    def on_group(self, done: GroupDone) -> None:
        side, poster = self.streamer.side_stream, self.streamer.poster
        if poster is not None:
            poster.submit(done, self._post)  # it waits for the group, the caller goes on
        elif done.event is None:
            self._post(done)
        elif self.streamer.config.stream_ordered and side is not None:
            side.wait_event(done.event)
            with torch.cuda.stream(side):  # the backend orders its copies after this stream
                self._post(done)
        else:
            self.waiting.append(done)
            while self.waiting and self.waiting[0].ready():  # never wait while queuing
                self._post(self.waiting.pop(0))
            if done.index == len(self.streamer.config.groups) - 1:
                self.post_waiting(keep=1)  # the last group: `finish`, after the step
                self.streamer.unfinished.append(self)

    def post_waiting(self, keep: int) -> None:
        """Wait for each waiting group in order and post it, all but the newest `keep`."""
        while len(self.waiting) > keep:
            first = self.waiting.pop(0)
            first.wait()
            self._post(first)

    def _post(self, done: GroupDone) -> None:
        config, failures = self.streamer.config, self.streamer.failures
        span = LayerSpan.of(done.layers, config.layer_page_bytes)
        last = done.index == len(config.groups) - 1
        for chunk in self.chunks:
            if chunk.room in failures:
                continue
            try:
                chunk.sender.send_layers(chunk.pages, chunk.upto, span)
            except TransferError as exc:
                failures[chunk.room] = f"KV write failed: {exc}"
                continue
            if last:
                chunk.sender.mark_sent(chunk.upto)
