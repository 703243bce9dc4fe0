"""Prefill and decode nodes of different tensor-parallel sizes (issue 10).

Units: the KV-head routes between the ranks of two nodes (kvtransfer/head_routes.py) and their
byte ranges. End to end: real bootstrap, prefill and decode processes (each TP rank a process
with its own transfer engine) on 127.0.0.1; greedy output through P TP=a -> D TP=b equals
HF transformers on the default model (fp32), and no rank of either node holds a page after.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.node.tp_transfer import _decode_plan, _encode_plan
from gateway.process.launcher import NodeStartError, pd_trio
from kvtransfer.base import MemoryRegion, PeerInfo, PeerRank, TransferRange
from kvtransfer.head_routes import (
    HeadRouteError,
    NodeKV,
    RankKV,
    peer_ranks,
    plan_routes,
    route_pages,
)
from proto import node_pb2
from tests.helpers import generate_as_reference, greedy_reference_fixtures

HEAD = 1000  # bytes of one KV head's part of a page
MAX_NEW = 5


def _ranks(node: str, heads: list[range]) -> list[RankKV]:
    """Rank r's buffer at r * 10**6."""
    return [
        RankKV(r, node if r == 0 else f"{node}#tp{r}", r * 10**6, h, HEAD)
        for r, h in enumerate(heads)
    ]


def test_equal_tp_moves_whole_pages_coalesced() -> None:
    for heads in ([range(0, 3)], [range(0, 2), range(2, 3)]):
        routes = plan_routes(_ranks("p", heads), _ranks("d", heads))
        assert all(r.whole_pages for r in routes) and len(routes) == len(heads)
    plan = route_pages(
        plan_routes(_ranks("p", [range(0, 3)]), _ranks("d", [range(0, 3)])),
        [4, 5, 6, 9],
        [10, 11, 12, 13],
    )
    assert plan == {
        0: {
            "d": [
                TransferRange(4 * 3 * HEAD, 10 * 3 * HEAD, 3 * 3 * HEAD),
                TransferRange(9 * 3 * HEAD, 13 * 3 * HEAD, 3 * HEAD),
            ]
        }
    }


def test_two_prefill_ranks_write_their_heads_at_the_decode_rank_offsets() -> None:
    src = _ranks("p", [range(0, 2), range(2, 3)])
    dst = _ranks("d", [range(0, 3)])
    routes = plan_routes(src, dst)
    assert [(r.src.tp_rank, r.src_head, r.dst_head, r.num_heads) for r in routes] == [
        (0, 0, 0, 2),  # heads 0-1 merge into one route
        (1, 0, 2, 1),
    ]
    plan = route_pages(routes, [4, 5], [10, 11])
    # One range per page and run of heads: rank 1's page is 1 head, D's page 3 heads.
    assert plan[1]["d"] == [
        TransferRange(10**6 + 4 * HEAD, 10 * 3 * HEAD + 2 * HEAD, HEAD),
        TransferRange(10**6 + 5 * HEAD, 11 * 3 * HEAD + 2 * HEAD, HEAD),
    ]
    assert plan[0]["d"][0] == TransferRange(4 * 2 * HEAD, 10 * 3 * HEAD, 2 * HEAD)


def test_one_prefill_rank_into_three_and_replicated_heads() -> None:
    src = _ranks("p", [range(0, 3)])
    dst = _ranks("d", [range(0, 1), range(1, 2), range(2, 3)])
    plan = route_pages(plan_routes(src, dst), [1, 2], [7, 8])
    assert sorted(plan[0]) == ["d", "d#tp1", "d#tp2"]
    assert plan[0]["d#tp2"] == [
        TransferRange(1 * 3 * HEAD + 2 * HEAD, 2 * 10**6 + 7 * HEAD, HEAD),
        TransferRange(2 * 3 * HEAD + 2 * HEAD, 2 * 10**6 + 8 * HEAD, HEAD),
    ]
    # P TP=6 (each head on two ranks) -> D TP=3: D rank d takes the replica d % 2.
    six = _ranks("p", [range(h, h + 1) for h in (0, 0, 1, 1, 2, 2)])
    assert [r.src.tp_rank for r in plan_routes(six, dst)] == [0, 3, 4]


def test_routes_refuse_heads_nobody_holds() -> None:
    with pytest.raises(HeadRouteError, match="KV head 2 of decode rank 0 is held by no prefill"):
        plan_routes(_ranks("p", [range(0, 2)]), _ranks("d", [range(0, 3)]))


def test_peer_ranks_from_registration() -> None:
    kv = MemoryRegion("kv", 5000, 3 * 40 * HEAD)
    assert peer_ranks(PeerInfo("d", b"e", {"kv": kv}), 3, HEAD) == [
        RankKV(0, "d", 5000, range(0, 3), HEAD)
    ]
    ranks = (
        PeerRank(0, b"e0", MemoryRegion("kv", 0, 2 * 8 * HEAD), range(0, 2)),
        PeerRank(1, b"e1", MemoryRegion("kv", 9, 8 * HEAD), range(2, 3)),
    )
    aux = MemoryRegion("aux", 7, 70)
    peer = PeerInfo("d", b"e0", {"kv": ranks[0].kv, "aux": aux}, ranks)
    assert [(r.peer_id, r.page_bytes) for r in peer_ranks(peer, 3, HEAD)] == [
        ("d", 2 * HEAD),
        ("d#tp1", HEAD),
    ]
    assert [(p.node_id, sorted(p.regions)) for p in peer.rank_peers()] == [
        ("d", ["aux", "kv"]),
        ("d#tp1", ["kv"]),
    ]
    assert NodeKV.single(0, HEAD, 3).ranks[0].page_bytes == 3 * HEAD


def test_write_plan_wire_format_round_trips() -> None:
    plan = {
        1: {
            "d": [TransferRange(1, 2, 3)],
            "d#tp1": [TransferRange(4, 5, 6), TransferRange(7, 8, 9)],
        },
        2: {"d": [TransferRange(10, 11, 12)]},
    }
    payload = _encode_plan(42, plan)
    assert _decode_plan(payload, 1) == (42, plan[1])
    assert _decode_plan(payload, 2) == (42, plan[2])
    assert _decode_plan(payload, 3) == (42, {})


# ---- end to end ----------------------------------------------------------------------------
LENGTHS = [7, 40, 150]


prompts, hf_reference = greedy_reference_fixtures(LENGTHS, seed=10, max_new=MAX_NEW)


_MATRIX = pytest.mark.tp_matrix  # `make test-tp`; `make test` keeps one case per backend


@pytest.mark.slow
@pytest.mark.parametrize(
    ("p_tp", "d_tp", "backend"),
    [
        (2, 1, "mooncake"),
        (1, 3, "nixl"),
        pytest.param(2, 1, "nixl", marks=_MATRIX),
        pytest.param(1, 3, "mooncake", marks=_MATRIX),
        pytest.param(3, 1, "mooncake", marks=_MATRIX),
        pytest.param(3, 1, "nixl", marks=_MATRIX),
    ],
)
def test_pd_across_tp_sizes_matches_hf(
    tmp_path: Path, default_model_dir: Path, prompts, hf_reference, p_tp, d_tp, backend
) -> None:
    sampling = node_pb2.SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with pd_trio(
        tmp_path,
        default_model_dir,
        backend,
        node_args=["--max-total-tokens", "4096", "--page-size", "16"],
        prefill_args=["--tp-size", str(p_tp), "--chunked-prefill-size", "64"],
        decode_args=["--tp-size", str(d_tp)],
    ) as cluster:
        results = generate_as_reference(cluster, prompts, sampling, hf_reference)
        # One descriptor per page and run of KV heads at most (3 KV heads), never per token
        # or layer (30 layers x K,V x 16 tokens pieces per page and head if token-major).
        long = results[-1].prefill
        assert long is not None and long.descriptors <= 3 * long.sent_pages + 1
        cluster.check_no_leaks()


def test_decode_node_of_another_model_is_refused_at_registration(
    tmp_path: Path, tiny_model_dir
) -> None:
    """Same shapes but other weights' config (Qwen2 vs Llama): bootstrap refuses D, saying why."""
    refused = pytest.raises(NodeStartError, match=r"KV layout mismatch: layout\.model_id")
    with (
        refused,
        pd_trio(
            tmp_path,
            tiny_model_dir("llama"),
            "mooncake",
            prefill_args=["--tp-size", "2"],
            decode_args=["--model", str(tiny_model_dir("qwen2"))],
        ),
    ):
        pass
