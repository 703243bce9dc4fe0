"""`POST /v1/responses` through a real `pd-cluster` (default model), driven with the openai SDK's
`client.responses`.

Both cluster shapes: PD (every request prefilled by the prefill node, `--local-prefill-max-tokens
0`) and colocated (`--prefill 0`). Greedy and short (at most 20 new tokens): a plain answer
equals the same conversation through chat completions (text and token counts); a stream is
OpenAI's event sequence, numbered in order, whose deltas make the answer, and the SDK's stream
helper reaches a parsed final response; a forced function call's arguments satisfy its schema and
its output answers in the next turn; `text.format` json_schema holds the output to the schema
(`client.responses.parse` too); a `previous_response_id` chain's prompt holds the first turn and
answers as the whole conversation sent as items; the id of a response not kept (`store: false`)
is a 404 and unsupported fields are 400s naming them.
The parts without a cluster (store bounds, parsing, events over a fake node) are
tests/test_responses_units.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pydantic
import pytest

from scripts.structured_schemas import check
from tests.test_gateway import RunningCluster, pd_cluster_process

pytestmark = pytest.mark.slow  # the real default model

ASK = "What is the capital of France?"
MAX_TOKENS = 12
WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CALL_TOKENS = 20  # {"name": "weather", "arguments": {"city": "Paris"}} and its end
FORMAT_TOKENS = 16  # {"sky": "sunny"} and its end, a token or two a character under a grammar
SKY = {
    "type": "object",
    "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy"]}},
    "required": ["sky"],
    "additionalProperties": False,
}


class Sky(pydantic.BaseModel):
    sky: Literal["sunny", "cloudy", "rainy"]


@pytest.fixture(scope="module", params=["pd", "colocated"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, default_model_dir
) -> Iterator[RunningCluster]:
    log = tmp_path_factory.mktemp(f"responses-{request.param}") / "pd-cluster.log"
    prefill = 1 if request.param == "pd" else 0
    gateway_args = ["--local-prefill-max-tokens", "0"]
    with pd_cluster_process(
        log, default_model_dir, "mooncake", prefill=prefill, gateway_args=gateway_args
    ) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(default_model_dir: Path) -> str:
    return default_model_dir.name


def _create(client: openai.OpenAI, model: str, **fields: Any) -> Any:
    return client.responses.create(**{
        "model": model, "temperature": 0, "max_output_tokens": MAX_TOKENS, **fields
    })  # fmt: skip


def test_a_plain_answer_equals_chat_completions(client, model) -> None:
    instructions = "You are a terse assistant."
    reply = _create(client, model, instructions=instructions, input=ASK)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": instructions}, {"role": "user", "content": ASK}],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    choice = chat.choices[0]
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == model
    assert reply.output_text == choice.message.content and reply.output_text
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert reply.instructions == instructions and reply.temperature == 0


def test_a_stream_is_the_event_sequence(client, model) -> None:
    whole = _create(client, model, input=ASK)
    events = list(_create(client, model, input=ASK, stream=True))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        f"response.{whole.status}",
    ]  # fmt: skip
    assert deltas >= 2  # a delta per chunk, as the tokens came
    numbers = [event.sequence_number for event in events]
    assert numbers == sorted(set(numbers))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == whole.output_text
    with client.responses.stream(
        model=model, input="Is it sunny in Paris?", text_format=Sky, temperature=0,
        max_output_tokens=FORMAT_TOKENS,
    ) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Sky)


def _call(reply: Any) -> Any:
    [call] = reply.output
    assert call.type == "function_call" and call.name == "weather", reply.output
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert check(WEATHER["parameters"], call.arguments) is None
    return call


def test_a_function_call_and_its_output(client, model) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = {"tools": [WEATHER], "parallel_tool_calls": False, "max_output_tokens": CALL_TOKENS}
    first = _create(client, model, input=ask, tool_choice="required", **tools)
    call = _call(first)
    named = {"type": "function", "name": "weather"}
    events = list(_create(client, model, input=ask, tool_choice=named, stream=True, **tools))
    assert [e.type for e in events][2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    streamed = _call(events[-1].response)
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}
    second = _create(client, model, input=[*ask, *first.output, result], tool_choice="none",
                     **tools)  # fmt: skip
    assert second.output_text and second.usage.input_tokens > first.usage.input_tokens


def test_text_format_json_schema(client, model) -> None:
    fmt = {"type": "json_schema", "name": "sky", "schema": SKY, "strict": True}
    reply = _create(
        client, model, input="Is it sunny in Paris?", text={"format": fmt},
        max_output_tokens=FORMAT_TOKENS,
    )  # fmt: skip
    assert reply.status == "completed" and check(SKY, reply.output_text) is None
    assert reply.text.format.type == "json_schema"
    parsed = client.responses.parse(
        model=model, input="Is it sunny in Paris?", text_format=Sky, temperature=0,
        max_output_tokens=FORMAT_TOKENS,
    )  # fmt: skip
    assert isinstance(parsed.output_parsed, Sky)


def test_previous_response_id_continues_the_conversation(client, model) -> None:
    first = _create(client, model, input=ASK)
    second = _create(client, model, input="And of Italy?", previous_response_id=first.id)
    whole = _create(client, model, store=False, input=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Italy?"},
    ])  # fmt: skip
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.output_text == whole.output_text and second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError) as info:
        _create(client, model, input="x", previous_response_id=whole.id)  # store: false
    assert info.value.param == "previous_response_id"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content"),
        ({"extra_body": {"foo": 1}}, "foo"),
    ],
)  # fmt: skip
def test_unsupported_fields_answer_400_naming_them(client, model, fields, param) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, model, **{"input": "hi", **fields})
    assert info.value.param == param, info.value.message
