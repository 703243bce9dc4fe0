"""Restarts and gateway losses under streamed load, through `pd-cluster --gateways 2` (issue 19).

A real `pd-cluster` (bootstrap, one prefill node, two decode nodes, two gateways on the one
bootstrap; the tiny random-weight llama with the default model's tokenizer) serves streamed
greedy requests from a few client threads while, in turn:

- **gateway SIGTERM**: one of the two gateways drains (its streams finish, its new requests get
  503) and exits;
- **rolling restart** (SIGHUP to pd-cluster): every process gets SIGTERM, drains and is started
  again on its ports, one at a time, the bootstrap included (and the gateway stopped before);
- **gateway SIGKILL**: one of the two gateways dies with its streams (only those fail).

The clients behave like a load balancer with two backends: a request refused before its stream
started (connection refused, 503) goes to the other gateway. Each row of the faults table says
how many requests were sent, how many got exactly the reference text, and how many failed; the
goals are 0 failed for the restart and the SIGTERM, and for the SIGKILL no failure beyond the
streams the killed gateway held. Every decode node ends with no page in use. Marked `faults`
(`make test-faults`); the table is written to `fault-table-rolling.md` in the pytest temp dir.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine.ports import free_port
from gateway.process.launcher import console_script
from proto import node_pb2
from tests.fault_cluster import prompts
from tests.test_gateway import RunningCluster, launched_cluster, node_stub

pytestmark = pytest.mark.faults

BACKENDS = ["mooncake", "nixl"]
MAX_TOKENS = 48
PROMPTS = prompts(count=8, length=48, seed=21)
CLIENTS = 3  # threads, each one request after another
WARMUP_S = 2.0
AFTER_S = 3.0


@dataclass
class Outcome:
    prompt: int
    gateway: int  # index of the gateway that took it
    text: str = ""
    error: str = ""
    started: bool = False  # its stream sent at least one chunk


@dataclass
class Row:
    fault: str
    backend: str
    sent: int
    correct: int
    failed: int
    note: str = ""


def one_request(urls: list[str], first: int, prompt: int, model: str) -> Outcome:
    """Stream one request, going to the other gateway when one refuses it before its stream."""
    payload = {
        "model": model,
        "prompt": list(PROMPTS[prompt]),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    outcome = Outcome(prompt, first)
    for attempt in range(6):
        outcome.gateway = (first + attempt) % len(urls)
        try:
            with httpx.stream(
                "POST", urls[outcome.gateway] + "/v1/completions", json=payload, timeout=120
            ) as response:
                if response.status_code == 503:
                    time.sleep(0.2)
                    continue
                if response.status_code != 200:
                    outcome.error = f"http {response.status_code}: {response.read()[:200]!r}"
                    return outcome
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome.error = f"stream error: {event['error']['message']}"
                        return outcome
                    outcome.started = True
                    outcome.text += "".join(c.get("text") or "" for c in event["choices"])
                return outcome
        except httpx.ConnectError:
            time.sleep(0.2)
        except httpx.HTTPError as exc:
            if outcome.started:
                outcome.error = f"read error: {exc!r}"
                return outcome
            time.sleep(0.2)
    outcome.error = "no gateway took the request"
    return outcome


class Load:
    """`CLIENTS` threads streaming requests through the gateways until `stop()`."""

    def __init__(self, urls: list[str], model: str) -> None:
        self.urls, self.model = urls, model
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)
            assert not thread.is_alive(), "a client did not end"
        return self.outcomes

    def _client(self, index: int) -> None:
        number = index
        while not self._stop.is_set():
            prompt = number % len(PROMPTS)
            self.outcomes.append(
                one_request(self.urls, number % len(self.urls), prompt, self.model)
            )
            number += CLIENTS


@dataclass
class Cluster:
    running: RunningCluster
    urls: list[str]
    model: str
    backend: str

    def child_pid(self, name: str) -> int:
        return self.running.child_pid(name)

    def decode_addresses(self) -> list[str]:
        """The decode nodes' addresses from their latest start lines."""
        log = self.running.log()
        return [re.findall(rf"starting decode-{i}: .* --port (\d+)", log)[-1] for i in (0, 1)]

    def pages_in_use(self) -> dict[str, int]:
        used = {}
        for port in self.decode_addresses():
            stub = node_stub(f"127.0.0.1:{port}")
            deadline = time.monotonic() + 60
            while True:
                check = stub.CheckIntegrity(node_pb2.CheckIntegrityRequest(), timeout=30)
                assert check.ok, check.error
                if check.used_pages == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            used[port] = check.used_pages
        return used


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Row]]:
    rows: list[Row] = []
    yield rows
    lines = ["| fault | backend | sent | correct | failed | note |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {r.fault} | {r.backend} | {r.sent} | {r.correct} | {r.failed} | {r.note} |"
        for r in rows
    ]
    text = "\n".join(lines) + "\n"
    (tmp_path_factory.getbasetemp() / "fault-table-rolling.md").write_text(text)
    print("\n" + text)


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(
    request: pytest.FixtureRequest,
    tiny_text_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    backend: str = request.param
    tmp = tmp_path_factory.mktemp(f"rolling-{backend}")
    port = free_port()
    command = [console_script("pd-cluster"), "--model", str(tiny_text_model), "--port", str(port)]
    command += ["--prefill", "1", "--decode", "2", "--gateways", "2"]
    command += ["--transfer-backend", backend, "--max-total-tokens", "8192"]
    command += ["--gateway-args", "--local-prefill-max-tokens 0 --drain-timeout 60"]
    # A room in transfer while the bootstrap restarts is forgotten: the decode node fails it and
    # keeps its pages quarantined until --transfer-timeout (P may still write). 30 s instead of
    # the default 300 s lets `pages_in_use` (60 s of polling) see them freed.
    command += ["--node-args", "--transfer-timeout 30"]
    command += ["--log-dir", str(tmp / "logs")]
    with launched_cluster(command, port, tmp / "pd-cluster.log") as running:
        urls = re.findall(r"\[pd-cluster\] gateway gateway-\d (http://\S+)", running.log())
        assert len(urls) == 2 and urls[0] == running.url, running.log()[-2000:]
        yield Cluster(running, urls, tiny_text_model.name, backend)


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> list[str]:
    texts = []
    for prompt in range(len(PROMPTS)):
        outcome = one_request(cluster.urls, prompt % 2, prompt, cluster.model)
        assert not outcome.error, outcome.error
        texts.append(outcome.text)
    return texts


def judge(
    outcomes: list[Outcome],
    reference: list[str],
    table: list[Row],
    fault: str,
    backend: str,
    note: str,
) -> list[Outcome]:
    """Adds the run's row to the table and returns the failed outcomes; a wrong text fails."""
    correct = [o for o in outcomes if not o.error and o.text == reference[o.prompt]]
    wrong = [o for o in outcomes if not o.error and o.text != reference[o.prompt]]
    assert not wrong, f"wrong text: {wrong[:3]}"
    failed = [o for o in outcomes if o.error]
    table.append(Row(fault, backend, len(outcomes), len(correct), len(failed), note))
    return failed


def kill_gateway_under_load(cluster: Cluster, sig: signal.Signals, after_s: float) -> list[Outcome]:
    """Steady load; `sig` to gateway-1 once it warmed up; the outcomes `after_s` later."""
    with Load(cluster.urls, cluster.model) as load:
        time.sleep(WARMUP_S)
        os.kill(cluster.child_pid("gateway-1"), sig)
        time.sleep(after_s)
        return load.stop()


def test_gateway_sigterm_fails_nothing(
    cluster: Cluster, reference: list[str], table: list[Row]
) -> None:
    """SIGTERM gateway-1: its streams finish, its new requests go to gateway-0 (pd-cluster
    serves on; the rolling restart that follows starts gateway-1 again)."""
    outcomes = kill_gateway_under_load(cluster, signal.SIGTERM, AFTER_S + 2)
    note = "its streams finish; its new requests go to the other"
    failed = judge(
        outcomes, reference, table, "SIGTERM of one of two gateways", cluster.backend, note
    )
    assert not failed, f"failed: {[o.error for o in failed[:3]]}"


def test_rolling_restart_fails_nothing(
    cluster: Cluster, reference: list[str], table: list[Row]
) -> None:
    """SIGHUP: every process restarted one at a time (gateway-1, gone since the test before,
    comes back in its turn)."""
    log_before = cluster.running.log().count("rolling restart done")
    with Load(cluster.urls, cluster.model) as load:
        time.sleep(WARMUP_S)
        os.kill(cluster.running.process.pid, signal.SIGHUP)
        deadline = time.monotonic() + 600
        while cluster.running.log().count("rolling restart done") == log_before:
            assert time.monotonic() < deadline, "the rolling restart did not end"
            assert cluster.running.process.poll() is None, cluster.running.log()[-3000:]
            time.sleep(0.5)
        time.sleep(AFTER_S)
        outcomes = load.stop()
    this_restart = cluster.running.log().rsplit("rolling restart of", 1)[1]
    exits = dict(re.findall(r"\[pd-cluster\] restarted (\S+) \(exit code (-?\d+)\)", this_restart))
    restarted = len(exits)
    note = f"{restarted} processes restarted one at a time"
    failed = judge(
        outcomes, reference, table, "rolling SIGTERM restart (all 6)", cluster.backend, note
    )
    assert not failed, f"failed: {[o.error for o in failed[:3]]}"
    assert exits == dict.fromkeys(exits, "0") and restarted == 6, exits  # drained, exited 0
    assert cluster.pages_in_use() == dict.fromkeys(cluster.decode_addresses(), 0)


def test_gateway_sigkill_fails_only_its_streams(
    cluster: Cluster, reference: list[str], table: list[Row]
) -> None:
    """Kill gateway-1 mid-stream: only the streams it held fail; its clients' next requests
    go to gateway-0."""
    outcomes = kill_gateway_under_load(cluster, signal.SIGKILL, AFTER_S)
    note = "only the streams it held fail"
    failed = judge(
        outcomes, reference, table, "SIGKILL of one of two gateways", cluster.backend, note
    )
    assert all(o.started and o.gateway == 1 for o in failed), [o.error for o in failed]
    assert len(failed) <= CLIENTS
