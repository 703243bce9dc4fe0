"""Host time of one layer group's KV write through NIXL (`--kv-stream-layers`), part by part, and
what the forward's own thread pays for all groups of a prompt, posting inline or by the poster.

    UCX_NET_DEVICES=lo OMP_NUM_THREADS=1 python -m scripts.bench.nixl_group_post --lengths 2048,8192

Two processes on loopback (UCX, CPU memory): a receiver registers its pool, the sender (this
process) registers its own and writes a prompt's pages (a random scattered set, `--page-size`
tokens each) into the receiver's, layer group by layer group (`--layers / --groups`), TP 1 on
both sides: one descriptor per page and KV head (kvtransfer/head_routes.py).

Part 1, one group's post as `KVSender.send_layers` -> `NixlEngine.write` does it, timed part by
part (best / median over every group of `--repeat` prompts): the byte ranges (`route_pages`),
the engine's bounds check and grouping, NIXL's descriptor lists (`get_xfer_descs`), its
`initialize_xfer` and its `transfer` (the post; between two processes of one host UCX picks cma,
whose copy runs inside it), and, for comparison, a prepared-list write: both pools prepared
once as strided lists of group-sized blocks (`prep_xfer_dlist`), a group's write built from
numpy indices (`make_prepped_xfer`) then posted. No CUDA event on a CPU: a GPU's event wait is
the group's compute, which the poster thread now waits for off the forward's thread.

Part 2, a prompt's forward on its own thread: `--layers` layers of `--layer-ms` of numpy matmul
each (BLAS lets go of the GIL, like a GPU computing), the layer groups signalled through
`LayerStreamer` as the prefill node does; `off` writes nothing (the forward alone, under the
host's load at the time), `inline` posts each group on that thread (the path before the
poster), `poster` hands it to prefill_node/group_poster.py; the three modes take turns, one
forward each. Forward ms is the layer loop's wall time (the prefill), written ms until `finish`
returns (every group posted); the poster sends groups that are ready together as one write
(writes per prompt, of G groups).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch

from engine.layer_groups import GroupDone, split_layers
from kvtransfer.base import MemoryRegion, PeerInfo, TransferConfig, TransferState
from kvtransfer.head_routes import HeadRoute, LayerSpan, RankKV, plan_routes, route_pages
from kvtransfer.nixl import NixlEngine
from kvtransfer.room import RoomDestination
from kvtransfer.sender import KVSender
from prefill_node.layer_stream import ChunkPages, ForwardWrites, LayerStreamer, StreamConfig
from scripts.bench.layer_plan import add_kv_shape_args

MODES = ("off", "inline", "poster")
PARTS = ("plan", "check", "descs", "init", "post", "total", "prepped make", "prepped post")


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    layer_page_bytes: int  # one layer of one KV head of one page (K and V)
    groups: int

    @property
    def head_page_bytes(self) -> int:
        return self.layers * self.layer_page_bytes

    @property
    def page_bytes(self) -> int:
        return self.kv_heads * self.head_page_bytes


def receiver_main(pool_bytes: int, conn: Connection) -> None:
    engine = NixlEngine(TransferConfig("nixl", "group-post-receiver"))
    pool = np.zeros(pool_bytes, dtype=np.uint8)
    region = MemoryRegion("kv", pool.ctypes.data, pool.nbytes)
    engine.register([region])
    conn.send((engine.local_endpoint(), region))
    conn.recv()  # stop
    engine.close()


def finish_write(engine: NixlEngine, handle: object) -> None:
    while (state := engine.poll(handle)) is TransferState.PENDING:  # type: ignore[arg-type]
        time.sleep(0.0005)
    if state is not TransferState.DONE:
        raise RuntimeError("a benchmark write failed")
    engine.release(handle)  # type: ignore[arg-type]


@dataclass
class Bench:
    engine: NixlEngine
    peer_id: str
    shape: Shape
    routes: list[HeadRoute]
    local: MemoryRegion
    remote: MemoryRegion

    def parts_of_one_post(
        self, src: list[int], dst: list[int], span: LayerSpan
    ) -> dict[str, float]:
        """One group's post as NixlEngine.write makes it, each part timed (ms)."""
        engine, agent = self.engine, self.engine._agent
        peer = engine._peers[self.peer_id]
        t = [time.perf_counter()]
        plan = route_pages(self.routes, src, dst, span)
        ranges = plan[0][self.peer_id]
        t.append(time.perf_counter())
        groups = engine._group(peer, ranges)
        t.append(time.perf_counter())
        step, requests, descs = engine.config.max_descriptors_per_batch, [], []
        init = post = 0.0
        for (local_kind, remote_kind), rows in groups.items():
            for start in range(0, len(rows), step):
                part = rows[start : start + step]
                s = time.perf_counter()
                local = np.stack([part[:, 0], part[:, 2], np.full_like(part[:, 0], 0)], 1)
                remote = np.stack([part[:, 1], part[:, 2], np.full_like(part[:, 0], 0)], 1)
                pair = (
                    agent.get_xfer_descs(local, local_kind[0]),
                    agent.get_xfer_descs(remote, remote_kind[0]),
                )
                m = time.perf_counter()
                request = agent.initialize_xfer("WRITE", *pair, peer.agent_name, b"")
                i = time.perf_counter()
                if agent.transfer(request) == "ERR":
                    raise RuntimeError("NIXL refused a benchmark write")
                e = time.perf_counter()
                descs.append(m - s)
                init, post = init + (i - m), post + (e - i)
                requests.append(request)
        end = time.perf_counter()
        for request in requests:
            while (state := agent.check_xfer_state(request)) == "PROC":
                time.sleep(0.0005)
            assert state == "DONE", state
            agent.release_xfer_handle(request)
        ms = 1e3
        return {
            "plan": (t[1] - t[0]) * ms,
            "check": (t[2] - t[1]) * ms,
            "descs": sum(descs) * ms,
            "init": init * ms,
            "post": post * ms,
            "total": (end - t[0]) * ms,
        }

    def prepped(self) -> Callable[[list[int], list[int], LayerSpan], dict[str, float]]:
        """Both pools as strided lists of group-sized blocks, prepared once; a group's write
        from numpy indices (block = (page * heads + head) * groups + group)."""
        agent, shape = self.engine._agent, self.shape
        peer = self.engine._peers[self.peer_id].agent_name
        block = shape.head_page_bytes // shape.groups  # equal groups only (32 / 8)

        def strided(region: MemoryRegion) -> np.ndarray:
            return np.array([[region.addr, block, 0, block, region.length // block]], np.uint64)

        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", strided(self.local), "DRAM")
        remote = agent.prep_xfer_dlist(peer, strided(self.remote), "DRAM")
        heads = np.arange(shape.kv_heads, dtype=np.int64)

        def write(src: list[int], dst: list[int], span: LayerSpan) -> dict[str, float]:
            start = time.perf_counter()
            group = span.offset // block
            per_page = shape.kv_heads * shape.groups
            src_i = (np.asarray(src)[:, None] * per_page + heads * shape.groups + group).ravel()
            dst_i = (np.asarray(dst)[:, None] * per_page + heads * shape.groups + group).ravel()
            request = agent.make_prepped_xfer(
                "WRITE", local, src_i.astype(np.int32), remote, dst_i.astype(np.int32), b""
            )
            made = time.perf_counter()
            state = agent.transfer(request)
            posted = time.perf_counter()
            while state == "PROC":
                state = agent.check_xfer_state(request)
            assert state == "DONE", state
            agent.release_xfer_handle(request)
            return {"prepped make": (made - start) * 1e3, "prepped post": (posted - made) * 1e3}

        return write


def forward(
    bench: Bench, src: list[int], dst: list[int], mode: str, layer_ms: float
) -> tuple[float, float, int]:
    """(forward ms, written ms, writes): a prompt's layers on this thread, groups posted inline
    or by the poster thread (which merges groups ready together), through the real
    LayerStreamer and KVSender."""
    shape = bench.shape
    config = StreamConfig(
        split_layers(shape.layers, shape.groups),
        shape.layer_page_bytes,
        16,
        False,
        torch.device("cpu"),
        poster=mode == "poster",
    )
    streamer = LayerStreamer(config, lambda req: None)
    dest = RoomDestination(1, bench.peer_id, "bench", tuple(dst), 0, 0, len(dst) * 16)
    sender = KVSender(bench.engine, dest, 16, bench.routes)
    writes = ForwardWrites(streamer, [ChunkPages(1, sender, src, len(src))])
    last_of = {g.stop - 1: (i, g) for i, g in enumerate(config.groups)}
    a = np.random.default_rng(0).random((96, 96))
    start = time.perf_counter()
    for layer in range(shape.layers):
        until = time.perf_counter() + layer_ms / 1e3
        while time.perf_counter() < until:
            a = a @ a
            a /= np.abs(a).max()
        if layer in last_of and mode != "off":
            index, layers = last_of[layer]
            writes.on_group(GroupDone(index, layers))
    computed = time.perf_counter()
    streamer.finish()
    written = time.perf_counter()
    writes_made = streamer.poster.stats.writes if streamer.poster else len(config.groups)
    streamer.close()
    if mode == "off":
        return (computed - start) * 1e3, (written - start) * 1e3, 0
    while (state := sender.poll()) is TransferState.PENDING:
        time.sleep(0.0005)
    assert state is TransferState.DONE and sender.all_pages_sent
    return (computed - start) * 1e3, (written - start) * 1e3, writes_made


def stat(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_kv_shape_args(parser)
    parser.add_argument("--repeat", type=int, default=3, help="prompts per length (part 1)")
    parser.add_argument("--forwards", type=int, default=3, help="forwards per mode (part 2)")
    parser.add_argument("--layer-ms", default="1.5,7.0", help="per length: one layer's compute")
    args = parser.parse_args()
    if args.layers % args.groups:
        raise SystemExit(f"--layers {args.layers} must split into --groups {args.groups} evenly")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")

    layer_page = 2 * args.page_size * args.head_dim * args.dtype_bytes
    shape = Shape(args.layers, args.kv_heads, layer_page, args.groups)
    lengths = [int(x) for x in args.lengths.split(",")]
    layer_ms = [float(x) for x in args.layer_ms.split(",")]
    pool_pages = 2 * -(-max(lengths) // args.page_size)
    pool_bytes = pool_pages * shape.page_bytes

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    receiver = ctx.Process(target=receiver_main, args=(pool_bytes, child), daemon=True)
    receiver.start()
    endpoint, remote = parent.recv()
    engine = NixlEngine(TransferConfig("nixl", "group-post-sender"))
    pool = np.random.default_rng(1).integers(0, 256, pool_bytes, dtype=np.uint8)
    local = MemoryRegion("kv", pool.ctypes.data, pool.nbytes)
    engine.register([local])
    engine.connect(PeerInfo("receiver", endpoint, {"kv": remote}))
    heads = range(args.kv_heads)
    routes = plan_routes(
        [RankKV(0, "", local.addr, heads, shape.head_page_bytes)],
        [RankKV(0, "receiver", remote.addr, heads, shape.head_page_bytes)],
    )
    bench = Bench(engine, "receiver", shape, routes, local, remote)
    prepped = bench.prepped()
    spans = [LayerSpan.of(g, layer_page) for g in split_layers(args.layers, args.groups)]
    rng = random.Random(0)

    print(
        f"{args.layers} layers in {args.groups} groups, {args.kv_heads} KV heads x "
        f"{args.head_dim} x {args.dtype_bytes} B, page {args.page_size} tokens "
        f"({shape.page_bytes / 2**20:.2f} MiB), a group's descriptor "
        f"{shape.head_page_bytes // args.groups} B; UCX_TLS={os.environ.get('UCX_TLS', '(all)')}"
    )
    print("\nPart 1: one group's post, ms best / median over every group of every prompt\n")
    print("| prompt | descriptors | " + " | ".join(PARTS) + " |")
    print("|---:|---:|" + "---:|" * len(PARTS))
    for length in lengths:
        pages = -(-length // args.page_size)
        samples: dict[str, list[float]] = {part: [] for part in PARTS}
        for _ in range(args.repeat):
            src, dst = rng.sample(range(pool_pages), pages), rng.sample(range(pool_pages), pages)
            for span in spans:
                for part, ms in bench.parts_of_one_post(src, dst, span).items():
                    samples[part].append(ms)
                for part, ms in prepped(src, dst, span).items():
                    samples[part].append(ms)
        cells = " | ".join(stat(samples[part]) for part in PARTS)
        print(f"| {length} | {pages * args.kv_heads} | {cells} |")

    print("\nPart 2: a prompt's forward, ms best / median of --forwards runs\n")
    print("| prompt | layer ms | mode | forward | written | writes per prompt |")
    print("|---:|---:|---|---:|---:|---|")
    for length, per_layer in zip(lengths, layer_ms, strict=False):
        pages = -(-length // args.page_size)
        runs: dict[str, list[tuple[float, float, int]]] = {mode: [] for mode in MODES}
        for _ in range(args.forwards):
            for mode in MODES:
                src = rng.sample(range(pool_pages), pages)
                dst = rng.sample(range(pool_pages), pages)
                runs[mode].append(forward(bench, src, dst, mode, per_layer))
        for mode in MODES:
            fwd, written = [r[0] for r in runs[mode]], [r[1] for r in runs[mode]]
            made = ",".join(str(r[2]) for r in runs[mode])
            print(f"| {length} | {per_layer} | {mode} | {stat(fwd)} | {stat(written)} | {made} |")

    engine.close()
    parent.send("stop")
    receiver.join(30)


if __name__ == "__main__":
    main()
