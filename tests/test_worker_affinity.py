"""`gateway-server --workers 2 --decode-policy worker_affinity` with real processes on 127.0.0.1:
a bootstrap-server, two fake colocated nodes (scripts/bench/fake_node.py, the gateway benchmark's
token source) and the gateway's two workers.

- each worker knows its own index: /health, answered by whichever worker took the connection,
  reports indices 0 and 1 from two different pids;
- each worker's requests all go to one node, worker 0's to the first node in id order and
  worker 1's to the second (pdserve_gateway_worker_node_requests_total, merged
  over both workers by /metrics).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.ports import free_port
from gateway.process.launcher import bootstrap_ready, console_script, node_registered, running_node
from tests.helpers import terminate
from tests.test_gateway_workers import _health

WAIT_S = 120.0  # bound of every poll below (a failure, never a timing assertion)
REQUESTS_PER_WORKER = 4


@pytest.fixture(scope="module")
def gateway_url(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("worker-affinity")
    with contextlib.ExitStack() as stack:
        bootstrap = stack.enter_context(
            running_node("bootstrap-server", [], logs / "bootstrap.log", probe=bootstrap_ready)
        )
        fake = [sys.executable, "-m", "scripts.bench.fake_node"]
        fake += ["--bootstrap", bootstrap.address, "--token-ids", "1,2,3"]
        for i in range(2):
            stack.enter_context(
                running_node(fake[0], fake[1:], logs / f"fake-{i}.log", probe=node_registered)
            )
        port = free_port()
        command = [console_script("gateway-server"), "--bootstrap", bootstrap.address]
        command += ["--model", str(default_model_dir), "--port", str(port), "--workers", "2"]
        command += ["--decode-policy", "worker_affinity"]
        log = logs / "gateway.log"
        with log.open("wb") as out:
            gateway = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            url = f"http://127.0.0.1:{port}"
            _workers_seeing_both_nodes(url, log)
            yield url
        finally:
            terminate(gateway, 60)
        assert gateway.returncode == 0, log.read_text()[-3000:]


def _workers_seeing_both_nodes(url: str, log: Path | None = None) -> dict[int, object]:
    """pid -> worker index of each worker, once both answered /health with both nodes known
    (before that a worker's pin would be counted over one node)."""
    seen: dict[int, object] = {}
    deadline = time.monotonic() + WAIT_S
    while len(seen) < 2:
        tail = log.read_text()[-3000:] if log is not None else ""
        assert time.monotonic() < deadline, f"only {seen} answered:\n{tail}"
        body = _health(url)
        if body.get("colocated") == 2:
            seen[int(body["pid"])] = body["worker"]  # type: ignore[call-overload]
    return seen


def _requests_by_worker(url: str) -> dict[str, dict[str, float]]:
    """worker label -> node id -> choices routed there (/metrics merges both workers)."""
    counts: dict[str, dict[str, float]] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not line.startswith("pdserve_gateway_worker_node_requests_total{"):
            continue
        series, _, value = line.rpartition(" ")
        labels = dict(part.split("=", 1) for part in series.split("{", 1)[1].rstrip("}").split(","))
        worker, node = labels["worker"].strip('"'), labels["node_id"].strip('"')
        counts.setdefault(worker, {})[node] = float(value)
    return counts


def test_each_worker_knows_its_index(gateway_url: str) -> None:
    seen = _workers_seeing_both_nodes(gateway_url)
    assert sorted(seen.values()) == [0, 1], seen  # type: ignore[type-var]


def test_each_worker_keeps_to_its_own_node(gateway_url: str) -> None:
    model = str(httpx.get(gateway_url + "/v1/models").json()["data"][0]["id"])
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 3}
    counts: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + WAIT_S
    while len(counts) < 2 or min(sum(n.values()) for n in counts.values()) < REQUESTS_PER_WORKER:
        assert time.monotonic() < deadline, counts
        answer = httpx.post(
            gateway_url + "/v1/completions", json=body, timeout=60
        )  # new connection
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3
        counts = _requests_by_worker(gateway_url)
    assert sorted(counts) == ["0", "1"], counts
    pinned = {worker: sorted(nodes) for worker, nodes in counts.items()}
    assert all(len(nodes) == 1 for nodes in pinned.values()), counts  # one node per worker
    assert pinned["0"][0] < pinned["1"][0], counts  # worker i -> node i in id order
