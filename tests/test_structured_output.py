"""Structured output through a real `pd-cluster` (default model), driven with the official client.

Both cluster shapes: PD (every request prefilled by the prefill node, `--local-prefill-max-tokens
0`, so the first token is sampled there under the grammar) and colocated (`--prefill 0`). Every
schema of scripts/structured_schemas.py answers a valid document, streamed and not, and the
streamed pieces concatenate to the non-streamed text; `response_format` json_object and
json_schema, `chat.completions.parse` with a pydantic model, the native /generate's json_schema,
regex and ebnf; bad grammars answer 400 naming the field and the compiler's reason. Tools:
required and named choices give calls whose arguments satisfy their schema, streamed as
`tool_calls` deltas. Prompt logprobs (`echo` + `logprobs`, native `prompt_logprobs`), computed
by the node that prefills (the prefill node in PD), equal HF's log_softmax over the prompt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest

from scripts.serving.structured_check import ask
from scripts.structured_schemas import SCHEMAS, SchemaCase, check
from tests.test_gateway import (
    RunningCluster,
    node_stub,
    openai_client,
    shaped_cluster,
    wait_idle,
)

pytestmark = pytest.mark.slow  # the real default model


@pytest.fixture(scope="module", params=["pd", "colocated"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, default_model_dir
) -> Iterator[RunningCluster]:
    log = tmp_path_factory.mktemp(f"structured-{request.param}") / "pd-cluster.log"
    with shaped_cluster(request.param, log, default_model_dir) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai_client(cluster)


@pytest.fixture(scope="module")
def model_name(default_model_dir: Path) -> str:
    return default_model_dir.name


def _schema_format(case: SchemaCase) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": case.name, "schema": case.schema, "strict": True},
    }


def _ask(client: openai.OpenAI, model: str, case: SchemaCase, stream: bool) -> tuple[str, str]:
    """(text, finish_reason) of a greedy answer in `case`'s schema (structured_check's)."""
    return ask(client, model, case, stream, max_tokens=96)


def test_every_schema_gets_a_valid_document(client, model_name) -> None:
    jobs = [(case, stream) for case in SCHEMAS for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: _ask(client, model_name, *job), jobs))
    problems = []
    for (case, stream), (text, finish) in zip(jobs, answers, strict=True):
        reason = check(case.schema, text)
        if reason or finish != "stop":
            problems.append(f"{case.name} stream={stream} {finish}: {reason} {text!r}")
    assert not problems, "\n".join(problems)
    assert len(SCHEMAS) >= 20
    by_case: dict[str, list[str]] = {}
    for (case, _), (text, _) in zip(jobs, answers, strict=True):
        by_case.setdefault(case.name, []).append(text)
    assert all(a == b for a, b in by_case.values())  # streamed == whole, greedy


def test_json_object_mode(client, model_name) -> None:
    reply = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Give me a cat's name and colour as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=96,
        temperature=0,
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # free-form JSON may run on: what came is still the start of an object
        assert (choice.message.content or "").startswith("{")


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    celsius: int = pydantic.Field(ge=-60, le=60)
    sky: Literal["sunny", "cloudy", "rainy"]


def test_parse_with_a_pydantic_model(client, model_name) -> None:
    completion = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        response_format=Weather,
        max_tokens=64,
        temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather)
    beta = client.beta.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        response_format=Weather,
        max_tokens=64,
        temperature=0.7,
        seed=3,
    )
    assert isinstance(beta.choices[0].message.parsed, Weather)


def test_native_generate_takes_json_schema_regex_and_ebnf(cluster) -> None:
    schema = SCHEMAS[1].schema
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"json_schema": schema}, lambda t: check(schema, t) is None),
        ({"json_schema": json.dumps(schema)}, lambda t: check(schema, t) is None),
        ({"regex": r"(red|green|blue) [0-9]{1,3}"}, re.compile(r"(red|green|blue) [0-9]{1,3}")),
        ({"ebnf": 'root ::= "It is " ("yes" | "no") "."'}, re.compile(r"It is (yes|no)\.")),
    ]
    for grammar, valid in cases:
        body = {"text": "Answer:", "sampling_params": {"max_new_tokens": 48, **grammar}}
        reply = httpx.post(cluster.url + "/generate", json=body, timeout=120).json()
        text = reply["text"]
        ok = valid(text) if callable(valid) else valid.fullmatch(text)
        assert ok and reply["meta_info"]["finish_reason"] == "stop", (grammar, reply)


@pytest.mark.parametrize(
    ("route", "body", "param", "reason"),
    [
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "objectx"}}}},
            "response_format.json_schema.schema",
            'Unsupported type "objectx"',
        ),
        (
            "chat",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
            "response_format.json_schema.schema",
            "unsupported JSON Schema feature: 'uniqueItems' at /",
        ),
        (
            "chat",
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "is required",
        ),
        (
            "generate",
            {"sampling_params": {"regex": "[a-"}},
            "sampling_params.regex",
            "is not a valid regex: Regex parsing error",
        ),
        (
            "generate",
            {"sampling_params": {"ebnf": "root ::= missing"}},
            "sampling_params.ebnf",
            "is not a valid ebnf",
        ),
        (
            "generate",
            {"sampling_params": {"json_schema": "{not json"}},
            "sampling_params.json_schema",
            "is not valid JSON",
        ),
        (
            "generate",
            {"sampling_params": {"regex": "a+", "ebnf": 'root ::= "a"'}},
            "sampling_params.ebnf",
            "at most one of",
        ),
    ],
)  # fmt: skip
def test_bad_grammars_answer_400_naming_the_field(
    cluster, model_name, route: str, body: dict[str, Any], param: str, reason: str
) -> None:
    if route == "chat":
        url = cluster.url + "/v1/chat/completions"
        body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], **body}
    else:
        url, body = cluster.url + "/generate", {"text": "hi", **body}
    reply = httpx.post(url, json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and reason in error["message"], error


def test_max_tokens_cut_ends_with_length_and_the_partial_text(client, model_name, cluster) -> None:
    case = SCHEMAS[4]
    reply = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": case.prompt}],
        response_format=_schema_format(case),
        max_tokens=5,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.content or "").startswith('{"') and reply.usage is not None
    assert reply.usage.completion_tokens == 5
    names = ["decode-0"] + (["prefill-0"] if "starting prefill-0" in cluster.log() else [])
    for name in names:
        check = wait_idle(node_stub(cluster.node_address(name)))
        assert check.ok and check.used_pages == 0, check.error


# -- tools ------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def _check_call(call: Any, tools: list[dict[str, Any]]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    [tool] = [t for t in tools if t["function"]["name"] == call.function.name]
    assert check(tool["function"]["parameters"], call.function.arguments) is None


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_valid_calls(client, model_name, parallel: bool) -> None:
    reply = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=96,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        _check_call(call, TOOLS)


def test_named_tool_choice_calls_that_function(client, model_name) -> None:
    reply = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=96,
        temperature=0.8,
        seed=1,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"] * len(calls) and calls
    _check_call(calls[0], TOOLS)


def test_tool_choice_none_answers_in_text(client, model_name) -> None:
    reply = client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content


def test_streamed_tool_calls_arrive_as_deltas(client, model_name) -> None:
    stream = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": ""})
                call["id"] += delta.id or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    whole = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    [call] = whole.choices[0].message.tool_calls or []
    assert (calls[0]["name"], calls[0]["arguments"]) == (
        call.function.name,
        call.function.arguments,
    )


def test_a_conversation_with_tool_results(client, model_name) -> None:
    first = client.chat.completions.create(
        model=model_name, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96,
        temperature=0,
    )  # fmt: skip
    calls = first.choices[0].message.tool_calls or []
    messages: list[Any] = [*ASK, first.choices[0].message.model_dump(exclude_none=True)]
    messages += [
        {"role": "tool", "tool_call_id": c.id, "content": '{"celsius": 21, "sky": "sunny"}'}
        for c in calls
    ]
    reply = client.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24
    )
    assert reply.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "not": {}}}}]}, "tools[0].function.parameters"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ],
)  # fmt: skip
def test_bad_tools_answer_400(cluster, model_name, body: dict[str, Any], param: str) -> None:
    request = {"model": model_name, "messages": ASK, **body}
    reply = httpx.post(cluster.url + "/v1/chat/completions", json=request, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


# -- prompt logprobs --------------------------------------------------------------------------

ECHO_PROMPTS = ["The capital of France is Paris", "Question: 2 + 2 = ? Answer: 4"]


def hf_prompt_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        log_probs = model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    return [log_probs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_with_logprobs_scores_the_prompt_like_hf(client, model_name, default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    reply = client.completions.create(
        model=model_name, prompt=ECHO_PROMPTS, echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    for choice, prompt in zip(reply.choices, ECHO_PROMPTS, strict=True):
        ids = tokenizer.encode(prompt)
        expected = hf_prompt_logprobs(default_model_dir, ids)
        lp = choice.logprobs
        assert lp is not None and choice.text.startswith(prompt)
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-3)
        assert all(len(top) == 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset[: len(ids)] == sorted(lp.text_offset[: len(ids)])


def test_native_prompt_logprobs(cluster, default_model_dir) -> None:
    body = {
        "text": ECHO_PROMPTS[1],
        "sampling_params": {"max_new_tokens": 1, "prompt_logprobs": 3, "temperature": 0},
    }
    meta = httpx.post(cluster.url + "/generate", json=body, timeout=120).json()["meta_info"]
    pairs = meta["input_token_logprobs"]
    ids = [t for _, t in pairs]
    expected = hf_prompt_logprobs(default_model_dir, ids)
    assert pairs[0][0] is None and [lp for lp, _ in pairs[1:]] == pytest.approx(expected, abs=1e-3)
    assert meta["input_top_logprobs"][0] is None
    assert all(len(top) == 3 for top in meta["input_top_logprobs"][1:])


def test_echo_logprobs_refuses_a_stream(cluster, model_name) -> None:
    body = {"model": model_name, "prompt": "hi", "echo": True, "logprobs": 1, "stream": True}
    reply = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream"
