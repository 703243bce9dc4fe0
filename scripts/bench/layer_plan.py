"""Host time to plan one layer group's KV write (`--kv-stream-layers`): the prefill node's Python
per group before the transfer engine sees it, for a model's shape and a prompt's pages.

    python -m scripts.bench.layer_plan --lengths 2048,8192 --repeat 50

Per prompt length: the prompt's pages (a random scattered set, `--page-size` tokens each), one
layer group of `--layers / --groups` layers, a prefill node of TP 1 writing into a decode node
of `--decode-tp` ranks. Times `route_pages` with the group's span (kvtransfer/head_routes.py:
one range per page and KV head), `KVSender.send_layers` into an engine that only counts (the
planning plus the sender's bookkeeping) and cuda_ipc's check and grouping of the first decode
rank's ranges (`group_ranges`, the start of its `write`; no GPU needed), best and median of
`--repeat` runs. Run the file with another checkout on PYTHONPATH to compare two versions:

    cd /tmp && PYTHONPATH=OTHER_CHECKOUT python CHECKOUT/scripts/bench/layer_plan.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence

from kvtransfer.base import (
    KVTransferEngine,
    MemoryRegion,
    PeerInfo,
    TransferConfig,
    TransferHandle,
    TransferRange,
    TransferState,
)
from kvtransfer.cuda_ipc_plan import ExportedRegion, IpcEndpoint, group_ranges
from kvtransfer.head_routes import HeadRoute, LayerSpan, RankKV, plan_routes, route_pages
from kvtransfer.room import RoomDestination
from kvtransfer.sender import KVSender


class CountingEngine(KVTransferEngine):
    """Takes every write at once and keeps nothing but the descriptor count."""

    name = "counting"

    def __init__(self) -> None:
        super().__init__(TransferConfig(backend="counting", node_name="bench"))
        self.descriptors = 0

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        pass

    def local_endpoint(self) -> bytes:
        return b""

    def connect(self, peer: PeerInfo) -> None:
        pass

    def write(self, peer_id: str, ranges: Sequence[TransferRange]) -> TransferHandle:
        self.descriptors += len(ranges)
        return TransferHandle()

    def poll(self, handle: TransferHandle) -> TransferState:
        return TransferState.DONE

    def release(self, handle: TransferHandle) -> None:
        pass

    def close(self) -> None:
        pass


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(best, median) seconds of `repeat` calls."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return min(runs), statistics.median(runs)


def add_kv_shape_args(parser: argparse.ArgumentParser) -> None:
    """Prompt lengths and the KV pool's shape (Llama-3-8B's by default) split into layer
    groups: the flags of the layer-streaming benches."""
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--layers", type=int, default=32, help="Llama-3-8B's shape by default")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype-bytes", type=int, default=2)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_kv_shape_args(parser)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()

    layer_page_bytes = 2 * args.page_size * args.head_dim * args.dtype_bytes  # K and V
    head_page_bytes = args.layers * layer_page_bytes
    heads = range(args.kv_heads)
    src = [RankKV(0, "", 1 << 32, heads, head_page_bytes)]
    per_rank = args.kv_heads // args.decode_tp
    dst = [
        RankKV(r, f"d#{r}", (r + 2) << 36, range(r * per_rank, (r + 1) * per_rank), head_page_bytes)
        for r in range(args.decode_tp)
    ]
    routes = plan_routes(src, dst)
    span = LayerSpan.of(range(args.layers // args.groups), layer_page_bytes)
    print(
        f"{args.layers} layers, {args.kv_heads} KV heads x {args.head_dim}, page {args.page_size}"
        f" tokens, group of {args.layers // args.groups} layers, decode TP {args.decode_tp}"
    )
    print(
        "| prompt | pages | ranges | route_pages ms best/median | send_layers ms best/median "
        "| cuda_ipc group_ranges ms best/median |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    rng = random.Random(0)
    for length in [int(x) for x in args.lengths.split(",")]:
        print(row(routes, span, args.page_size, length, args.repeat, rng))


def row(
    routes: list[HeadRoute],
    span: LayerSpan,
    page_size: int,
    length: int,
    repeat: int,
    rng: random.Random,
) -> str:
    """One prompt length's table row: the planning alone, then through the sender."""
    pages = -(-length // page_size)
    src_pages = rng.sample(range(4 * pages), pages)
    dst_pages = rng.sample(range(4 * pages), pages)
    plan = route_pages(routes, src_pages, dst_pages, span)
    ranges = sum(len(r) for by_peer in plan.values() for r in by_peer.values())
    plan_s = timed(lambda: route_pages(routes, src_pages, dst_pages, span), repeat)
    dest = RoomDestination(1, routes[0].dst.peer_id, "p", tuple(dst_pages), 0, 0, length)
    engine = CountingEngine()

    def send() -> None:
        KVSender(engine, dest, page_size, routes).send_layers(src_pages, pages, span)

    send_s = timed(send, repeat)
    first = routes[0].dst
    pool = 4 * pages * len(routes[0].src.kv_heads) * routes[0].src.head_page_bytes
    local = [ExportedRegion("kv", routes[0].src.kv_base, pool, "cuda:0")]
    peer = IpcEndpoint("d", "boot", 1, (ExportedRegion("kv", first.kv_base, pool, "cuda:0"),))
    to_first = plan[routes[0].src.tp_rank][first.peer_id]
    group_s = timed(lambda: group_ranges(to_first, local, peer, "bench"), repeat)
    return (
        f"| {length} | {pages} | {ranges} | {plan_s[0] * 1e3:.3f} / {plan_s[1] * 1e3:.3f} "
        f"| {send_s[0] * 1e3:.3f} / {send_s[1] * 1e3:.3f} "
        f"| {group_s[0] * 1e3:.3f} / {group_s[1] * 1e3:.3f} |"
    )


if __name__ == "__main__":
    main()
