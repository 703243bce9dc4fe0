"""`gateway-server --workers N` and `--stream-interval K` on a real `pd-cluster` (tiny random-weight
llama with the default model's tokenizer, 1 prefill + 1 decode node, Mooncake over loopback).

- `pd-cluster --gateway-workers 2`: both workers answer on the one port (each request on a
  fresh connection lands on either), both serve completions through the bootstrap-discovered
  nodes, and /metrics from either worker reports the totals over both;
- `--stream-interval 5` (the cluster's gateway) against a second gateway-server on the same
  bootstrap with interval 1: the streamed text, token ids, finish reasons and stop-string
  trimming are the same, in fewer chunks;
- each worker feeds its own prefix index from every node's KV events;
- `--worker-listen shared` (one listener for all workers) streams what one worker streams;
- /health passes only once every worker serves (the supervisor's gate); the per-worker series
  (`pdserve_gateway_worker_*`: connections, tokens, node messages and their deltas) count
  each worker's share;
- a worker killed with SIGKILL is reported and replaced (on its predecessor's CPU with
  `--worker-cpus`); killing the supervisor takes its workers down;
- `pd-cluster --gateway-worker-cpus A,B`: worker 0 runs on CPU A and worker 1 on B, every
  thread of each (`/proc/<pid>/task/*/status`, Cpus_allowed_list); a one-process gateway with
  `--worker-cpus` runs on the list's first CPU;
- bad `--workers`, `--stream-interval`, `--worker-cpus`, `--gateway-workers` and
  `--gateway-worker-cpus` values exit with code 2 and a message that names the flag and its
  range.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from engine.ports import free_port
from gateway.api.app import Gateway
from gateway.config import GatewayConfig, ModelInfo
from gateway.process.launcher import console_script, session_pids
from gateway.requests.text import TextCodec
from tests.test_gateway import RunningCluster, launched_cluster
from tests.test_gateway_units import LIMITS, ROUTING

INTERVAL = 5
GATEWAY_ARGS = ["--local-prefill-max-tokens", "0"]
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "def main():"]
MAX_TOKENS = 23  # not a multiple of INTERVAL: the last chunk is a partial one
WAIT_S = 120.0  # bound of every poll below (a failure, never a timing assertion)
# --worker-cpus for two workers: two CPUs this process may use (one shared on a 1-CPU host)
CPUS = (sorted(os.sched_getaffinity(0)) * 2)[:2]
CPU_LIST = ",".join(dict.fromkeys(str(cpu) for cpu in CPUS))  # worker i on CPUS[i]


@pytest.fixture(scope="module")
def cluster(
    tiny_text_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningCluster]:
    """pd-cluster whose gateway runs two workers and streams every INTERVAL tokens."""
    log = tmp_path_factory.mktemp("gateway-workers") / "pd-cluster.log"
    port = free_port()
    command = [console_script("pd-cluster"), "--model", str(tiny_text_model), "--port", str(port)]
    command += ["--max-total-tokens", "8192", "--gateway-workers", "2"]
    command += ["--gateway-worker-cpus", CPU_LIST]
    args = [*GATEWAY_ARGS, "--stream-interval", str(INTERVAL)]
    command += ["--gateway-args", " ".join(args)]
    with launched_cluster(command, port, log) as running:
        yield running


def _gateway(cluster: RunningCluster, model: Path, log: Path, *args: str) -> RunningCluster:
    """A gateway-server on the cluster's bootstrap, ready to route: both nodes discovered and,
    with --workers N, every worker serving (status ok: the supervisor opens its gate up to half
    a second after the last worker answers)."""
    port = free_port()
    command = [console_script("gateway-server"), "--bootstrap", cluster.node_address("bootstrap")]
    command += ["--model", str(model), "--port", str(port), *GATEWAY_ARGS, *args]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    gateway = RunningCluster(process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + WAIT_S
    ready = {"prefill": 1, "decode": 1, "status": "ok"}
    while not ready.items() <= _health(gateway.url).items():
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    return gateway


def _stop(gateway: RunningCluster) -> None:
    gateway.process.send_signal(signal.SIGTERM)
    gateway.process.wait(60)
    _session_empties(gateway)


def _session_empties(gateway: RunningCluster) -> None:
    """Every process of the gateway's session exits soon after the supervisor: its workers,
    and multiprocessing's resource tracker, which goes once it reads the supervisor's end of
    its pipe closed (a moment after the supervisor itself on a loaded host)."""
    deadline = time.monotonic() + WAIT_S
    while left := session_pids(gateway.process.pid):
        assert time.monotonic() < deadline, (left, gateway.log())
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(
    cluster: RunningCluster, tiny_text_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningCluster]:
    """One worker, interval 1: what every other configuration must stream."""
    log = tmp_path_factory.mktemp("gateway-reference") / "gateway.log"
    gateway = _gateway(cluster, tiny_text_model, log)
    yield gateway
    _stop(gateway)


def _health(url: str) -> dict[str, object]:
    try:
        body = httpx.get(url + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _worker_pids(url: str, want: int) -> set[int]:
    """Worker pids seen answering /health, each on a fresh connection, until `want` are seen."""
    seen: set[int] = set()
    deadline = time.monotonic() + WAIT_S
    while len(seen) < want:
        assert time.monotonic() < deadline, f"only workers {seen} answered"
        pid = _health(url).get("pid")
        if isinstance(pid, int):
            seen.add(pid)
    return seen


def _workers_by_index(url: str, want: int) -> dict[int, int]:
    """Worker index -> pid, from /health answers (each on a fresh connection)."""
    found: dict[int, int] = {}
    deadline = time.monotonic() + WAIT_S
    while len(found) < want:
        assert time.monotonic() < deadline, f"only workers {found} answered"
        body = _health(url)
        if isinstance(body.get("worker"), int) and isinstance(body.get("pid"), int):
            found[int(body["worker"])] = int(body["pid"])  # type: ignore[call-overload]
    return found


def _cpus_of_threads(pid: int) -> set[str]:
    """The Cpus_allowed_list of every thread of a process (one value if they all agree)."""
    lists = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            for line in (task / "status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    lists.add(line.split(":", 1)[1].strip())
    return lists


def _model_name(url: str) -> str:
    return str(httpx.get(url + "/v1/models").json()["data"][0]["id"])


def _events(url: str, path: str, body: dict[str, object]) -> list[dict[str, object]]:
    """The JSON objects of one SSE answer, up to [DONE]."""
    events = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return events
            events.append(json.loads(line[len("data: ") :]))
    raise AssertionError("the stream ended without [DONE]")


def test_two_workers_serve_one_port_and_metrics_sum(cluster: RunningCluster) -> None:
    model = _model_name(cluster.url)
    served: dict[int, int] = {}
    deadline = time.monotonic() + WAIT_S
    while len(served) < 2 or sum(served.values()) < 6:
        assert time.monotonic() < deadline, f"completions served per worker: {served}"
        with httpx.Client(base_url=cluster.url, timeout=120) as client:  # one connection
            pid = client.get("/health").json()["pid"]
            answer = client.post(
                "/v1/completions",
                json={"model": model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0},
            )
            assert answer.status_code == 200, answer.text
            served[pid] = served.get(pid, 0) + 1
    total = sum(served.values())
    assert {_health(cluster.url).get("status") for _ in range(8)} == {"ok"}  # the gate is open
    for pid in served:  # each worker's /metrics, on a connection that reached it
        text = ""
        while not text:
            with httpx.Client(base_url=cluster.url, timeout=30) as client:
                if client.get("/health").json()["pid"] == pid:
                    text = client.get("/metrics").text
        requests = _sample(text, "pdserve_gateway_requests_total", 'endpoint="completions"')
        assert requests == total, (pid, served, text)
        assert _sample(text, "pdserve_gateway_completion_tokens_total") == 4 * total
        assert _sample(text, "pdserve_gateway_live_nodes", 'role="decode"') == 1
        assert _sample(text, "pdserve_gateway_time_to_first_token_seconds_count") == total
        for worker in ("0", "1"):  # both took connections, requests and node messages
            label = f'worker="{worker}"'
            assert _sample(text, "pdserve_gateway_worker_connections_total", label) >= 1, text
            assert _sample(text, "pdserve_gateway_worker_node_requests_total", label) >= 1, text
            batches = _sample(text, "pdserve_gateway_worker_node_batches_total", label)
            assert 1 <= batches <= _sample(text, "pdserve_gateway_worker_node_deltas_total", label)
        tokens = _sample(text, "pdserve_gateway_worker_completion_tokens_total")
        assert tokens == 4 * total, text  # the workers' shares add up to the total


def test_health_waits_until_every_worker_serves(default_model_dir: Path) -> None:
    """A worker whose peers are still starting answers /health 503 "starting" (load sent then
    would pile onto the workers that listen already); once the supervisor's gate opens, the
    usual checks decide (here: no node yet)."""
    routing = replace(ROUTING, prefill_policy="least_load", decode_policy="least_load")
    model = ModelInfo(str(default_model_dir), "m", 64)
    config = GatewayConfig("127.0.0.1", 1, "b:1", model, LIMITS, routing, workers=2)
    gate: list[bool] = [False]
    gateway = Gateway(config, TextCodec.load(default_model_dir), None, lambda: gate[0])
    answer = gateway.health()
    assert answer.status_code == 503
    assert json.loads(answer.body)["status"].startswith("starting"), answer.body
    gate[0] = True
    answer = gateway.health()
    assert answer.status_code == 503
    assert json.loads(answer.body)["status"] == "no decode node", answer.body


def _sample(text: str, name: str, *labels: str) -> float:
    """Sum of a metric's samples that carry every label."""
    total = 0.0
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(label in series for label in labels):
            total += float(value)
    return total


def _stream_text(url: str, path: str, body: dict[str, object]) -> tuple[list[str], str, int]:
    """(text pieces, finish reason, chunks) of a streamed completion or chat answer."""
    pieces, reason, chunks = [], "", 0
    for event in _events(url, path, body):
        for choice in event.get("choices", []):  # type: ignore[attr-defined]
            chunks += 1
            piece = choice.get("text", choice.get("delta", {}).get("content"))
            pieces.append(piece or "")
            reason = choice.get("finish_reason") or reason
    return pieces, reason, chunks


def test_every_worker_feeds_its_own_prefix_index(cluster: RunningCluster) -> None:
    """Each worker follows every node's KV events itself: one snapshot per (worker, node), and
    /metrics (summed over the workers) shows two of them per node."""
    snapshots = "pdserve_gateway_kv_event_resyncs_total"
    deadline = time.monotonic() + WAIT_S
    while cluster.metric(snapshots, kind="snapshot") < 4:  # 2 workers x (1 P + 1 D)
        assert time.monotonic() < deadline, cluster.log()[-3000:]
        time.sleep(0.2)
    assert cluster.metric(snapshots, kind="snapshot") == 4
    assert cluster.metric("pdserve_gateway_kv_event_errors_total") == 0


def test_shared_listener_workers_serve_the_same_tokens(
    cluster: RunningCluster,
    reference: RunningCluster,
    tiny_text_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`--worker-listen shared`: both workers accept from the supervisor's one listener and
    stream what one worker streams; the gate and the per-worker series hold as with reuseport."""
    log = tmp_path_factory.mktemp("gateway-shared") / "gateway.log"
    gateway = _gateway(cluster, tiny_text_model, log, "--workers", "2", "--worker-listen", "shared")
    try:
        assert len(_worker_pids(gateway.url, 2)) == 2  # each answered on a connection it took
        assert _health(gateway.url).get("status") == "ok"
        model = _model_name(gateway.url)
        body: dict[str, object] = {"model": model, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS}
        body.update(temperature=0, stream_options={"include_usage": True})
        shared = _stream_text(gateway.url, "/v1/completions", body)
        each = _stream_text(reference.url, "/v1/completions", body)
        assert "".join(shared[0]) == "".join(each[0]) and shared[1] == each[1], (shared, each)
        text = httpx.get(gateway.url + "/metrics", timeout=30).text
        assert _sample(text, "pdserve_gateway_worker_connections_total") >= 3, text
    finally:
        _stop(gateway)
    assert "one shared listener" in log.read_text()


@pytest.mark.parametrize("stop", [None, ["e"]], ids=["no-stop", "stop-string"])
def test_stream_interval_streams_what_interval_one_streams(
    cluster: RunningCluster, reference: RunningCluster, stop: list[str] | None
) -> None:
    model = _model_name(cluster.url)
    for prompt in PROMPTS:
        body: dict[str, object] = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS}
        body.update(temperature=0, stop=stop, stream_options={"include_usage": True})
        batched = _stream_text(cluster.url, "/v1/completions", body)
        each = _stream_text(reference.url, "/v1/completions", body)
        assert "".join(batched[0]) == "".join(each[0]), (prompt, batched, each)
        assert batched[1] == each[1]
        if stop is None:  # at most a chunk a token at interval 1; first + 4 of 5 + the last
            # (a loaded host may merge the tokens of a stream whose writer fell behind)
            assert each[2] <= MAX_TOKENS + 1
            assert batched[2] <= 1 + -(-(MAX_TOKENS - 1) // INTERVAL) + 1, batched
        chat = {"model": model, "messages": [{"role": "user", "content": prompt}]}
        chat.update(max_tokens=MAX_TOKENS, temperature=0, stop=stop)
        batched = _stream_text(cluster.url, "/v1/chat/completions", chat)
        each = _stream_text(reference.url, "/v1/chat/completions", chat)
        assert "".join(batched[0]) == "".join(each[0]), (prompt, batched, each)
        assert batched[1] == each[1]


def test_stream_interval_keeps_the_token_ids(
    cluster: RunningCluster, reference: RunningCluster
) -> None:
    for prompt in PROMPTS:
        for stop in ([], ["e"]):
            params = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "stop": stop}
            body = {"text": prompt, "sampling_params": params}
            results = []
            for url in (cluster.url, reference.url):
                events = _events(url, "/generate", body)
                ids = [i for e in events for i in e["output_ids"]]  # type: ignore[attr-defined]
                text = "".join(str(e["text"]) for e in events)
                end = events[-1]["meta_info"]
                results.append((ids, text, end["finish_reason"], end["matched"], len(events)))  # type: ignore[index]
                whole = httpx.post(url + "/generate", json=body, timeout=120).json()
                assert (whole["output_ids"], whole["text"]) == (ids, text)
            (ids, text, reason, matched, chunks), reference_result = results
            assert (ids, text, reason, matched) == reference_result[:4], (prompt, stop)
            assert chunks <= reference_result[4]


def test_a_killed_worker_is_replaced_and_workers_die_with_the_supervisor(
    cluster: RunningCluster, tiny_text_model: Path, tmp_path: Path
) -> None:
    log = tmp_path / "gateway.log"
    gateway = _gateway(cluster, tiny_text_model, log, "--workers", "2", "--worker-cpus", CPU_LIST)
    try:
        first = _worker_pids(gateway.url, 2)
        victim = min(first)
        index = {pid: i for i, pid in _workers_by_index(gateway.url, 2).items()}[victim]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while f"pid {victim}) exited with code -9: starting another" not in gateway.log():
            assert time.monotonic() < deadline, gateway.log()
            time.sleep(0.2)
        after = _worker_pids(gateway.url, 2)
        assert victim not in after and len(after & first) == 1, (first, after)
        successor = _workers_by_index(gateway.url, 2)[index]
        assert successor not in first
        assert _cpus_of_threads(successor) == {str(CPUS[index])}  # its predecessor's CPU
        gateway.process.send_signal(signal.SIGKILL)  # no chance to stop them itself
        gateway.process.wait(60)
        _session_empties(gateway)
    finally:
        if gateway.process.poll() is None:
            _stop(gateway)


def test_pd_cluster_pins_each_gateway_worker_to_its_cpu(cluster: RunningCluster) -> None:
    for index, pid in _workers_by_index(cluster.url, 2).items():
        status = Path(f"/proc/{pid}/status").read_text()
        assert f"Cpus_allowed_list:\t{CPUS[index]}\n" in status, (index, pid, status)
        assert _cpus_of_threads(pid) == {str(CPUS[index])}, (index, pid)  # every thread


def test_a_one_process_gateway_runs_on_the_lists_first_cpu(
    cluster: RunningCluster, tiny_text_model: Path, tmp_path: Path
) -> None:
    cpus = ",".join(dict.fromkeys(str(cpu) for cpu in reversed(CPUS)))  # CPUS[1] first
    gateway = _gateway(cluster, tiny_text_model, tmp_path / "gateway.log", "--worker-cpus", cpus)
    try:
        pid = _health(gateway.url)["pid"]
        assert pid == gateway.process.pid, gateway.log()  # no supervisor: the server itself
        assert _cpus_of_threads(pid) == {str(CPUS[1])}, gateway.log()
        assert f"pinned to CPU {CPUS[1]}" in gateway.log()
    finally:
        _stop(gateway)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--worker-cpus", "0-x", "--worker-cpus '0-x': '0-x' is not a CPU number or range"),
        ("--worker-cpus", "8191", "--worker-cpus: CPU 8191 is not one this process may run on"),
        ("--workers", "0", "--workers must be in [1, 256] processes, got 0"),
        ("--workers", "100000", "--workers must be in [1, 256] processes, got 100000"),
        ("--stream-interval", "0", "--stream-interval must be in [1, 4096] tokens, got 0"),
        ("--stream-interval", "-3", "--stream-interval must be in [1, 4096] tokens, got -3"),
    ],
)
def test_bad_gateway_flags_name_the_flag_and_range(
    tiny_text_model: Path, flag: str, value: str, message: str
) -> None:
    command = [console_script("gateway-server"), "--bootstrap", "127.0.0.1:1"]
    command += ["--model", str(tiny_text_model), flag, value]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_bad_gateway_workers_flag_of_pd_cluster() -> None:
    command = [console_script("pd-cluster"), "--gateway-workers", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--gateway-workers must be in [1, 256], got 0" in result.stderr


def test_bad_gateway_worker_cpus_flag_of_pd_cluster() -> None:
    command = [console_script("pd-cluster"), "--gateway-worker-cpus", "3-1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--gateway-worker-cpus '3-1': the range '3-1' runs backwards" in result.stderr


def test_a_taken_port_fails_the_supervisor_at_once(tiny_text_model: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [console_script("gateway-server"), "--bootstrap", "127.0.0.1:1"]
        command += ["--model", str(tiny_text_model), "--workers", "2", "--port", str(port)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr
