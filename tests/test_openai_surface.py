"""The OpenAI surface beyond plain chat and completions, through a real `pd-cluster` (default
model), driven with the openai SDK.

Both cluster shapes: PD (every request prefilled by the prefill node, `--local-prefill-max-tokens
0`, so the first token is drawn there) and colocated (`--prefill 0`).

Sampling fields and aliases: `logit_bias` and `min_tokens` equal HF's `sequence_bias` and
`min_new_tokens` (50 requests that would stop early hold to `min_tokens`), vLLM's `guided_*`
fields hold the output, `nvext.ignore_eos` runs to `max_tokens`, the deprecated `functions`
answer a `function_call`; `models.retrieve`, /tokenize and /detokenize, `max_tokens: 0` with
`echo` (the prompt scored like HF). Structured output and tools themselves are
tests/test_structured_output.py's.

`POST /v1/responses` (`client.responses`), greedy and short (at most 20 new tokens): a plain answer
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

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest

from scripts.structured_schemas import check
from tests.test_gateway import RunningCluster, openai_client, shaped_cluster
from tests.test_structured_output import ASK as TOOL_ASK
from tests.test_structured_output import ECHO_PROMPTS, WEATHER_TOOL, hf_prompt_logprobs

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
    log = tmp_path_factory.mktemp(f"surface-{request.param}") / "pd-cluster.log"
    with shaped_cluster(request.param, log, default_model_dir) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai_client(cluster)


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


def test_logit_bias_equals_hf_with_the_bias_added(client, model, hf_model, tokenizer):
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
        model=model, prompt=prompt, max_tokens=8, temperature=0, logit_bias=logit_bias
    )
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    chat = [{"role": "user", "content": "Name a colour."}]
    chat_ids = _chat_ids(tokenizer, chat)
    first = _hf_generate(hf_model, chat_ids, 1)[0]
    expected = _hf_generate(hf_model, chat_ids, 6, sequence_bias={(first,): -100.0})
    reply = client.chat.completions.create(
        model=model, messages=chat, max_tokens=6, temperature=0,
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
    cluster, client, model, hf_model, tokenizer
) -> None:
    """50 requests (PD; 8 colocated), most of whose answers would end before `min_tokens`
    (HF's greedy answer is 8-10 tokens for 35 of the 50): EOS is the model's first choice
    (its raw top logprob) somewhere before `min_tokens`, yet each runs to `min_tokens`, and
    its tokens equal HF's `min_new_tokens`."""
    count = len(COUNTRIES) if _pd(cluster) else 8
    chats = [[{"role": "user", "content": f"What is the capital of {c}?"}] for c in COUNTRIES]

    def ask(chat: list[dict[str, str]]) -> Any:
        return client.chat.completions.create(
            model=model, messages=chat, temperature=0, max_tokens=MIN_TOKENS,
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
def test_vllm_guided_fields_hold_the_output(client, model, field: str) -> None:
    value = GUIDED[field]
    reply = client.chat.completions.create(
        model=model,
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


def test_nvext_ignore_eos_runs_to_max_tokens(client, model) -> None:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ask = lambda **extra: client.chat.completions.create(  # noqa: E731
        model=model, messages=chat, max_tokens=16, temperature=0, **extra
    )
    assert ask().usage.completion_tokens < 16
    held = ask(extra_body={"nvext": {"ignore_eos": True}})
    assert held.usage.completion_tokens == 16 and held.choices[0].finish_reason == "length"


def test_deprecated_functions_answer_a_function_call(client, model) -> None:
    functions = [WEATHER_TOOL["function"]]
    reply = client.chat.completions.create(
        model=model, messages=TOOL_ASK, functions=functions,
        function_call={"name": "get_weather"}, max_tokens=96, temperature=0,
    )  # fmt: skip
    choice = reply.choices[0]
    call = choice.message.function_call
    assert choice.finish_reason == "function_call" and call is not None, choice
    assert call.name == "get_weather" and not choice.message.tool_calls
    assert check(WEATHER_TOOL["function"]["parameters"], call.arguments) is None
    streamed = client.chat.completions.create(
        model=model, messages=TOOL_ASK, functions=functions,
        function_call={"name": "get_weather"}, max_tokens=96, temperature=0, stream=True,
    )  # fmt: skip
    deltas = [c.choices[0] for c in streamed if c.choices]
    calls = [d.delta.function_call for d in deltas if d.delta.function_call]
    assert [(c.name, c.arguments) for c in calls] == [(call.name, call.arguments)]
    assert deltas[-1].finish_reason == "function_call"
    # the call and its result in the conversation, the deprecated way
    result = {"role": "function", "name": "get_weather", "content": '{"temperature": 21}'}
    turn = [
        *TOOL_ASK,
        {"role": "assistant", "content": None, "function_call": call.model_dump()},
        result,
    ]
    answer = client.chat.completions.create(
        model=model, messages=turn, functions=functions, max_tokens=24, temperature=0
    )
    assert answer.choices[0].message.content


def test_model_retrieval_tokenize_and_detokenize(cluster, client, model, tokenizer) -> None:
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    text = "Grüße, world! 123"
    url = cluster.url
    answer = httpx.post(url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    ids = tokenizer.encode(text)
    assert answer["tokens"] == ids and answer["count"] == len(ids)
    assert answer["max_model_len"] > 0 and len(answer["token_strs"]) == len(ids)
    chat = [{"role": "user", "content": text}]
    answer = httpx.post(url + "/tokenize", json={"model": model, "messages": chat}).json()
    assert answer["tokens"] == _chat_ids(tokenizer, chat) and answer["token_strs"] is None
    back = httpx.post(url + "/detokenize", json={"tokens": ids}).json()
    assert back == {"prompt": text}
    refused = httpx.post(url + "/detokenize", json={"tokens": [10**7]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens[0]"
    other = httpx.post(url + "/tokenize", json={"model": "other", "prompt": "x"})
    assert other.status_code == 404


def test_echo_with_max_tokens_zero_scores_the_prompt_only(client, model, default_model_dir):
    prompt = ECHO_PROMPTS[0]
    reply = client.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=0
    )
    choice = reply.choices[0]
    assert choice.text == prompt and reply.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == prompt
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(prompt)
    expected = hf_prompt_logprobs(default_model_dir, ids)
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-3)
