"""Hostile input against a real cluster (issue 8, item 5).

- HTTP (marker `faults`, run by `make test-faults`): schemathesis reads the gateway's own
  `GET /openapi.json` and sends well over 1,000 generated requests (schema-conforming and
  schema-violating bodies, for every route) to a real `pd-cluster` (tiny random-weight model
  with the real tokenizer; a short context keeps each generation small). No answer may be a
  5xx, every error (and every error event inside an SSE stream) has OpenAI's error shape, no
  process dies, and afterwards a real request succeeds and neither node holds a page.
- gRPC: to every method of the bootstrap, prefill and decode servers, requests with valid gRPC
  framing but bytes that are not a protobuf message (answered INVALID_ARGUMENT, naming the
  method) and seeded random payloads (any answer but a crash); then random bytes, a bogus HTTP/2
  stream and idle half-open connections on the raw TCP ports. Every process keeps serving.
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation import GenerationMode

from proto import bootstrap_pb2, node_pb2
from scripts.tiny_models import tiny_chat_model
from tests.hardening import assert_openai_error, cluster_process
from tests.test_gateway import RunningCluster, node_stub, wait_idle

API_KEY = "fuzz-key"
CONTEXT = 24  # prompt + completion tokens: generated requests stay cheap
EXAMPLES_PER_MODE = 170  # per POST route and generation mode: 3 x 2 x 170 = 1,020 requests
GET_EXAMPLES = 15
NOT_PROTOBUF = [b"\x0f", b"\x0a\xff\x01", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"]
RANDOM_PAYLOADS = 25  # per gRPC method
RPC_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def cluster(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("hostile")
    model = tiny_chat_model(default_model_dir, tmp / "model")
    gateway_args = ["--api-key", API_KEY, "--context-length", str(CONTEXT), "--max-n", "2"]
    gateway_args += ["--local-prefill-max-tokens", "8", "--max-inflight", "64"]
    with cluster_process(tmp / "pd-cluster.log", model, gateway_args=gateway_args) as running:
        yield running


def _real_request_succeeds(cluster: RunningCluster) -> None:
    body = {"model": "model", "prompt": "Tell me a story about a dragon", "max_tokens": 4}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(cluster.url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    for name in ("prefill-0", "decode-0"):
        check = wait_idle(node_stub(cluster.node_address(name)))
        assert check.ok and check.used_pages == 0, (name, check)


def _all_alive(cluster: RunningCluster) -> None:
    assert cluster.process.poll() is None, cluster.log()[-3000:]
    for name in ("bootstrap", "prefill-0", "decode-0", "gateway"):
        assert Path(f"/proc/{cluster.child_pid(name)}").exists(), name


# -- HTTP: schemathesis ------------------------------------------------------------------------


def _check_answer(status: int, content_type: str, text: str) -> None:
    assert status < 500, f"{status}: {text[:500]}"
    if status >= 400:
        assert_openai_error(status, json.loads(text))
    elif content_type.startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    assert_openai_error(200, event)


def _fuzz(strategy: Any, examples: int, label: str, url: str, sent: dict, statuses: dict) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}

    @given(case=strategy)
    @settings(
        max_examples=examples,
        phases=[Phase.generate],  # report the first failure as it was sent
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def send(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, headers=headers, timeout=60)
        sent[label] = sent.get(label, 0) + 1
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        content_type = response.headers.get("content-type") or [""]  # header -> values
        try:
            _check_answer(response.status_code, content_type[0], response.text)
        except AssertionError as exc:
            body = getattr(case, "body", None)
            raise AssertionError(f"{label}: body {body!r:.800} -> {exc}") from None

    send()


@pytest.mark.faults  # ~2 min of requests on 2 cores: in `make test-faults`, not `make test`
def test_schemathesis_against_openapi(cluster: RunningCluster) -> None:
    schema = schemathesis.openapi.from_url(cluster.url + "/openapi.json")
    sent: dict[str, int] = {}
    statuses: dict[int, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        post = operation.method.upper() == "POST"
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if post else [None]
        for mode in modes:
            strategy = operation.as_strategy(mode) if mode else operation.as_strategy()
            label = f"{operation.method.upper()} {operation.path} {mode or ''}".strip()
            examples = EXAMPLES_PER_MODE if post else GET_EXAMPLES
            _fuzz(strategy, examples, label, cluster.url, sent, statuses)
    print(f"schemathesis: {sum(sent.values())} requests {sent}; statuses {statuses}")
    assert sum(sent.values()) >= 1000, sent
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses  # both kinds ran
    _all_alive(cluster)
    _real_request_succeeds(cluster)


# -- gRPC: malformed messages and raw bytes --------------------------------------------------


def _methods(name: str) -> list[tuple[str, bool]]:
    """(path, server-streaming) of every method of the node or bootstrap service."""
    module = bootstrap_pb2 if name == "bootstrap" else node_pb2
    service = module.DESCRIPTOR.services_by_name["Bootstrap" if name == "bootstrap" else "Node"]
    return [(f"/{service.full_name}/{m.name}", m.server_streaming) for m in service.methods]


def _call_raw(channel: grpc.Channel, path: str, streaming: bool, payload: bytes) -> grpc.StatusCode:
    try:
        if streaming:
            for _ in channel.unary_stream(path)(payload, timeout=RPC_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(path)(payload, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_malformed_grpc_messages(cluster: RunningCluster) -> None:
    rng = random.Random(8)
    codes: dict[str, int] = {}
    for name in ("bootstrap", "prefill-0", "decode-0"):
        with grpc.insecure_channel(cluster.node_address(name)) as channel:
            for path, streaming in _methods(name):
                for payload in NOT_PROTOBUF:
                    try:
                        if streaming:
                            list(channel.unary_stream(path)(payload, timeout=RPC_TIMEOUT_S))
                        else:
                            channel.unary_unary(path)(payload, timeout=RPC_TIMEOUT_S)
                    except grpc.RpcError as exc:
                        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, exc)
                        assert path in (exc.details() or "") and "protobuf" in exc.details()
                    else:
                        raise AssertionError(f"{name} {path} accepted {payload!r}")
                for _ in range(RANDOM_PAYLOADS):
                    payload = rng.randbytes(rng.randint(0, 64))
                    code = _call_raw(channel, path, streaming, payload)
                    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (
                        name,
                        path,
                        payload,
                        code,
                    )
                    codes[code.name] = codes.get(code.name, 0) + 1
    print(f"random protobuf payloads answered: {codes}")
    _all_alive(cluster)
    _real_request_succeeds(cluster)


def _raw(address: str, payload: bytes) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        try:
            sock.sendall(payload)
            sock.settimeout(1.0)
            sock.recv(4096)  # whatever the server answers before it hangs up
        except OSError:
            pass  # reset by the server: fine


def test_random_bytes_on_grpc_ports(cluster: RunningCluster) -> None:
    rng = random.Random(5)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    idle: list[socket.socket] = []
    try:
        for name in ("bootstrap", "prefill-0", "decode-0"):
            address = cluster.node_address(name)
            host, port = address.rsplit(":", 1)
            for size in (1, 100, 65536):
                _raw(address, rng.randbytes(size))
            _raw(address, preface + rng.randbytes(2048))  # HTTP/2, then garbage frames
            _raw(address, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            _raw(address, b"")
            for _ in range(5):  # half-open connections left idle during the real request
                sock = socket.create_connection((host, int(port)), timeout=5)
                sock.sendall(preface[:10])
                idle.append(sock)
        time.sleep(0.5)
        _all_alive(cluster)
        _real_request_succeeds(cluster)
    finally:
        for sock in idle:
            sock.close()
