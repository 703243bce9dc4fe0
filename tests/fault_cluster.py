"""A whole cluster of real processes on 127.0.0.1 for fault tests, and steady load against it.

`FaultCluster` runs a bootstrap-server, named prefill/decode nodes and a gateway-server, each a
real process (gateway/process/launcher.py) that a test may SIGKILL, SIGSTOP/SIGCONT and start again:
the bootstrap and the gateway come back on the same address (nodes and clients know them by it),
a node comes back on a new port under a new node id and joins through the bootstrap.

`SteadyLoad` sends the load tester's streamed requests (scripts/serving/client.py, the client
of scripts/serving/bench_serving.py) at a steady rate from a background thread and keeps what
each request got: its text, or its error type and detail. `judge` sorts those outcomes around a
fault into correct, failed with a clear error, and lost (accepted and neither correct nor
reported as failed: wrong text, no end, or an unexplained error).

The model is a random-weight tiny llama with the default model's tokenizer: fast nodes and real
text; greedy output is deterministic (fp32 on CPU), so a reference run gives every prompt's text.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.ports import free_port
from gateway.process.launcher import ServerProcess as NodeServer
from gateway.process.launcher import (
    bootstrap_ready,
    loopback_transports,
    node_registered,
    running_node,
)
from planner.datasets import RequestSpec
from proto import node_pb2
from scripts.serving.client import ClientConfig, send

loopback_transports()  # the servers inherit it


def prompts(count: int, length: int, seed: int) -> list[tuple[int, ...]]:
    """Random token-id prompts (ids the load tester's random dataset uses by default)."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(1000, 10000) for _ in range(length)) for _ in range(count)]


# ---- the cluster ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timeouts:
    """What the cluster is configured with; what the tests' bounds derive from."""

    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.0  # bootstrap declares a silent node dead
    bootstrap_s: float = 8.0  # P waits this long for D's destination
    transfer_s: float = 8.0  # D waits this long for KV (or progress) from P


@dataclass
class Proc:
    server: NodeServer
    context: AbstractContextManager[NodeServer]
    node_id: str = ""

    @property
    def alive(self) -> bool:
        return self.server.process.poll() is None


class FaultCluster:
    """bootstrap + named nodes + gateway; `ensure()` (re)starts whatever is not running."""

    def __init__(
        self,
        tmp: Path,
        model: Path,
        backend: str,
        nodes: dict[str, tuple[str, list[str]]],  # name -> (console script, extra flags)
        timeouts: Timeouts = Timeouts(),
        gateway_args: tuple[str, ...] = (),
    ) -> None:
        self.tmp, self.model, self.backend = tmp, model, backend
        self.node_specs = nodes
        self.timeouts = timeouts
        self.gateway_args = gateway_args
        self.bootstrap_port = free_port()
        self.gateway_port = free_port()
        self.procs: dict[str, Proc] = {}

    @property
    def bootstrap_address(self) -> str:
        return f"127.0.0.1:{self.bootstrap_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def model_name(self) -> str:
        return self.model.name

    def __getitem__(self, name: str) -> NodeServer:
        return self.procs[name].server

    def node_id(self, name: str) -> str:
        return self.procs[name].node_id

    def node_names(self) -> list[str]:
        return list(self.node_specs)

    # ---- starting and stopping -----------------------------------------------------------
    def ensure(self) -> None:
        """Start what is not running (bootstrap first, then the nodes and the gateway side by
        side) and wait until the gateway routes to every node."""
        if not self._running("bootstrap"):
            self.start_bootstrap()
        down = [name for name in self.node_specs if not self._running(name)]
        starts: list[Callable[[], object]] = [partial(self.start_node, name) for name in down]
        if not self._running("gateway"):
            starts.append(self.start_gateway)
        with ThreadPoolExecutor(max_workers=max(len(starts), 1)) as pool:  # start-up overlaps
            for future in [pool.submit(start) for start in starts]:
                future.result()
        self.wait_gateway_sees_all()

    def _running(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.alive

    def _start(self, name: str, context: AbstractContextManager[NodeServer]) -> Proc:
        self.forget(name)
        server = context.__enter__()
        proc = Proc(server, context)
        self.procs[name] = proc
        return proc

    def start_bootstrap(self) -> None:
        t = self.timeouts
        args = ["--heartbeat-timeout", str(t.heartbeat_timeout_s)]
        args += ["--heartbeat-interval", str(t.heartbeat_interval_s)]
        log = self.tmp / "bootstrap.log"
        context = running_node(
            "bootstrap-server", args, log, probe=bootstrap_ready, port=self.bootstrap_port
        )
        self._start("bootstrap", context)

    def start_node(self, name: str) -> None:
        script, extra = self.node_specs[name]
        t = self.timeouts
        args = ["--model", str(self.model), "--bootstrap", self.bootstrap_address]
        args += ["--transfer-backend", self.backend, "--max-total-tokens", "8192"]
        args += ["--chunked-prefill-size", "32", "--bootstrap-timeout", str(t.bootstrap_s)]
        args += ["--transfer-timeout", str(t.transfer_s), *extra]
        if self.backend == "cuda_ipc":  # GPU to GPU only: both nodes on this host's GPU 0
            args += ["--device", "cuda"]
        if script == "decode-server":
            args = ["--mode", "disaggregated", *args]
        proc = self._start(
            name, running_node(script, args, self.tmp / f"{name}.log", probe=node_registered)
        )
        proc.node_id = proc.server.stub.Health(node_pb2.HealthRequest(), timeout=30).node_id

    def start_gateway(self) -> float:
        """Start the gateway on its port; returns the seconds until it answered /health."""
        started = time.monotonic()
        args = ["--bootstrap", self.bootstrap_address, "--model", str(self.model)]
        args += ["--log-level", "info", *self.gateway_args]
        url = self.url
        context = running_node(
            "gateway-server",
            args,
            self.tmp / "gateway.log",
            probe=lambda _channel: http_ok(url + "/health"),
            port=self.gateway_port,
        )
        self._start("gateway", context)
        return time.monotonic() - started

    def wait_gateway_sees_all(self, timeout: float = 60.0) -> None:
        want = {"prefill": 0, "decode": 0}
        for script, _ in self.node_specs.values():
            want["prefill" if script == "prefill-server" else "decode"] += 1
        deadline = time.monotonic() + timeout
        while True:
            health = get_json(self.url + "/health")
            if health is not None and all(health.get(k) == n for k, n in want.items()):
                return
            assert time.monotonic() < deadline, f"gateway /health {health}, want {want}"
            time.sleep(0.1)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        os.kill(proc.server.pid, signal.SIGKILL)
        proc.server.process.wait(30)

    def terminate(self, name: str, timeout: float = 120.0) -> int:
        """SIGTERM a process (a node drains, a gateway finishes its streams); its exit code."""
        proc = self.procs[name]
        os.kill(proc.server.pid, signal.SIGTERM)
        return proc.server.process.wait(timeout)

    def forget(self, name: str) -> None:
        """Stop (if needed) and drop a process, leftovers of its session included."""
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.context.__exit__(None, None, None)

    def close(self) -> None:
        for name in ["gateway", *self.node_specs, "bootstrap"]:
            if name in self.procs:
                proc = self.procs[name]
                if proc.alive:
                    os.kill(proc.server.pid, signal.SIGCONT)  # a frozen one must hear SIGTERM
                self.forget(name)

    @classmethod
    @contextmanager
    def running(cls, *args: Any, **kwargs: Any) -> Iterator[FaultCluster]:
        """A started cluster (the arguments are __init__'s), closed on the way out."""
        cluster = cls(*args, **kwargs)
        try:
            cluster.ensure()
            yield cluster
        finally:
            cluster.close()

    # ---- checks --------------------------------------------------------------------------
    def settle(self, name: str, timeout: float = 60.0) -> node_pb2.CheckIntegrityResponse:
        """Poll until the node runs nothing and holds no page, or the timeout; the last
        integrity check (used_pages > 0 after the timeout: leaked)."""
        server = self[name]
        deadline = time.monotonic() + timeout
        while True:
            load = server.stub.GetLoad(node_pb2.GetLoadRequest(), timeout=30)
            check = server.integrity()
            idle = load.running_requests == 0 and load.queued_requests == 0
            if (idle and check.used_pages == 0) or time.monotonic() > deadline:
                return check
            time.sleep(0.2)

    def leaked_pages(self, names: list[str]) -> dict[str, int]:
        """Pages still in use on each named node once it settled; asserts the invariant
        free + used + cached == total and the node's own integrity check."""
        leaked = {}
        for name in names:
            check = self.settle(name)
            assert check.ok, f"{name}: {check.error}"
            total = check.free_pages + check.used_pages + check.cached_pages
            assert total == check.total_pages, f"{name}: {check}"
            leaked[name] = check.used_pages
        return leaked

    def gateway_metric(self, name: str) -> float:
        """Sum of a gateway Prometheus counter over its labels."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((name + "{", name + " "))
        )


def cluster_fixture(
    name: str,
    nodes: dict[str, tuple[str, list[str]]],
    gateway_args: tuple[str, ...],
    timeouts: Timeouts = Timeouts(),
    backends: list[str] | None = None,
) -> Any:
    """A module fixture `cluster`: a FaultCluster of `nodes` on the tiny text model, one per
    backend in `backends` (a parametrised fixture), else one on mooncake. Each gets its own
    copy of `nodes`: a test may add nodes to it."""

    @pytest.fixture(scope="module", params=backends)
    def cluster(
        request: pytest.FixtureRequest,
        tiny_text_model: Path,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Iterator[FaultCluster]:
        backend: str = getattr(request, "param", "mooncake")
        tmp = tmp_path_factory.mktemp(f"{name}-{backend}")
        with FaultCluster.running(
            tmp, tiny_text_model, backend, dict(nodes), timeouts, gateway_args
        ) as running:
            yield running

    return cluster


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def get_json(url: str) -> dict[str, object] | None:
    try:
        return httpx.get(url, timeout=2).json()  # type: ignore[no-any-return]
    except (httpx.HTTPError, ValueError):
        return None


# ---- load -------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """One request as the client saw it (times: seconds since the load started)."""

    prompt: int  # index into the prompt list
    sent: float
    done: float
    error: str  # "" or the load tester's error type (http_503, stream_error, read_error, ...)
    detail: str
    text: str

    @property
    def ok(self) -> bool:
        return not self.error


class SteadyLoad:
    """`rate` requests per second, prompts in turn, each streamed to its end, until `stop()`."""

    def __init__(
        self,
        url: str,
        model: str,
        prompt_ids: list[tuple[int, ...]],
        rate: float,
        max_tokens: int,
        timeout_s: float = 120.0,
    ) -> None:
        self.client = ClientConfig(url, model, ignore_eos=True, timeout_s=timeout_s)
        self.specs = [RequestSpec(p, len(p), max_tokens) for p in prompt_ids]
        self.rate = rate
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._zero = time.perf_counter()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def now(self) -> float:
        return time.perf_counter() - self._zero

    def __enter__(self) -> SteadyLoad:
        self._zero = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        """Stop sending; wait for the requests in flight (each ends by the client timeout)."""
        self._stop.set()
        self._thread.join(self.client.timeout_s + 30)
        assert not self._thread.is_alive(), "the load thread did not end"
        return sorted(self.outcomes, key=lambda o: o.sent)

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(
            base_url=self.client.base_url, timeout=self.client.timeout_s, limits=limits
        ) as http:
            tasks = []
            index = 0
            while not self._stop.is_set():
                tasks.append(asyncio.create_task(self._one(http, index)))
                index += 1
                delay = index / self.rate - self.now()
                if delay > 0:
                    await asyncio.sleep(delay)
            await asyncio.gather(*tasks)

    async def _one(self, http: httpx.AsyncClient, index: int) -> None:
        number = index % len(self.specs)
        trace, text = await send(http, self.client, self.specs[number], [], self._zero)
        self.outcomes.append(
            Outcome(number, trace.sent, trace.done, trace.error, trace.error_detail, text)
        )


def reference_texts(
    url: str, model: str, prompt_ids: list[tuple[int, ...]], max_tokens: int, attempts: int = 1
) -> list[str]:
    """Each prompt's greedy text from the cluster, one request at a time; a prompt whose
    request failed (with an error: a fault injected on purpose) is sent again, up to
    `attempts` times in all."""
    client = ClientConfig(url, model, ignore_eos=True, timeout_s=120)

    async def one(http: httpx.AsyncClient, spec: RequestSpec) -> str:
        for _ in range(attempts):
            trace, text = await send(http, client, spec, [], time.perf_counter())
            if trace.ok:
                return text
        raise AssertionError(f"reference request failed: {trace.error} {trace.error_detail}")

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=client.timeout_s) as http:
            return [await one(http, RequestSpec(ids, len(ids), max_tokens)) for ids in prompt_ids]

    return asyncio.run(run())


# ---- judging a run around a fault --------------------------------------------------------------


@dataclass
class Verdict:
    """A run's outcomes sorted around the fault at `fault_at` (load-clock seconds)."""

    outcomes: list[Outcome]
    fault_at: float
    correct: list[Outcome] = field(default_factory=list)
    failed: list[Outcome] = field(default_factory=list)  # with a clear error
    lost: list[tuple[Outcome, str]] = field(default_factory=list)  # (outcome, why)

    @property
    def in_flight(self) -> int:
        return sum(1 for o in self.outcomes if o.sent <= self.fault_at < o.done)

    def recovery_s(self, since: float) -> float:
        """From `since` until the send time of the last request that did not succeed: every
        request sent after that succeeded (0: none sent after `since` failed)."""
        bad = [o.sent for o in self.failed + [o for o, _ in self.lost] if o.sent >= since]
        return max(bad, default=since) - since

    def succeeded_after(self, at: float) -> int:
        return sum(1 for o in self.correct if o.sent >= at)

    def longest_s(self) -> float:
        """The longest any request took (a hang shows here)."""
        return max((o.done - o.sent for o in self.outcomes), default=0.0)


def judge(
    outcomes: list[Outcome],
    reference: list[str],
    fault_at: float,
    clear_errors: Callable[[Outcome], bool],
) -> Verdict:
    verdict = Verdict(outcomes, fault_at)
    for o in outcomes:
        if o.ok and o.text == reference[o.prompt]:
            verdict.correct.append(o)
        elif o.ok:
            verdict.lost.append((o, f"wrong text {o.text!r}, want {reference[o.prompt]!r}"))
        elif clear_errors(o):
            verdict.failed.append(o)
        else:
            verdict.lost.append((o, f"unclear error {o.error}: {o.detail!r}"))
    return verdict


def gateway_error(o: Outcome) -> bool:
    """An error the gateway reported: an HTTP error status or an SSE error event, with a
    message (the gateway stayed up)."""
    return (o.error.startswith("http_5") or o.error == "stream_error") and bool(o.detail.strip())


def gateway_gone(o: Outcome) -> bool:
    """The gateway process itself died or was down: the connection broke or was refused."""
    return o.error in ("read_error", "connect_error") or gateway_error(o)


def wait_until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


# ---- the fault table ---------------------------------------------------------------------------


@dataclass
class Row:
    fault: str
    backend: str
    sent: int
    in_flight: int
    correct: int
    failed: int  # with a clear error
    lost: int
    retries: str  # the gateway's retries during the run ("-": the gateway restarted)
    leaked: int
    recovery_s: float
    longest_s: float
    note: str = ""
    migrations: str = "-"  # streams the gateway moved to another node after their first token

    HEADER = (
        "| fault | backend | requests | in flight at fault | completed correctly | failed "
        "(clear error) | lost | gateway retries | migrations | pages leaked | recovery (s) | "
        "longest request (s) | note |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )

    def markdown(self) -> str:
        return (
            f"| {self.fault} | {self.backend} | {self.sent} | {self.in_flight} | "
            f"{self.correct} | {self.failed} | {self.lost} | {self.retries} | "
            f"{self.migrations} | {self.leaked} | {self.recovery_s:.2f} | "
            f"{self.longest_s:.2f} | {self.note} |"
        )


def write_table(rows: list[Row], path: Path) -> None:
    """The rows as a markdown table, into `path` and onto stdout (seen with `pytest -s`)."""
    text = "\n".join([Row.HEADER, *(row.markdown() for row in rows)])
    path.write_text(text + "\n")
    print(f"\nfault table ({path}):\n{text}")
