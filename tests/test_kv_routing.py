"""Cache-aware routing on a real 2P2D `pd-cluster` (tiny random-weight llama with the default
model's tokenizer, Mooncake over loopback), with the defaults: nodes publish KV events, the
gateway follows them into its prefix index and routes both sides with `kv_aware`.

- a multi-turn session stays on the decode node holding its history: turn 2 (a long new
  message) goes through a prefill node that sends only the pages that node lacks; turn 3 (a
  short one) is prefilled by the decode node itself; `cached_tokens` is exact in both, and the
  greedy outputs equal HF transformers on the full history;
- the gateway's index holds exactly the nodes' cached pages; a gateway started late catches up
  from snapshots;
- a decode node SIGKILLed is dropped from the index, and rebuilt when it comes back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from engine.ports import free_port
from gateway.process.launcher import console_script, node_registered, running_node
from proto import node_pb2, node_pb2_grpc
from scripts.tiny_models import hf_greedy
from tests.test_gateway import RunningCluster, pd_cluster_process
from tests.test_gateway_routing import per_node

PAGE = 16
LOCAL_MAX = 32
MAX_NEW = 6
SYSTEM = [(7 * k) % 5000 + 300 for k in range(64)]  # shared by every session
BLOCKS = "pdserve_gateway_kv_index_blocks"


@pytest.fixture(scope="module")
def cluster(
    tiny_text_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningCluster]:
    log = tmp_path_factory.mktemp("kv-routing") / "pd-cluster.log"
    args = ["--local-prefill-max-tokens", str(LOCAL_MAX)]
    with pd_cluster_process(log, tiny_text_model, "mooncake", 2, 2, gateway_args=args) as c:
        wait_synced(c.url, 4)
        yield c


def index_blocks(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith(BLOCKS + "{"):
            node = line.split('node_id="', 1)[1].split('"', 1)[0]
            out[node] = float(line.rsplit(" ", 1)[1])
    return out


def wait_synced(url: str, nodes: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(index_blocks(url)) < nodes:
        assert time.monotonic() < deadline, f"index of {url} never synced: {index_blocks(url)}"
        time.sleep(0.2)


def user_turn(session: int, turn: int, n: int) -> list[int]:
    return [(session * 131 + turn * 17 + k * 29) % 9000 + 1000 for k in range(n)]


def generate(url: str, ids: list[int]) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
    }
    response = httpx.post(url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def served_by(cluster: RunningCluster, ids: list[int]) -> tuple[dict, dict[str, str]]:
    """One request and the node of each role that took it (metrics deltas)."""
    requests = "pdserve_gateway_node_requests_total"
    before = {role: per_node(cluster, requests, role) for role in ("prefill", "decode")}
    out = generate(cluster.url, ids)
    nodes = {}
    for role in ("prefill", "decode"):
        after = per_node(cluster, requests, role)
        moved = [n for n in after if after[n] > before[role].get(n, 0)]
        assert len(moved) <= 1, moved
        nodes[role] = moved[0] if moved else ""
    return out, nodes


def cached_pages(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        return stub.CheckIntegrity(node_pb2.CheckIntegrityRequest(), timeout=30).cached_pages


def node_ids(cluster: RunningCluster) -> dict[str, str]:
    """Node id -> address, from each node's Health."""
    out = {}
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        address = cluster.node_address(name)
        with grpc.insecure_channel(address) as channel:
            health = node_pb2_grpc.NodeStub(channel).Health(node_pb2.HealthRequest(), timeout=10)
        out[health.node_id] = address
    return out


def test_a_session_follows_its_history_and_reports_exact_cached_tokens(
    cluster: RunningCluster, tiny_text_model: Path
) -> None:
    histories = []
    for session in range(4):
        prompt = SYSTEM + user_turn(session, 1, 40)  # 104 tokens: 6 full pages
        out, first = served_by(cluster, prompt)
        assert first["prefill"] and first["decode"]
        histories.append((prompt + out["output_ids"], first))
    local_before = cluster.metric("pdserve_gateway_local_prefills_total")
    for session, (history, first) in enumerate(histories):
        # Turn 2, 40 new tokens: more than D may prefill itself; D holds the history but
        # its last token, P the turn-1 prompt.
        turn2 = history + user_turn(session, 2, 40)
        out, nodes = served_by(cluster, turn2)
        assert nodes == first, (session, nodes, first)
        assert out["meta_info"]["cached_tokens"] == 96  # P's pages of the turn-1 prompt
        assert out["meta_info"]["cache_node"] == first["prefill"]
        assert out["output_ids"] == hf_greedy(tiny_text_model, [turn2], MAX_NEW)[0]
        # Turn 3, 8 new tokens: D lacks 8 + 1 tokens only, it prefills them itself.
        held = (len(turn2) + MAX_NEW - 1) // PAGE * PAGE
        turn3 = turn2 + out["output_ids"] + user_turn(session, 3, 8)
        out3, nodes3 = served_by(cluster, turn3)
        assert nodes3 == {"prefill": "", "decode": first["decode"]}, nodes3
        assert out3["meta_info"]["cached_tokens"] == held
        assert out3["meta_info"]["cache_node"] == first["decode"]
        if session == 0:
            assert out3["output_ids"] == hf_greedy(tiny_text_model, [turn3], MAX_NEW)[0]
    assert cluster.metric("pdserve_gateway_local_prefills_total") == local_before + 4
    # The same through the OpenAI API, streamed: the usage chunk carries cached_tokens.
    history, first = histories[0]
    turn2 = history + user_turn(0, 2, 40)
    stream = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none").completions.create(
        model=tiny_text_model.name,
        prompt=turn2,
        max_tokens=MAX_NEW,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usages = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens == len(turn2)
    details = usages[0].prompt_tokens_details
    # Turn 2 ran before: whichever node prefills it now holds its whole pages.
    assert details is not None and details.cached_tokens == len(turn2) // PAGE * PAGE
    assert cluster.metric("pdserve_gateway_kv_event_errors_total") == 0
    assert cluster.metric("pdserve_gateway_kv_event_gaps_total") == 0


def test_index_equals_the_caches_and_a_late_gateway_catches_up(
    cluster: RunningCluster, tiny_text_model: Path, tmp_path: Path
) -> None:
    for i in range(3):
        generate(cluster.url, SYSTEM + user_turn(50 + i, 1, 30))
    ids = node_ids(cluster)

    def matches(url: str) -> bool:
        blocks = index_blocks(url)
        return all(blocks.get(n) == cached_pages(a) for n, a in ids.items())

    deadline = time.monotonic() + 30
    while not matches(cluster.url):
        assert time.monotonic() < deadline, (index_blocks(cluster.url), ids)
        time.sleep(0.2)
    port = free_port()
    command = [console_script("gateway-server"), "--bootstrap", cluster.node_address("bootstrap")]
    command += ["--model", str(tiny_text_model), "--port", str(port)]
    log = tmp_path / "late-gateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    late = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()
            try:
                if matches(late):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert any(index_blocks(late).values())
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def test_a_killed_decode_node_leaves_the_index_and_is_rebuilt(
    cluster: RunningCluster, tiny_text_model: Path, tmp_path: Path
) -> None:
    bootstrap = cluster.node_address("bootstrap")
    args = ["--mode", "disaggregated", "--model", str(tiny_text_model), "--bootstrap", bootstrap]
    args += ["--transfer-backend", "mooncake", "--max-total-tokens", "8192"]
    args += ["--node-id", "decode-extra"]
    port = free_port()
    with running_node(
        "decode-server", args, tmp_path / "extra-1.log", probe=node_registered, port=port
    ) as extra:
        wait_synced(cluster.url, 5)
        # Only this node can hold a history of this session: route a turn to it.
        for i in range(6):
            generate(cluster.url, user_turn(90 + i, 1, 60))
            if index_blocks(cluster.url).get("decode-extra"):
                break
        assert index_blocks(cluster.url).get("decode-extra"), "no request reached the new node"
        os.kill(extra.process.pid, signal.SIGKILL)
        extra.process.wait(30)
        deadline = time.monotonic() + 30
        while index_blocks(cluster.url).get("decode-extra", 0) != 0:  # dropped on LEFT
            assert time.monotonic() < deadline
            time.sleep(0.2)
    snapshots = "pdserve_gateway_kv_event_resyncs_total"
    before = cluster.metric(snapshots, kind="snapshot")
    with running_node(
        "decode-server", args, tmp_path / "extra-2.log", probe=node_registered, port=port
    ):
        deadline = time.monotonic() + 30
        while True:  # the restarted node's feed synced: tracked again, with an empty cache
            if cluster.metric(snapshots, kind="snapshot") > before:
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        out = generate(cluster.url, user_turn(99, 1, 60))
        assert len(out["output_ids"]) == MAX_NEW
