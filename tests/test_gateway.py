"""The gateway of a real `pd-cluster` (bootstrap + 1 prefill + 1 decode + gateway on 127.0.0.1),
driven with the official `openai` client, on Mooncake and the default model. The gateway never
touches the transfer engine (the nodes do): NIXL's side of the same path is test_disagg.py's
(greedy equal to HF, layer-group streaming), test_tp_disagg.py's and test_disagg_failures.py's.

Every request goes through the prefill node (`--local-prefill-max-tokens 0`). Greedy text equals
HF transformers; streamed pieces concatenate to the non-streaming text; stop strings, n, seed,
logprobs, echo, usage, the native /generate; bad input gets a 4xx in OpenAI's error shape and
the server keeps serving; a client that disconnects mid-stream leaves both nodes idle; API keys
and --max-inflight are enforced. The cluster is stopped with SIGTERM and must leave no process.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from engine.ports import free_port
from gateway.process.launcher import console_script, session_pids
from proto import node_pb2, node_pb2_grpc
from scripts.tiny_models import hf_greedy
from tests.helpers import terminate

pytestmark = pytest.mark.slow  # the real default model

API_KEY = "test-key"
MAX_INFLIGHT = 2
MAX_BODY = 65536
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colours of the rainbow."},
    ],
]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 12


# -- a pd-cluster process ---------------------------------------------------------------------


@dataclass
class RunningCluster:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def node_address(self, name: str) -> str:
        """host:port of a child (`prefill-0`, `decode-1`, `bootstrap`) from the start lines."""
        match = re.search(rf"starting {name}: .* --port (\d+)", self.log())
        assert match, f"no start line for {name}"
        return f"127.0.0.1:{match.group(1)}"

    def child_pid(self, name: str) -> int:
        port = self.node_address(name).rsplit(":", 1)[1]
        for pid in _children(self.process.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if port.encode() in cmdline:
                return pid
        raise AssertionError(f"no process for {name}")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a Prometheus sample over the series that carry these labels."""
        text = httpx.get(self.url + "/metrics").text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def pd_cluster_process(
    log_path: Path,
    model: Path,
    backend: str,
    prefill: int = 1,
    decode: int = 1,
    gateway_args: Sequence[str] = (),
    node_args: Sequence[str] = (),
) -> Iterator[RunningCluster]:
    """`pd-cluster` as an operator runs it; SIGTERM at the end, and no process may be left."""
    port = free_port()
    command = [console_script("pd-cluster"), "--model", str(model), "--port", str(port)]
    command += ["--prefill", str(prefill), "--decode", str(decode)]
    command += ["--transfer-backend", backend, "--max-total-tokens", "8192"]
    command += ["--gateway-args", " ".join(gateway_args), "--node-args", " ".join(node_args)]
    with launched_cluster(command, port, log_path) as cluster:
        yield cluster


@contextmanager
def shaped_cluster(shape: str, log_path: Path, model: Path) -> Iterator[RunningCluster]:
    """A Mooncake `pd-cluster` of `model` in one of the two shapes the API tests run in: "pd"
    (every prompt prefilled by the prefill node, so the first token is drawn there) or
    "colocated" (no prefill node)."""
    prefill = 1 if shape == "pd" else 0
    gateway_args = ["--local-prefill-max-tokens", "0"]
    with pd_cluster_process(
        log_path, model, "mooncake", prefill=prefill, gateway_args=gateway_args
    ) as cluster:
        yield cluster


def openai_client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)


@contextmanager
def launched_cluster(
    command: list[str], port: int, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[RunningCluster]:
    """Run a `pd-cluster` command until it is ready; SIGTERM at the end, no process left."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    cluster = RunningCluster(process, f"http://127.0.0.1:{port}", log_path)
    try:
        while "[pd-cluster] ready:" not in cluster.log():
            assert process.poll() is None, f"pd-cluster exited:\n{cluster.log()[-4000:]}"
            time.sleep(0.2)
        assert _healthy(cluster.url)
        yield cluster
    finally:
        leftovers = _stop_cluster(process)
        assert not leftovers, f"processes left behind: {leftovers}\n{cluster.log()[-3000:]}"


def _stop_cluster(process: subprocess.Popen[bytes]) -> list[int]:
    members_before = set(_children(process.pid))
    terminate(process, 120)
    # a member may go a moment after pd-cluster (a gateway's multiprocessing resource tracker
    # exits once it reads its supervisor's pipe closed): leftovers are what is still there later
    deadline = time.monotonic() + 30
    while True:
        left = [pid for pid in members_before if Path(f"/proc/{pid}").exists()]
        left += [pid for child in members_before for pid in session_pids(child)]
        left = sorted(set(left) - {process.pid})
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def node_stub(address: str) -> node_pb2_grpc.NodeStub:
    return node_pb2_grpc.NodeStub(grpc.insecure_channel(address))


def wait_idle(stub: node_pb2_grpc.NodeStub) -> node_pb2.CheckIntegrityResponse:
    """Poll until the node runs nothing and holds no page (the test's timeout bounds it)."""
    while True:
        load = stub.GetLoad(node_pb2.GetLoadRequest(), timeout=30)
        check = stub.CheckIntegrity(node_pb2.CheckIntegrityRequest(), timeout=30)
        if load.running_requests == 0 and load.queued_requests == 0 and check.used_pages == 0:
            return check
        time.sleep(0.1)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir
) -> Iterator[RunningCluster]:
    backend = "mooncake"
    log = tmp_path_factory.mktemp(f"gateway-{backend}") / "pd-cluster.log"
    gateway_args = ["--local-prefill-max-tokens", "0", "--api-key", API_KEY]
    gateway_args += ["--max-inflight", str(MAX_INFLIGHT), "--max-body-bytes", str(MAX_BODY)]
    with pd_cluster_process(log, default_model_dir, backend, gateway_args=gateway_args) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model_name(default_model_dir: Path) -> str:
    return default_model_dir.name


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def _chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def hf_texts(default_model_dir: Path, tokenizer) -> dict[str, list[str]]:
    """HF transformers' greedy text for CHATS and PROMPTS, cut at EOS like the server."""
    chat_ids = [_chat_ids(tokenizer, m) for m in CHATS]
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    outs = hf_greedy(default_model_dir, chat_ids + prompt_ids, MAX_TOKENS)
    texts = [
        tokenizer.decode(_until_eos(o, tokenizer.eos_token_id), skip_special_tokens=True)
        for o in outs
    ]
    return {"chat": texts[: len(CHATS)], "completion": texts[len(CHATS) :]}


# -- OpenAI semantics -------------------------------------------------------------------------


def test_chat_greedy_equals_hf(client, model_name, hf_texts, tokenizer) -> None:
    for messages, expected in zip(CHATS, hf_texts["chat"], strict=True):
        out = client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        choice = out.choices[0]
        assert choice.message.role == "assistant"
        assert choice.message.content == expected
        assert out.usage.prompt_tokens == len(_chat_ids(tokenizer, messages))
        assert 0 < out.usage.completion_tokens <= MAX_TOKENS
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        expected_reason = "length" if out.usage.completion_tokens == MAX_TOKENS else "stop"
        assert choice.finish_reason == expected_reason


def test_completion_greedy_equals_hf(client, model_name, hf_texts, tokenizer) -> None:
    for prompt, expected in zip(PROMPTS, hf_texts["completion"], strict=True):
        out = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert out.choices[0].text == expected
        assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))


def test_streaming_concatenates_to_non_streaming(client, model_name) -> None:
    args = dict(model=model_name, messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0)
    whole = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    cargs = dict(model=model_name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    whole_c = client.completions.create(**cargs)
    pieces = [c.choices[0].text for c in client.completions.create(**cargs, stream=True)]
    assert "".join(pieces) == whole_c.choices[0].text
    assert len(pieces) > 2  # really streamed, token by token


def test_stop_strings_are_trimmed(client, model_name) -> None:
    args = dict(model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    full = client.completions.create(**args).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = full[: full.find(stop)]
    for stops in (stop, [stop, "never-in-the-text"]):
        out = client.completions.create(**args, stop=stops)
        assert out.choices[0].text == cut
        assert out.choices[0].finish_reason == "stop"
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(**args, stop=stops, stream=True)
        )
        assert streamed == cut


def test_n_choices_each_own_room_and_seed_reproducible(cluster, client, model_name) -> None:
    before = cluster.metric("pdserve_gateway_node_requests_total", role="prefill")
    args = dict(model=model_name, messages=CHATS[1], max_tokens=8, temperature=1.0, seed=1234)
    args["extra_body"] = {"ignore_eos": True}
    first = client.chat.completions.create(**args, n=2)
    again = client.chat.completions.create(**args, n=2)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 2 * 8
    # Each choice was its own request (own room) on the prefill node.
    assert cluster.metric("pdserve_gateway_node_requests_total", role="prefill") == before + 4
    streamed = client.chat.completions.create(**args, n=2, stream=True)
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in first.choices]


def test_chat_logprobs(client, model_name) -> None:
    out = client.chat.completions.create(
        model=model_name,
        messages=CHATS[0],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
    # Greedy: every token is its step's top-1, the first (sampled on the prefill node) too.
    for entry in content:
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_completion_logprobs(client, model_name) -> None:
    out = client.completions.create(
        model=model_name, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_echo_and_native_generate(cluster, client, model_name, tokenizer) -> None:
    out = client.completions.create(
        model=model_name, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True
    )
    plain = client.completions.create(
        model=model_name, prompt=PROMPTS[0], max_tokens=4, temperature=0
    )
    assert out.choices[0].text == PROMPTS[0] + plain.choices[0].text

    headers = {"Authorization": f"Bearer {API_KEY}"}
    ids = tokenizer.encode(PROMPTS[0])
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    native = httpx.post(cluster.url + "/generate", json=body, headers=headers, timeout=120).json()
    assert native["text"] == plain.choices[0].text
    assert native["meta_info"]["prompt_tokens"] == len(ids)
    body = {
        "text": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "stream": True,
    }
    with httpx.stream(
        "POST", cluster.url + "/generate", json=body, headers=headers, timeout=120
    ) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["text"] for e in events[:-1]) == plain.choices[0].text


def test_models_health_metrics(cluster, client, model_name) -> None:
    assert [m.id for m in client.models.list().data] == [model_name]
    health = httpx.get(cluster.url + "/health").json()
    assert health["prefill"] == 1 and health["decode"] == 1
    client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=2)
    assert cluster.metric("pdserve_gateway_completion_tokens_total") > 0
    assert cluster.metric("pdserve_gateway_local_prefills_total") == 0  # all went through P


# -- admission, keys, disconnects -------------------------------------------------------------


def test_api_key_required(cluster, model_name) -> None:
    bad = openai.OpenAI(base_url=cluster.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"


def _open_stream(url: str, model_name: str) -> tuple[httpx.Client, httpx.Response, Iterator[str]]:
    """A streaming request that would run long; returns once its first token arrived."""
    http = httpx.Client(timeout=120, headers={"Authorization": f"Bearer {API_KEY}"})
    body = {
        "model": model_name,
        "prompt": PROMPTS[0],
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    response = http.send(
        http.build_request("POST", url + "/v1/completions", json=body), stream=True
    )
    assert response.status_code == 200
    lines = response.iter_lines()
    while not next(lines).startswith("data: "):
        pass
    return http, response, lines  # closing `lines` would close the response


def test_disconnect_aborts_on_both_nodes_and_inflight_limit(cluster, client, model_name) -> None:
    streams = [_open_stream(cluster.url, model_name) for _ in range(MAX_INFLIGHT)]
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=model_name, prompt="hi", max_tokens=1)
    assert info.value.status_code == 429
    assert info.value.response.headers["retry-after"] == "1"
    decode = node_stub(cluster.node_address("decode-0"))
    assert decode.GetLoad(node_pb2.GetLoadRequest(), timeout=30).running_requests >= 1
    for http, response, _ in streams:
        response.close()
        http.close()
    for name in ("decode-0", "prefill-0"):
        check = wait_idle(node_stub(cluster.node_address(name)))
        assert check.ok, check.error
    while httpx.get(cluster.url + "/health").json()["inflight"]:
        time.sleep(0.05)
    out = client.completions.create(model=model_name, prompt="hi", max_tokens=1)
    assert out.choices[0].finish_reason in ("stop", "length")


# -- bad input --------------------------------------------------------------------------------


def _post(cluster: RunningCluster, path: str, content: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    return httpx.post(cluster.url + path, content=content, headers=headers, timeout=60)


def _assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_bad_input_gets_4xx_and_server_keeps_serving(cluster, client, model_name) -> None:
    def chat(**fields) -> httpx.Response:
        body = {"model": model_name, "messages": CHATS[0], **fields}
        return _post(cluster, "/v1/chat/completions", json.dumps(body).encode())

    _assert_openai_error(_post(cluster, "/v1/chat/completions", b'{"model": "x", '), 400)
    _assert_openai_error(_post(cluster, "/v1/chat/completions", b"[1, 2]"), 400)
    _assert_openai_error(chat(temperature="hot"), 400, "temperature")
    _assert_openai_error(chat(max_tokens="ten"), 400, "max_tokens")
    _assert_openai_error(chat(stream="yes"), 400, "stream")
    _assert_openai_error(chat(messages="hello"), 400, "messages")
    _assert_openai_error(chat(messages=[{"role": "user"}]), 400, "messages[0].content")
    _assert_openai_error(chat(messages=None), 400, "messages")
    _assert_openai_error(chat(temperature=-0.5), 400, "temperature")
    _assert_openai_error(chat(top_p=0), 400, "top_p")
    _assert_openai_error(chat(n=0), 400, "n")
    _assert_openai_error(chat(model="gpt-4"), 404, "model")
    over = chat(max_tokens=1_000_000)
    _assert_openai_error(over, 400, "max_tokens")
    assert over.json()["error"]["code"] == "context_length_exceeded"
    assert "8192" in over.json()["error"]["message"]  # names the limit
    huge = chat(messages=[{"role": "user", "content": "x" * (2 * MAX_BODY)}])
    _assert_openai_error(huge, 413)
    assert str(MAX_BODY) in huge.json()["error"]["message"]
    completion = {"model": model_name, "prompt": [], "max_tokens": 2}
    _assert_openai_error(
        _post(cluster, "/v1/completions", json.dumps(completion).encode()), 400, "prompt"
    )
    _assert_openai_error(_post(cluster, "/v1/nothing", b"{}"), 404)

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=CHATS[0], temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="unknown-model", messages=CHATS[0])

    out = client.chat.completions.create(model=model_name, messages=CHATS[0], max_tokens=2)
    assert out.choices[0].message.content
    assert _healthy(cluster.url)


def test_concurrent_requests(client, model_name) -> None:
    results: list[str] = []

    def ask(prompt: str) -> None:
        out = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=4, temperature=0
        )
        results.append(out.choices[0].text)

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == len(PROMPTS)


# -- first contact: the README's examples and a clean start ----------------------------------

README = Path(__file__).resolve().parent.parent / "README.md"
# glog's E/F lines and our own ERROR/CRITICAL records, as pd-cluster prefixes them
ERROR_LINE = re.compile(r"^\[[\w-]+\] (?:[EF]\d{4} |\S+ (?:ERROR|CRITICAL) )", re.MULTILINE)


def readme_curls() -> list[list[str]]:
    """The README's curl commands (the block after "With curl"), as argv lists."""
    block = README.read_text().split("With curl", 1)[1].split("```")[1]
    commands: list[list[str]] = []
    for word in shlex.split(block.replace("\\\n", " ")):
        if word == "curl":
            commands.append([])
        commands[-1].append(word)
    return commands


def test_a_clean_start_logs_no_error_lines(cluster) -> None:
    start = cluster.log().split("[pd-cluster] ready:", 1)[0]
    assert not ERROR_LINE.findall(start), ERROR_LINE.findall(start)
    assert "generation defaults from" in start and "temperature=0.2" in start


def test_the_readme_curl_examples_answer_within_their_limits(cluster, model_name) -> None:
    commands = readme_curls()
    assert len(commands) == 2
    for argv in commands:
        argv = [a.replace("http://127.0.0.1:41234", cluster.url) for a in argv]
        argv += ["-sS", "--max-time", "120", "-H", f"Authorization: Bearer {API_KEY}"]
        body = json.loads(argv[argv.index("-d") + 1])
        assert body["model"] == model_name
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        if body.get("stream"):
            events = [json.loads(line[6:]) for line in out.splitlines() if line[6:7] == "{"]
            assert out.rstrip().endswith("data: [DONE]")
            texts = [e["choices"][0]["text"] for e in events if e["choices"][0]["text"]]
            assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
            assert 0 < len(texts) <= body.get("max_tokens", 16)  # OpenAI's default: 16
        else:
            answer = json.loads(out)
            assert answer["choices"][0]["finish_reason"] in ("stop", "length"), answer
            limit = body.get("max_tokens", 1024)  # the gateway's default for chat: 1,024
            assert answer["usage"]["completion_tokens"] <= limit, answer["usage"]


def test_models_show_the_defaults_a_request_gets(client, model_name) -> None:
    (card,) = [m.model_dump() for m in client.models.list().data]
    assert card["id"] == model_name
    assert card["generation_defaults"] == {"temperature": 0.2, "top_p": 0.9}
    assert card["default_max_tokens"] == {"chat": 1024, "completions": 16}
