"""Gateway parts without processes: incremental detokenising, stop-string trimming, request
parsing, routing policies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine import sampling_fields as table
from engine.sampling import SamplingParams
from gateway.api.openapi import openapi_document
from gateway.config import GatewayConfig, LimitsConfig, ModelInfo
from gateway.dispatch.migration import Progress
from gateway.errors import APIError
from gateway.requests.protocol import parse_chat, parse_completion, parse_native
from gateway.requests.text import StopTrimmer, TextCodec
from gateway.routing.nodes import DECODE, PREFILL, LiveNode, NodeDirectory
from gateway.routing.policies import PrefixAware, Router
from proto import bootstrap_pb2, node_pb2
from tests.helpers import routing_config

LIMITS = LimitsConfig(
    max_inflight=8, max_body_bytes=1 << 20, max_n=4, max_stop=4, max_stop_chars=64
)
ROUTING = routing_config("prefix_aware", "round_robin", 8)


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
        "tools[0].function": {**base, "tools": [{"type": "function"}]},
        "tool_choice": {**base, "tool_choice": "required"},
        "function_call": {**base, "function_call": "auto"},
        "functions[0].name": {**base, "functions": [{"name": "no spaces"}]},
        "functions": {**base, "functions": [{"name": "f"}, {"name": "f"}]},
        "tools": {**base, "functions": [{"name": "f"}], "tools": []},
        "temprature": {**base, "temprature": 0.5},
        "nvext.greed": {**base, "nvext": {"greed": True}},
        "logit_bias.x": {**base, "logit_bias": {"x": 1}},
        "logit_bias.5": {**base, "logit_bias": {"5": 101}},
        "suffix": {**base, "suffix": "x"},
        "store": {**base, "store": True},
        "guided_regex": {**base, "guided_json": {}, "guided_regex": "a"},
        "messages[0].name": {**base, "messages": [{"role": "user", "content": "x", "name": "a"}]},
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
    # No length asked: the endpoint's default applies, shortened to fit the context.
    assert parse_native({"text": "x"}, LIMITS).sampling.max_tokens is None


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"temperature": -1}, "temperature", "`temperature` must be a finite number in [0, 2], "
         "got -1"),
        ({"top_p": 0}, "top_p", "`top_p` must be a finite number in (0, 1], got 0"),
        ({"top_k": 1.0}, "top_k", "`top_k` must be an integer in [-1, 2147483647] (-1 or 0: "
         "disabled), got 1.0"),
        ({"max_tokens": True}, "max_tokens", "`max_tokens` must be an integer >= 1, got True"),
        ({"stop": ""}, "stop", "`stop` must be a non-empty string or a list of non-empty "
         "strings, got ''"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids[1]", "`stop_token_ids[1]` must be >= 0, "
         "got -1"),
        ({"messages": []}, "messages", "`messages` must be a non-empty list of messages "
         "({role, content}), got []"),
        ({"messages": [{"role": "tool", "content": [{"type": "image_url"}]}]},
         "messages[0].content", "`messages[0].content` must be a string or a list of text "
         "parts ({type: text, text}), got [{'type': 'image_url'}]"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "`messages[0].role` is required"),
        ({"seed": table.INT64_MAX, "n": 2}, "seed",
         f"`seed` + n - 1 must fit in int64: at most {table.INT64_MAX - 1}"),
    ],
)  # fmt: skip
def test_validation_errors_name_the_field_and_the_rule(fields, param, message) -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(APIError) as info:
        parse_chat({**base, **fields}, "m", LIMITS)
    assert (info.value.status, info.value.param, info.value.message) == (400, param, message)


def _accepted(check, value) -> bool:
    try:
        check(value)
    except (APIError, ValueError):
        return False
    return True


@pytest.mark.parametrize("spec", table.NUMBER_FIELDS, ids=lambda spec: spec.name)
def test_gateway_and_engine_accept_the_same_values(spec) -> None:
    """One table: /generate's sampling_params (the engine's names) and SamplingParams agree."""
    values = [0, 1, -1, 0.5, 2**31, 2**63, -(2**63) - 1, 1e300, "1", True, None]
    for bound in (spec.minimum, spec.maximum):
        if bound is not None:
            values += [bound, bound - 1, bound + 1, bound - 0.001, bound + 0.001]
    gateway = lambda v: parse_native({"text": "x", "sampling_params": {spec.name: v}}, LIMITS)  # noqa: E731
    engine = lambda v: SamplingParams(**({} if v is None else {spec.name: v}))  # noqa: E731
    for value in values:
        assert _accepted(gateway, value) == _accepted(engine, value), (spec.name, value)


def test_openapi_schema_comes_from_the_request_models() -> None:
    config = GatewayConfig(
        "127.0.0.1", 1, "127.0.0.1:2", ModelInfo("path", "m", 32), LIMITS, ROUTING
    )
    schemas = openapi_document(config)["components"]["schemas"]
    chat = schemas["ChatBody"]["properties"]
    role = schemas["MessageBody"]["properties"]["role"]
    assert "tool" in role["enum"]  # the hand-written document used to omit it
    prompt_forms = schemas["CompletionBody"]["properties"]["prompt"]["anyOf"]
    assert {"type": "integer", "minimum": 0, "maximum": table.INT32_MAX} in [
        form.get("items") for form in prompt_forms
    ]
    assert chat["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 2}
    assert chat["model"]["enum"] == ["m"]
    assert chat["n"]["anyOf"][0]["maximum"] == LIMITS.max_n
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == 31
    assert chat["stop"]["anyOf"][1]["maxItems"] == LIMITS.max_stop


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


# -- migration bookkeeping (gateway/dispatch/migration.py) -----------------------------------------


def test_progress_resumes_with_the_streamed_tokens_and_the_rest_of_the_budget() -> None:
    sampling = node_pb2.SamplingParams(max_new_tokens=10, temperature=0.7, seed=3)
    progress = Progress([1, 2, 3], sampling)
    assert progress.next_sampling() is sampling and not progress.started
    progress.streamed += [7, 8, 9, 10]
    assert progress.input_ids == [1, 2, 3, 7, 8, 9, 10]
    resumed = progress.next_sampling()
    assert (resumed.max_new_tokens, resumed.seed, resumed.temperature) == (
        6,
        3,
        sampling.temperature,
    )
    assert sampling.max_new_tokens == 10  # the choice's own sampling is untouched
    last = node_pb2.Finished(
        finish_reason="length", usage=node_pb2.Usage(prompt_tokens=7, completion_tokens=6)
    )
    whole = progress.whole(last, resumed=4)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (3, 10)
    assert whole.finish_reason == "length" and last.usage.completion_tokens == 6


def test_progress_spent_budget_ends_by_length() -> None:
    progress = Progress([1], node_pb2.SamplingParams())  # no max_new_tokens: the engine default
    assert progress.budget == table.MAX_NEW_TOKENS.default
    progress.streamed += [5] * progress.budget
    assert progress.spent
    ended = progress.ended_by_length()
    assert ended.finish_reason == "length"
    assert ended.usage.completion_tokens == progress.budget


def test_a_draining_node_is_not_routable() -> None:
    directory = NodeDirectory(cooldown_s=5.0)
    for node_id in ("decode-a", "decode-b"):
        directory.nodes[node_id] = LiveNode(node_id, DECODE, "127.0.0.1:1", stub=None)  # type: ignore[arg-type]
    directory.nodes["decode-a"].load = bootstrap_pb2.NodeLoad(draining=True)
    assert [n.node_id for n in directory.live((DECODE,))] == ["decode-b"]


def test_every_route_is_in_the_openapi_document() -> None:
    from types import SimpleNamespace

    from gateway.api.app import build_app

    config = GatewayConfig(
        "127.0.0.1", 1, "127.0.0.1:2", ModelInfo("path", "m", 32), LIMITS, ROUTING
    )
    app = build_app(SimpleNamespace(config=config))  # type: ignore[arg-type]
    document = openapi_document(config)
    routes = {
        (route.path.replace(":path}", "}"), method.lower())
        for route in app.routes
        for method in getattr(route, "methods", None) or ()
        if method != "HEAD"
    }
    published = {(path, method) for path, item in document["paths"].items() for method in item}
    assert routes == published | {("/openapi.json", "get")}
    for path, item in document["paths"].items():
        body = item.get("post", {}).get("requestBody")
        if body is not None:  # each body's schema is a model's, with its fields
            name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
            assert document["components"]["schemas"][name]["properties"], path
