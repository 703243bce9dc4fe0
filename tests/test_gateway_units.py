"""Gateway parts without processes: incremental detokenising, stop-string trimming, request
parsing, routing policies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.config import LimitsConfig, RoutingConfig
from gateway.errors import APIError
from gateway.nodes import DECODE, PREFILL, LiveNode, NodeDirectory
from gateway.protocol import parse_chat, parse_completion
from gateway.routing import PrefixAware, Router
from gateway.text import StopTrimmer, TextCodec
from proto import bootstrap_pb2

LIMITS = LimitsConfig(
    max_inflight=8, max_body_bytes=1 << 20, max_n=4, max_stop=4, max_stop_chars=64
)
ROUTING = RoutingConfig(
    prefill_policy="prefix_aware",
    decode_policy="round_robin",
    local_prefill_max_tokens=8,
    max_attempts=3,
    node_cooldown_s=5.0,
    prefix_block_tokens=4,
    prefix_max_blocks=1000,
    prefix_balance_slack=2,
)


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TextCodec:
    return TextCodec.load(str(default_model_dir))


@pytest.mark.parametrize(
    "text",
    [
        "Grüße aus Köln 🚀🇫🇷 — 東京タワー naïve café ✓",
        "plain ascii text, nothing special",
        "😀😀😀",
    ],
)
def test_incremental_detokenizer_never_splits_a_character(codec: TextCodec, text: str) -> None:
    ids = codec.tokenizer.encode(text, add_special_tokens=False)
    prompt = codec.tokenizer.encode("Say:", add_special_tokens=False)
    detokenizer = codec.detokenizer(prompt)
    pieces = [detokenizer.push([t]) for t in ids] + [detokenizer.flush()]
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == codec.decode(ids) == text
    # Multi-byte characters span several tokens: some steps must have held their bytes back.
    if not text.isascii():
        assert "" in pieces[:-1]


@pytest.mark.parametrize(
    ("chunks", "stops", "sent", "stopped"),
    [
        (["Hello wor", "ld. Bye"], ["world"], "Hello ", "world"),
        (["ab", "c", "d"], ["cd", "x"], "ab", "cd"),
        (["one END", " two"], ["END", "one"], "", "one"),
        (["no stop ", "here E", "N"], ["END"], "no stop here EN", None),
        (["partial E"], ["END"], "partial E", None),
    ],
)
def test_stop_trimmer(chunks: list[str], stops: list[str], sent: str, stopped: str | None) -> None:
    trimmer = StopTrimmer(stops)
    out = []
    for chunk in chunks:
        out.append(trimmer.push(chunk))
    out.append(trimmer.flush())
    assert "".join(out) == sent
    assert trimmer.stopped == stopped


def test_stop_trimmer_holds_back_a_possible_stop_prefix() -> None:
    trimmer = StopTrimmer(["STOP"])
    assert trimmer.push("abc ST") == "abc "
    assert trimmer.push("O") == ""
    assert trimmer.push("P and more") == ""
    assert trimmer.stopped == "STOP"


def test_parse_errors_name_the_field() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    cases = {
        "temperature": {**base, "temperature": -1},
        "max_tokens": {**base, "max_tokens": 0},
        "n": {**base, "n": 5},
        "stop": {**base, "stop": ["a", "b", "c", "d", "e"]},
        "messages[0].role": {**base, "messages": [{"role": "robot", "content": "x"}]},
        "top_logprobs": {**base, "top_logprobs": 3},
        "stream_options": {**base, "stream_options": {"include_usage": True}},
        "tools": {**base, "tools": [{"type": "function"}]},
    }
    for param, body in cases.items():
        with pytest.raises(APIError) as info:
            parse_chat(body, "m", LIMITS)
        assert info.value.status == 400 and info.value.param == param, (param, info.value.message)
    with pytest.raises(APIError) as info:
        parse_chat({**base, "model": "other"}, "m", LIMITS)
    assert info.value.status == 404
    req = parse_chat({**base, "max_completion_tokens": 7, "seed": 3, "n": 2}, "m", LIMITS)
    assert req.sampling.max_tokens == 7
    assert [req.sampling.to_proto(7, c).seed for c in range(2)] == [3, 4]
    prompts = parse_completion({"model": "m", "prompt": [[1, 2], "x"]}, "m", LIMITS).prompts
    assert prompts == ((1, 2), "x")


def _node(node_id: str, role: int, inflight: int = 0) -> LiveNode:
    return LiveNode(node_id, role, "127.0.0.1:1", stub=None, inflight=inflight)  # type: ignore[arg-type]


def _directory(*nodes: LiveNode) -> NodeDirectory:
    directory = NodeDirectory(cooldown_s=5.0)
    directory.nodes = {n.node_id: n for n in nodes}
    return directory


def test_prefix_aware_follows_the_longest_known_prefix() -> None:
    policy = PrefixAware(ROUTING)
    a, b = _node("p-a", PREFILL), _node("p-b", PREFILL)
    shared = list(range(100, 112))
    first = policy.pick([a, b], [*shared, 1, 2, 3, 4])
    for tail in ([5, 6, 7, 8], [9, 9, 9, 9], []):
        assert policy.pick([a, b], shared + tail) is first
    # Too busy compared with the idlest node: balance wins over the cache.
    first.inflight = 10
    other = b if first is a else a
    assert policy.pick([a, b], [*shared, 1, 2, 3, 4]) is other


def test_router_conditional_disaggregation_and_cooldown() -> None:
    p, d = _node("p-1", PREFILL), _node("d-1", DECODE)
    directory = _directory(p, d)
    router = Router(directory, ROUTING)
    assert router.choose(list(range(8))).prefill is None  # short: D prefills locally
    assert router.choose(list(range(9))).prefill is p
    assert router.choose(list(range(9)), excluded={"p-1"}).prefill is None  # no P left
    directory.report_unreachable("p-1")
    assert router.choose(list(range(9))).prefill is p  # cooling, but the only one
    directory.nodes["p-2"] = _node("p-2", PREFILL)
    assert router.choose(list(range(9))).prefill is directory.nodes["p-2"]
    with pytest.raises(APIError) as info:
        Router(_directory(p), ROUTING).choose([1, 2, 3])
    assert info.value.status == 503


def test_directory_follows_node_events() -> None:
    # The directory opens grpc.aio channels: like the gateway, apply events inside a loop.
    async def scenario() -> None:
        directory = NodeDirectory(cooldown_s=1.0)
        info = bootstrap_pb2.NodeInfo(
            node_id="d-1", role=bootstrap_pb2.DECODE, grpc_address="127.0.0.1:9"
        )
        status = bootstrap_pb2.NodeStatus(node=info, alive=True)
        kinds = bootstrap_pb2.NodeEvent
        directory.apply(bootstrap_pb2.NodeEvent(kind=kinds.JOINED, status=status))
        assert directory.count(DECODE) == 1
        status.load.running_requests = 3
        directory.apply(bootstrap_pb2.NodeEvent(kind=kinds.LOAD, status=status))
        assert directory.nodes["d-1"].busy == 3
        directory.apply(bootstrap_pb2.NodeEvent(kind=kinds.LEFT, status=status))
        assert directory.count(DECODE) == 0
        directory.apply(bootstrap_pb2.NodeEvent(kind=kinds.JOINED, status=status))
        directory.apply(bootstrap_pb2.NodeEvent(kind=kinds.KIND_UNSPECIFIED))  # watch reconnected
        assert directory.nodes == {}
        await directory.close()

    asyncio.run(scenario())
