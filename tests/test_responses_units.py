"""`POST /v1/responses` without processes: the response store's bounds, the body's parsing and
its errors, and the handler over a fake dispatcher (what the prompt holds for a chained request,
the response object, the streamed event sequence and an error after the stream started), with
the default model's tokenizer. tests/test_openai_surface.py drives real clusters with the SDK."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.api.openapi import openapi_document
from gateway.api.response_store import ResponseStore
from gateway.api.responses_api import ResponsesHandler, response_store, store_refusal
from gateway.config import GatewayConfig, LimitsConfig, ModelInfo, ResponseStoreConfig
from gateway.errors import APIError, GenerationFailed
from gateway.process.server import build_parser
from gateway.requests.protocol import ChatMessage
from gateway.requests.responses import check_call_outputs, parse_responses
from gateway.requests.text import TextCodec
from gateway.requests.tools import ToolCall
from proto import node_pb2
from tests.helpers import routing_config

LIMITS = LimitsConfig(
    max_inflight=8, max_body_bytes=1 << 20, max_n=4, max_stop=4, max_stop_chars=64
)
MODEL = "m"
ANSWER = "Paris is the capital of France."


def _config(workers: int = 1, store: ResponseStoreConfig | None = None) -> GatewayConfig:
    routing = routing_config("prefix_aware", "round_robin", 8)
    model = ModelInfo("path", MODEL, 2048)
    return GatewayConfig(
        "127.0.0.1", 1, "127.0.0.1:2", model, LIMITS, routing, workers=workers,
        response_store=store or ResponseStoreConfig(),
    )  # fmt: skip


# -- the store ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _turn(text: str) -> tuple[ChatMessage, ...]:
    return (ChatMessage("user", text),)


def test_the_store_evicts_the_oldest_beyond_its_size() -> None:
    store = ResponseStore(2, 60, Clock())
    for name in ("a", "b", "c"):
        store.put(name, _turn(name))
    assert len(store) == 2
    assert store.get("a") is None
    assert store.get("b") == _turn("b") and store.get("c") == _turn("c")


def test_the_store_forgets_a_response_after_its_ttl() -> None:
    clock = Clock()
    store = ResponseStore(8, 60, clock)
    store.put("a", _turn("a"))
    clock.now += 30
    store.put("b", _turn("b"))
    clock.now += 29.9
    assert store.get("a") == _turn("a")
    clock.now += 0.1  # a's 60 s are over, b has 30 s left
    assert store.get("a") is None and len(store) == 1
    clock.now += 30
    store.put("c", _turn("c"))  # drops the expired b on its way in
    assert len(store) == 1 and store.get("b") is None and store.get("c") == _turn("c")


def test_store_config_and_flags() -> None:
    with pytest.raises(ValueError, match="--response-store-size"):
        ResponseStoreConfig(size=-1)
    with pytest.raises(ValueError, match="--response-store-ttl"):
        ResponseStoreConfig(ttl_s=0)
    args = build_parser().parse_args(
        ["--bootstrap", "b:1", "--response-store-size", "7", "--response-store-ttl", "9.5"]
    )
    assert (args.response_store_size, args.response_store_ttl) == (7, 9.5)
    assert store_refusal(_config()) is None and response_store(_config()) is not None
    for config in (_config(workers=2), _config(store=ResponseStoreConfig(size=0))):
        assert response_store(config) is None and store_refusal(config)
    assert "--workers 2" in (store_refusal(_config(workers=2)) or "")


# -- the body ----------------------------------------------------------------------------------

TOOL = {"type": "function", "name": "weather", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning", "not supported"),
        ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
        ({"background": True}, "background", "not supported"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
        ({"truncation": "auto"}, "truncation", "must be 'disabled'"),
        ({"foo": 1}, "foo", "`foo` is not a field of this request (this server would not use "
         "it): leave it out; GET /openapi.json lists every field"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "not a field"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "no built-in tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice.name", "not in `tools`"),
        ({"tools": [{**TOOL, "parameters": {"type": "object", "not": {}}}]},
         "tools[0].parameters", "unsupported JSON Schema feature"),
        ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
        ({"tools": [TOOL], "tool_choice": "required",
          "text": {"format": {"type": "json_object"}}}, "tool_choice", "`text.format`"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
         "required"),
        ({"text": {"format": {"type": "text", "schema": {}}}}, "text.format.schema",
         "'json_schema' format only"),
        ({"input": []}, "input", "at least 1"),
        ({"input": 5}, "input", "a string (one user message) or a non-empty list"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "'user'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content", "text parts"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "no built-in"),
        ({"input": [{"role": "user", "content": "x", "call_id": "c"}]}, "input[0].call_id",
         "not a field of a message item"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
         "input[0].arguments", "required in a function_call item"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input",
         "no function_call with that call_id"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "at most 16 string pairs"),
        ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"temperature": 3}, "temperature", "[0, 2]"),
        ({"store": "yes"}, "store", "true"),
    ],
)  # fmt: skip
def test_body_errors_name_the_field(fields: dict[str, Any], param: str, words: str) -> None:
    body = {"model": MODEL, "input": "hi", **fields}
    with pytest.raises(APIError) as info:
        req = parse_responses(body, MODEL, LIMITS)
        check_call_outputs(req.input)
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    assert words in info.value.message


def test_input_items_become_chat_messages() -> None:
    # an answer's output items sent back as input, as clients do with `response.output`
    answer = {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
    }
    call = {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    }
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                     {"type": "input_text", "text": "Paris?"}]},
        answer, call, {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
    ]  # fmt: skip
    req = parse_responses({"model": MODEL, "input": items, "reasoning": None}, MODEL, LIMITS)
    calls = (
        ToolCall("call_1", "weather", '{"city": "Paris"}'),
        ToolCall("call_2", "weather", '{"city": "Paris"}'),
    )
    assert req.input == (
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "Let me look.", calls),
        ChatMessage("tool", "21 C", tool_call_id="call_1"),
    )
    check_call_outputs(req.input)
    plain = parse_responses({"model": MODEL, "input": "hi", "instructions": "Be brief."}, MODEL,
                            LIMITS)  # fmt: skip
    assert plain.input == (ChatMessage("user", "hi"),)
    assert plain.instructions == (ChatMessage("system", "Be brief."),)


def test_openapi_publishes_the_route_and_its_body() -> None:
    document = openapi_document(_config())
    post = document["paths"]["/v1/responses"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponsesBody"
    }
    schemas = document["components"]["schemas"]
    body = schemas["ResponsesBody"]
    assert body["additionalProperties"] is False and set(body["required"]) == {"model", "input"}
    assert body["properties"]["model"]["enum"] == [MODEL]
    assert body["properties"]["max_output_tokens"]["anyOf"][0]["maximum"] == 2047
    assert "reasoning" not in body["properties"]
    assert schemas["InputItem"]["properties"]["type"]["enum"] == [
        "message", "function_call", "function_call_output"
    ]  # fmt: skip


# -- the handler over a fake dispatcher --------------------------------------------------------


class FakeGeneration:
    """What `Dispatcher.generation` returns: the answer's tokens one per chunk, then its end
    (or a node failure after `fail_after` chunks)."""

    def __init__(self, ids: list[int], reason: str, fail_after: int | None) -> None:
        self.ids, self.reason, self.fail_after = ids, reason, fail_after
        self.finished: node_pb2.Finished | None = None
        self.cached_tokens, self.cache_node, self.timeline = 0, "", None
        self.prompt_logprobs: list[node_pb2.TokenLogprobs] = []

    def __aiter__(self) -> AsyncGenerator[node_pb2.TokenChunk, None]:
        return self._chunks()

    async def _chunks(self) -> AsyncGenerator[node_pb2.TokenChunk, None]:
        for sent, token in enumerate(self.ids):
            if sent == self.fail_after:
                raise GenerationFailed("decode node d0 died; no other node could go on")
            yield node_pb2.TokenChunk(token_ids=[token])
        usage = node_pb2.Usage(completion_tokens=len(self.ids))
        self.finished = node_pb2.Finished(finish_reason=self.reason, usage=usage)


class FakeDispatcher:
    def __init__(self, codec: TextCodec) -> None:
        self.answer = codec.tokenizer.encode(ANSWER, add_special_tokens=False)
        self.reason = "stop"
        self.fail_after: int | None = None
        self.prompts: list[list[int]] = []

    def generation(self, prompt_ids: list[int], sampling: Any, rid: str, lane: Any = None) -> Any:
        self.prompts.append(list(prompt_ids))
        return FakeGeneration(self.answer, self.reason, self.fail_after)


@pytest.fixture(scope="module")
def codec(default_model_dir: Path) -> TextCodec:
    return TextCodec.load(str(default_model_dir))


def _handler(codec: TextCodec, config: GatewayConfig) -> Iterator[ResponsesHandler]:
    dispatcher = FakeDispatcher(codec)
    handler = ResponsesHandler(
        codec, dispatcher, config.model, config.limits,
        store=response_store(config), store_off=store_refusal(config),
    )  # fmt: skip
    yield handler
    handler.encoder.close()


@pytest.fixture
def handler(codec: TextCodec) -> Iterator[ResponsesHandler]:
    yield from _handler(codec, _config())


def _create(handler: ResponsesHandler, **fields: Any) -> Any:
    return asyncio.run(handler.create({"model": MODEL, **fields}))


def _events(handler: ResponsesHandler, **fields: Any) -> list[tuple[str, dict[str, Any]]]:
    async def run() -> list[bytes]:
        frames = await handler.create({"model": MODEL, "stream": True, **fields})
        assert not isinstance(frames, dict)
        return [frame async for frame in frames]

    events = []
    for frame in asyncio.run(run()):
        kind, data = frame.decode().removesuffix("\n\n").split("\n")
        events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_a_response_object_in_openai_shape(handler: ResponsesHandler) -> None:
    out = _create(handler, input="Capital of France?", max_output_tokens=9, metadata={"k": "v"})
    assert out["id"].startswith("resp_") and out["object"] == "response"
    assert (out["status"], out["incomplete_details"], out["error"]) == ("completed", None, None)
    [message] = out["output"]
    assert message["type"] == "message" and message["id"].startswith("msg_")
    assert message["content"] == [{"type": "output_text", "text": ANSWER, "annotations": []}]
    prompt = len(handler.dispatcher.prompts[0])
    answer = len(handler.dispatcher.answer)
    assert out["usage"] == {
        "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": answer, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + answer,
    }  # fmt: skip
    assert (out["store"], out["metadata"], out["max_output_tokens"]) == (True, {"k": "v"}, 9)
    assert (out["tool_choice"], out["tools"], out["text"]) == (
        "auto",
        [],
        {"format": {"type": "text"}},
    )
    handler.dispatcher.reason = "length"
    out = _create(handler, input="Capital of France?")
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_chained_request_continues_the_kept_conversation(handler: ResponsesHandler) -> None:
    first = _create(handler, input="Capital of France?", instructions="Be brief.")
    second = _create(handler, input="And of Italy?", previous_response_id=first["id"])
    whole = _create(handler, store=False, input=[
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "And of Italy?"},
    ])  # fmt: skip
    prompts = handler.dispatcher.prompts
    assert prompts[1] == prompts[2]  # the instructions are not carried over
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert second["previous_response_id"] == first["id"] and whole["store"] is False
    assert handler.store is not None and handler.store.get(whole["id"]) is None
    third = _create(handler, input="And of Spain?", previous_response_id=second["id"])
    assert len(prompts[3]) > len(prompts[1]) + len(handler.dispatcher.answer)
    with pytest.raises(APIError) as info:
        _create(handler, input="x", previous_response_id="resp_unknown")
    assert (info.value.status, info.value.param) == (404, "previous_response_id")
    assert "resp_unknown" in info.value.message and third["status"] == "completed"


def test_with_several_workers_no_response_is_kept(codec: TextCodec) -> None:
    for handler in _handler(codec, _config(workers=2)):
        for fields, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                              ({"store": True}, "store")):  # fmt: skip
            with pytest.raises(APIError) as info:
                _create(handler, input="hi", **fields)
            assert (info.value.status, info.value.param) == (400, param)
            assert "--workers 2" in info.value.message and "`input` items" in info.value.message
        assert _create(handler, input="hi")["store"] is False


def test_the_streamed_event_sequence(handler: ResponsesHandler) -> None:
    events = _events(handler, input="Capital of France?")
    kinds = [kind for kind, _ in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert deltas == len(handler.dispatcher.answer)
    assert all(data["type"] == kind for kind, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    text = "".join(data["delta"] for kind, data in events if kind == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert text == ANSWER == final["output"][0]["content"][0]["text"]
    assert events[0][1]["response"]["status"] == "in_progress" and final["status"] == "completed"
    assert handler.store is not None and handler.store.get(final["id"]) is not None


def test_a_streamed_tool_call(handler: ResponsesHandler) -> None:
    call = '{"name": "weather", "arguments": {"city": "Paris"}}'
    handler.dispatcher.answer = handler.codec.tokenizer.encode(call, add_special_tokens=False)
    events = _events(handler, input="Weather?", tools=[TOOL], tool_choice="required",
                     parallel_tool_calls=False)  # fmt: skip
    assert [kind for kind, _ in events][2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    item = events[-2][1]["item"]
    assert item["type"] == "function_call" and item["name"] == "weather"
    assert json.loads(item["arguments"]) == {"city": "Paris"}
    assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
    assert events[-1][1]["response"]["output"] == [item]


def test_an_error_after_the_stream_started_ends_it(handler: ResponsesHandler) -> None:
    handler.dispatcher.fail_after = 3
    events = _events(handler, input="Capital of France?")
    kinds = [kind for kind, _ in events]
    assert kinds[-2:] == ["error", "response.failed"]
    assert kinds.count("response.output_text.delta") == 3
    error, failed = events[-2][1], events[-1][1]["response"]
    assert error["code"] == "node_failed" and "d0 died" in error["message"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "node_failed"
    assert handler.store is not None and handler.store.get(failed["id"]) is None
