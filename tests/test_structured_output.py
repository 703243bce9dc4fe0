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
The rest of the OpenAI surface on the same clusters: `logit_bias` and `min_tokens` equal HF's
`sequence_bias` and `min_new_tokens`, vLLM's `guided_*` fields, `nvext.ignore_eos`, the
deprecated `functions`, `models.retrieve`, /tokenize and /detokenize, `max_tokens: 0` with
`echo`.
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
from tests.test_gateway import RunningCluster, node_stub, pd_cluster_process, wait_idle

pytestmark = pytest.mark.slow  # the real default model


@pytest.fixture(scope="module", params=["pd", "colocated"])
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, default_model_dir
) -> Iterator[RunningCluster]:
    log = tmp_path_factory.mktemp(f"structured-{request.param}") / "pd-cluster.log"
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


def _hf_prompt_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
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
        expected = _hf_prompt_logprobs(default_model_dir, ids)
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
    expected = _hf_prompt_logprobs(default_model_dir, ids)
    assert pairs[0][0] is None and [lp for lp, _ in pairs[1:]] == pytest.approx(expected, abs=1e-3)
    assert meta["input_top_logprobs"][0] is None
    assert all(len(top) == 3 for top in meta["input_top_logprobs"][1:])


def test_echo_logprobs_refuses_a_stream(cluster, model_name) -> None:
    body = {"model": model_name, "prompt": "hi", "echo": True, "logprobs": 1, "stream": True}
    reply = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream"


# -- the rest of the OpenAI surface -----------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def _hf_generate(model: Any, ids: list[int], max_new_tokens: int, **options: Any) -> list[int]:
    """HF greedy from `ids` (stops at EOS), with generate's own logits processors."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **options
        )
    return out[0, len(ids) :].tolist()


def _chat_ids(tokenizer: Any, chat: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _pd(cluster: RunningCluster) -> bool:
    return "starting prefill-0" in cluster.log()


def test_logit_bias_equals_hf_with_the_bias_added(client, model_name, hf_model, tokenizer):
    """Completions and chat: the first token (drawn by the prefill node in PD) and every later
    one see the bias, as HF's `sequence_bias` adds it to the logits."""
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    plain = _hf_generate(hf_model, ids, 8)
    bias = {plain[0]: -100.0, plain[1]: -100.0, 13: 5.0}  # its first two tokens banned
    expected = _hf_generate(hf_model, ids, 8, sequence_bias={(t,): b for t, b in bias.items()})
    assert expected[:2] != plain[:2]
    logit_bias = {str(t): b for t, b in bias.items()}
    reply = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=8, temperature=0, logit_bias=logit_bias
    )
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    chat = [{"role": "user", "content": "Name a colour."}]
    chat_ids = _chat_ids(tokenizer, chat)
    first = _hf_generate(hf_model, chat_ids, 1)[0]
    expected = _hf_generate(hf_model, chat_ids, 6, sequence_bias={(first,): -100.0})
    reply = client.chat.completions.create(
        model=model_name, messages=chat, max_tokens=6, temperature=0,
        logit_bias={str(first): -100},
    )  # fmt: skip
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


MIN_TOKENS = 11
COUNTRIES = [
    "France",
    "Germany",
    "Italy",
    "Spain",
    "Japan",
    "China",
    "India",
    "Brazil",
    "Canada",
    "Mexico",
    "Egypt",
    "Kenya",
    "Peru",
    "Chile",
    "Norway",
    "Sweden",
    "Finland",
    "Poland",
    "Greece",
    "Turkey",
    "Russia",
    "Australia",
    "Argentina",
    "Portugal",
    "Ireland",
    "Austria",
    "Belgium",
    "Denmark",
    "Hungary",
    "Cuba",
    "Iran",
    "Iraq",
    "Israel",
    "Jordan",
    "Nepal",
    "Vietnam",
    "Thailand",
    "Morocco",
    "Nigeria",
    "Ghana",
    "Colombia",
    "Venezuela",
    "Ukraine",
    "Romania",
    "Bulgaria",
    "Serbia",
    "Croatia",
    "Iceland",
    "Scotland",
    "Wales",
]


def test_min_tokens_holds_every_answer_that_would_stop_early(
    cluster, client, model_name, hf_model, tokenizer
) -> None:
    """50 requests (PD; 8 colocated), most of whose answers would end before `min_tokens`
    (HF's greedy answer is 8-10 tokens for 35 of the 50): EOS is the model's first choice
    (its raw top logprob) somewhere before `min_tokens`, yet each runs to `min_tokens`, and
    its tokens equal HF's `min_new_tokens`."""
    count = len(COUNTRIES) if _pd(cluster) else 8
    chats = [[{"role": "user", "content": f"What is the capital of {c}?"}] for c in COUNTRIES]

    def ask(chat: list[dict[str, str]]) -> Any:
        return client.chat.completions.create(
            model=model_name, messages=chat, temperature=0, max_tokens=MIN_TOKENS,
            logprobs=True, top_logprobs=1, extra_body={"min_tokens": MIN_TOKENS},
        ).choices[0]  # fmt: skip

    with ThreadPoolExecutor(count) as pool:
        held = list(pool.map(ask, chats[:count]))
    eos = tokenizer.eos_token
    early = [i for i, c in enumerate(held) if any(t.top_logprobs[0].token == eos
             for t in c.logprobs.content)]  # fmt: skip
    assert len(early) >= count * 0.6, [c.message.content for c in held]
    for choice in held:
        assert choice.finish_reason == "length" and len(choice.logprobs.content) == MIN_TOKENS
        assert eos not in [t.token for t in choice.logprobs.content]
    for i in early[:3]:
        ids = _chat_ids(tokenizer, chats[i])
        expected = _hf_generate(hf_model, ids, MIN_TOKENS, min_new_tokens=MIN_TOKENS)
        assert held[i].message.content == tokenizer.decode(expected, skip_special_tokens=True)


GUIDED = {
    "guided_json": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "guided_regex": "(yes|no), [a-z]{2,8}",
    "guided_choice": ["Paris", "London", "Rome"],
    "guided_grammar": 'root ::= "Answer: " [0-9] [0-9]?',
}


@pytest.mark.parametrize("field", list(GUIDED))
def test_vllm_guided_fields_hold_the_output(client, model_name, field: str) -> None:
    value = GUIDED[field]
    reply = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40,
        temperature=0,
        extra_body={field: value},
    )
    text = reply.choices[0].message.content or ""
    if field == "guided_json":
        assert check(value, text) is None, text
    elif field == "guided_choice":
        assert text in value
    else:
        pattern = value if field == "guided_regex" else r"Answer: [0-9][0-9]?"
        assert re.fullmatch(pattern, text), text


def test_nvext_ignore_eos_runs_to_max_tokens(client, model_name) -> None:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ask = lambda **extra: client.chat.completions.create(  # noqa: E731
        model=model_name, messages=chat, max_tokens=16, temperature=0, **extra
    )
    assert ask().usage.completion_tokens < 16
    held = ask(extra_body={"nvext": {"ignore_eos": True}})
    assert held.usage.completion_tokens == 16 and held.choices[0].finish_reason == "length"


def test_deprecated_functions_answer_a_function_call(client, model_name) -> None:
    functions = [WEATHER_TOOL["function"]]
    reply = client.chat.completions.create(
        model=model_name, messages=ASK, functions=functions,
        function_call={"name": "get_weather"}, max_tokens=96, temperature=0,
    )  # fmt: skip
    choice = reply.choices[0]
    call = choice.message.function_call
    assert choice.finish_reason == "function_call" and call is not None, choice
    assert call.name == "get_weather" and not choice.message.tool_calls
    assert check(WEATHER_TOOL["function"]["parameters"], call.arguments) is None
    streamed = client.chat.completions.create(
        model=model_name, messages=ASK, functions=functions,
        function_call={"name": "get_weather"}, max_tokens=96, temperature=0, stream=True,
    )  # fmt: skip
    deltas = [c.choices[0] for c in streamed if c.choices]
    calls = [d.delta.function_call for d in deltas if d.delta.function_call]
    assert [(c.name, c.arguments) for c in calls] == [(call.name, call.arguments)]
    assert deltas[-1].finish_reason == "function_call"
    # the call and its result in the conversation, the deprecated way
    result = {"role": "function", "name": "get_weather", "content": '{"temperature": 21}'}
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "function_call": call.model_dump()},
        result,
    ]
    answer = client.chat.completions.create(
        model=model_name, messages=turn, functions=functions, max_tokens=24, temperature=0
    )
    assert answer.choices[0].message.content


def test_model_retrieval_tokenize_and_detokenize(cluster, client, model_name, tokenizer) -> None:
    card = client.models.retrieve(model_name)
    assert card.id == model_name and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    text = "Grüße, world! 123"
    url = cluster.url
    answer = httpx.post(url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    ids = tokenizer.encode(text)
    assert answer["tokens"] == ids and answer["count"] == len(ids)
    assert answer["max_model_len"] > 0 and len(answer["token_strs"]) == len(ids)
    chat = [{"role": "user", "content": text}]
    answer = httpx.post(url + "/tokenize", json={"model": model_name, "messages": chat}).json()
    assert answer["tokens"] == _chat_ids(tokenizer, chat) and answer["token_strs"] is None
    back = httpx.post(url + "/detokenize", json={"tokens": ids}).json()
    assert back == {"prompt": text}
    refused = httpx.post(url + "/detokenize", json={"tokens": [10**7]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens[0]"
    other = httpx.post(url + "/tokenize", json={"model": "other", "prompt": "x"})
    assert other.status_code == 404


def test_echo_with_max_tokens_zero_scores_the_prompt_only(client, model_name, default_model_dir):
    prompt = ECHO_PROMPTS[0]
    reply = client.completions.create(
        model=model_name, prompt=prompt, echo=True, logprobs=1, max_tokens=0
    )
    choice = reply.choices[0]
    assert choice.text == prompt and reply.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == prompt
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(prompt)
    expected = _hf_prompt_logprobs(default_model_dir, ids)
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-3)
