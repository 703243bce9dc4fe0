"""Multi-host: bootstrap, a prefill node, a decode node and the gateway each on a host of its own.

The hosts are network namespaces joined by veth links to a bridge (tests/netns_lab.py), each
with its own address in 10.231.<n>.0/24; every process binds and advertises that address, the
transfer engines move the KV over the links (Mooncake: tcp to the advertised host; NIXL: UCX
over tcp on the namespace's veth device, found from the address, with no shared-memory
transports: separate hosts share no memory); the nodes listen on 0.0.0.0 and advertise their
address with --advertise-host. The test process reaches the gateway and the
nodes' admin RPCs through the bridge. For each backend:

1. greedy requests through P and D equal HF transformers, the KV pages really crossed the link
   (P's transfer counters), every node registered its namespace address, no page in use after;
2. the decode host's link is cut (`ip link set <veth> down`) while two requests stream from it,
   the prefill node holds the pages of a long prompt it is prefilling for it, and a fourth
   request arrives: each of them ends with an error that names the decode node or says no
   decode node is left, within the bound the timeouts set (gateway keepalive, heartbeat and
   transfer timeouts); the prefill node frees every page;
3. the link comes back up: the decode node frees its pages (nothing leaked) and new requests
   succeed with the reference output; the time from `ip link set up` to the first success is
   printed (`-s` shows it).

Known, and checked as it is: with NIXL, P does not free the long prompt's pages while the link
is down. Its engine thread stops stepping (no step logged, its admin RPCs time out) once it
writes a chunk's pages to the unreachable host (a UCX tcp call that blocks), and it moves on
only when the link is back; then every page comes free (step 3). With Mooncake the writes
fail after about 30 s and P frees the pages with the link still down.

Skipped with the reason when not root or `ip netns` does not work.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from gateway.process.launcher import console_script
from proto import bootstrap_pb2, bootstrap_pb2_grpc, node_pb2, node_pb2_grpc
from scripts.tiny_models import hf_greedy, save_tiny_text_model
from tests.netns_lab import Host, Lab, lab_unavailable, netns_lab, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.faults]  # ~2 min per backend: make test-faults

BOOTSTRAP_PORT, NODE_PORT, METRICS_PORT, GATEWAY_PORT = 8998, 30001, 9100, 8000
HEARTBEAT_TIMEOUT_S, HEARTBEAT_INTERVAL_S = 3.0, 0.5
TRANSFER_TIMEOUT_S = 10.0
KEEPALIVE_S = 2.0  # gateway -> node HTTP/2 pings: a silent peer is found within ~2x this
CUT_ERROR_BOUND_S = 2 * KEEPALIVE_S + HEARTBEAT_TIMEOUT_S + TRANSFER_TIMEOUT_S + 15.0
P_FREES_WITHIN_S = 45.0  # measured: Mooncake's writes to the cut host fail after ~30 s
MAX_NEW = 8
LONG_NEW = 4000  # streams for a while on the tiny model
PROMPT_LEN = 40
LONG_PROMPT = 6000  # in 16-token chunks: P prefills it for hundreds of steps
CHUNK = 16


@pytest.fixture(scope="module")
def model(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-multihost")
    return save_tiny_text_model(default_model_dir, path, positions=8192)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(8)
    return [[rng.randrange(1000, 10000) for _ in range(PROMPT_LEN)] for _ in range(3)]


@pytest.fixture(scope="module")
def reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(model, prompts, MAX_NEW)


@dataclass
class Fleet:
    lab: Lab
    logs: Path
    backend: str
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.hosts['gateway'].address}:{GATEWAY_PORT}"

    def node(self, role: str) -> node_pb2_grpc.NodeStub:
        address = f"{self.hosts[role].address}:{NODE_PORT}"
        return node_pb2_grpc.NodeStub(grpc.insecure_channel(address))

    def log_tails(self) -> str:
        parts = []
        for path in sorted(self.logs.glob("*.log")):
            tail = "\n".join(path.read_text(errors="replace").splitlines()[-25:])
            parts.append(f"--- {path.name}\n{tail}")
        return "\n".join(parts)

    def check_alive(self) -> None:
        for host in self.hosts.values():
            for process in host.processes:
                assert process.poll() is None, f"{host.role} exited\n{self.log_tails()}"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}  # found per host
    env.update(
        MC_LOG_LEVEL="ERROR", UCX_TLS="tcp", PYTHONUNBUFFERED="1", UCX_KEEPALIVE_INTERVAL="2s"
    )
    return env


def start_fleet(lab: Lab, logs: Path, model: Path, backend: str) -> Fleet:
    fleet = Fleet(lab, logs, backend)
    for role in ("bootstrap", "prefill", "decode", "gateway"):
        fleet.hosts[role] = lab.add_host(role)
    bootstrap = f"{fleet.hosts['bootstrap'].address}:{BOOTSTRAP_PORT}"
    env = _env()
    command = [console_script("bootstrap-server"), "--host", fleet.hosts["bootstrap"].address]
    command += ["--port", str(BOOTSTRAP_PORT), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]
    command += ["--heartbeat-interval", str(HEARTBEAT_INTERVAL_S)]
    fleet.hosts["bootstrap"].spawn(command, logs / "bootstrap.log", env)
    node_args = ["--model", str(model), "--bootstrap", bootstrap, "--transfer-backend", backend]
    node_args += ["--max-total-tokens", "32768", "--port", str(NODE_PORT)]
    node_args += ["--transfer-timeout", str(TRANSFER_TIMEOUT_S)]
    node_args += ["--metrics-port", str(METRICS_PORT), "--chunked-prefill-size", str(CHUNK)]
    for role, extra in (("prefill", []), ("decode", ["--mode", "disaggregated"])):
        host = fleet.hosts[role]
        # Listening on every interface: the registered address must be the advertised one.
        listen = ["--host", "0.0.0.0", "--advertise-host", host.address]
        command = [console_script(f"{role}-server"), *extra, *node_args, *listen]
        host.spawn(command, logs / f"{role}.log", env)
    gateway = fleet.hosts["gateway"]
    command = [console_script("gateway-server"), "--host", gateway.address]
    command += ["--port", str(GATEWAY_PORT), "--bootstrap", bootstrap, "--model", str(model)]
    command += ["--local-prefill-max-tokens", "0", "--node-keepalive", str(KEEPALIVE_S)]
    gateway.spawn(command, logs / "gateway.log", env)
    deadline = time.monotonic() + 300
    while not _cluster_healthy(fleet.url):
        fleet.check_alive()
        assert time.monotonic() < deadline, f"not healthy in 300 s\n{fleet.log_tails()}"
        time.sleep(0.5)
    return fleet


def _cluster_healthy(url: str) -> bool:
    try:
        health = httpx.get(url + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    return bool(health.get("prefill") == 1 and health.get("decode") == 1)


@pytest.fixture(params=["mooncake", "nixl"])
def fleet(request: pytest.FixtureRequest, model: Path, tmp_path: Path) -> Iterator[Fleet]:
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    with netns_lab() as lab:
        yield start_fleet(lab, tmp_path, model, request.param)


# -- requests -----------------------------------------------------------------------------------


def generate(url: str, ids: list[int], max_new: int = MAX_NEW, timeout: float = 60) -> list[int]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(url + "/generate", json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    return list(response.json()["output_ids"])


def generate_all(url: str, prompts: list[list[int]]) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            outs[i] = generate(url, prompts[i])
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outs


@dataclass
class Outcome:
    """How one request ended, as the client saw it."""

    tokens: int = 0
    error: str = ""  # HTTP status and body, or the SSE error event's message
    ended_at: float = 0.0  # monotonic
    done: threading.Event = field(default_factory=threading.Event)


def stream(url: str, ids: list[int], max_new: int, outcome: Outcome) -> None:
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    try:
        with httpx.stream("POST", url + "/generate", json=body, timeout=120) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {response.read().decode()}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.error = str(event["error"].get("message", event["error"]))
                    return
                outcome.tokens = len(event.get("output_ids", [])) or outcome.tokens + 1
    except httpx.HTTPError as exc:
        outcome.error = f"client: {type(exc).__name__}: {exc}"
    finally:
        outcome.ended_at = time.monotonic()
        outcome.done.set()


def start_stream(url: str, ids: list[int], max_new: int) -> Outcome:
    outcome = Outcome()
    threading.Thread(target=stream, args=(url, ids, max_new, outcome), daemon=True).start()
    return outcome


# -- checks -------------------------------------------------------------------------------------


def wait_idle(stub: node_pb2_grpc.NodeStub, what: str, timeout: float) -> float:
    def idle() -> bool:
        try:
            load = stub.GetLoad(node_pb2.GetLoadRequest(), timeout=5)
            check = stub.CheckIntegrity(node_pb2.CheckIntegrityRequest(), timeout=5)
        except grpc.RpcError:
            return False
        assert check.ok, f"{what}: integrity check failed: {check.error}"
        return load.running_requests == load.queued_requests == check.used_pages == 0

    return wait_for(idle, f"{what} idle with no page in use", timeout)


def pages_in_use(stub: node_pb2_grpc.NodeStub) -> int:
    check = stub.CheckIntegrity(node_pb2.CheckIntegrityRequest(), timeout=5)
    return int(check.used_pages)


def registered_addresses(fleet: Fleet) -> dict[str, bootstrap_pb2.NodeInfo]:
    address = f"{fleet.hosts['bootstrap'].address}:{BOOTSTRAP_PORT}"
    with grpc.insecure_channel(address) as channel:
        stub = bootstrap_pb2_grpc.BootstrapStub(channel)
        nodes = stub.ListNodes(bootstrap_pb2.ListNodesRequest(), timeout=10).nodes
    return {bootstrap_pb2.Role.Name(n.node.role): n.node for n in nodes}


def prefill_pages_sent(fleet: Fleet) -> float:
    url = f"http://{fleet.hosts['prefill'].address}:{METRICS_PORT}/metrics"
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith("pdserve_prefill_transfer_pages_total "):
            return float(line.split()[1])
    raise AssertionError("prefill node exports no pdserve_prefill_transfer_pages_total")


# -- the tests ----------------------------------------------------------------------------------


def test_requests_cross_the_links_and_survive_a_cut(
    fleet: Fleet, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    backend = fleet.backend
    # 1. Requests across the links.
    nodes = registered_addresses(fleet)
    for role in ("PREFILL", "DECODE"):
        host = fleet.hosts[role.lower()]
        assert nodes[role].grpc_address == f"{host.address}:{NODE_PORT}", nodes[role]
        if nodes[role].transfer_backend == "mooncake":
            assert nodes[role].transfer_endpoint.decode().startswith(host.address + ":")
    assert generate_all(fleet.url, prompts) == reference
    assert prefill_pages_sent(fleet) >= len(prompts) * (PROMPT_LEN // 16)
    wait_idle(fleet.node("prefill"), "prefill", 30)
    wait_idle(fleet.node("decode"), "decode", 30)

    # 2. Cut the decode host's link while two requests stream from it and P prefills a third.
    streams = [start_stream(fleet.url, p, LONG_NEW) for p in prompts[:2]]
    wait_for(lambda: all(s.tokens > 0 or s.done.is_set() for s in streams), "streaming", 60)
    prefill = fleet.node("prefill")
    long_prompt = [1000 + i % 9000 for i in range(LONG_PROMPT)]
    in_prefill = start_stream(fleet.url, long_prompt, MAX_NEW)
    wait_for(lambda: pages_in_use(prefill) > 0, "P holds the long prompt's pages", 60, 0.02)
    assert all(not s.done.is_set() for s in streams), [s.error for s in streams]
    decode_id = nodes["DECODE"].node_id
    fleet.hosts["decode"].cut()
    cut_at = time.monotonic()
    late = start_stream(fleet.url, prompts[2], MAX_NEW)
    for outcome in [*streams, in_prefill, late]:
        assert outcome.done.wait(CUT_ERROR_BOUND_S + 5), "a request hung after the cut"
        assert outcome.error, f"a request on the cut decode node succeeded ({outcome.tokens})"
        assert outcome.ended_at - cut_at <= CUT_ERROR_BOUND_S, outcome
        clear = decode_id in outcome.error or "decode" in outcome.error.lower()
        assert clear, f"unclear error: {outcome.error}"
    errors_after = [round(o.ended_at - cut_at, 1) for o in [*streams, in_prefill, late]]
    within = P_FREES_WITHIN_S if backend != "nixl" else TRANSFER_TIMEOUT_S + 5
    try:
        freed: float | None = wait_idle(prefill, "prefill after the cut", within)
    except AssertionError:
        if backend != "nixl":
            raise
        freed = None  # known: see the module docstring; checked after the link is back
    fleet.check_alive()

    # 3. Mend the link: every page comes free, new requests succeed.
    fleet.hosts["decode"].mend()
    mended_at = time.monotonic()
    if freed is None:
        freed_after_mend = wait_idle(prefill, "prefill after the link came back", 90)
        freed = mended_at - cut_at + freed_after_mend

    def serves() -> bool:
        try:
            return generate(fleet.url, prompts[0], timeout=20) == reference[0]
        except (AssertionError, httpx.HTTPError):
            return False

    recovered = wait_for(serves, "a request after the link came back", 90, interval=0.5)
    wait_idle(fleet.node("decode"), "decode after the link came back", 60)
    assert generate_all(fleet.url, prompts) == reference
    wait_idle(fleet.node("prefill"), "prefill", 30)
    wait_idle(fleet.node("decode"), "decode", 30)
    print(
        f"\n[multihost {backend}] errors {errors_after} s after the cut; prefill idle "
        f"{freed:.1f} s after the cut; first success {recovered:.1f} s after the link came "
        f"back (mended at +{mended_at - cut_at:.1f} s)"
    )
