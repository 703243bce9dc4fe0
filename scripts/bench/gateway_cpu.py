"""Gateway CPU per streamed token and tokens/s per worker, with the gateway as the bottleneck.

The token source is a fake node (scripts/bench/fake_node.py): a process that speaks the real
node gRPC protocol and registers with a real bootstrap-server, so the gateway discovers it as it
discovers any node. It runs no model. On `Node.GenerateStream` (what the gateway uses) it
answers as a decode node does: one `StreamBatch` per step with a token for every request open
on the call; by default a step whenever the stream takes the previous batch (the gateway is the
bottleneck), with `--step-ms S` one step every S ms, tokens of steps not sent yet merging into
the pending deltas as a decode node merges them (does a gateway keep up with a node that fast?).
With `--per-request-streams` it offers only `Node.Generate` (one `TokenChunk` message per token
per request), as nodes did before the per-step stream. Several client processes (raw HTTP/1.1
over asyncio streams, no JSON parsing: they count `data:` frames and read the usage object at
the end) keep many streams open: `POST /v1/completions`, `stream: true`, `ignore_eos`, a fixed
number of tokens per request.

For each (workers, stream interval) a fresh `gateway-server --workers W --stream-interval K`
serves the load, measured over a steady window of `--duration` seconds that starts `--warmup`
seconds after the clients (so every stream is open, and the streams' ragged end, each finishing
its last request after the window, is not counted: a tail of fewer and fewer streams would
shrink the batches a worker sees). The gateway's CPU is read from /proc (utime + stime of every
process of its session: the supervisor and its workers, all threads) at the window's edges;
tokens are the frames the clients received inside it, times the run's tokens per frame (from
the usage of the finished requests). Printed per row: gateway CPU us per
streamed token, tokens/s in all and per worker, how busy the workers were (CPU s per wall s per
worker: near 1.0 means the gateway was the bottleneck), tokens per SSE frame (1.0 at stream
interval 1 while the gateway keeps up; more when a slow gateway or the node merged steps), and
the ratios to the goals: <= 25 us per token, >= 40k tokens/s for one worker, N workers >=
0.8 * N times one. Each process's own CPU is printed too (every gateway process, the token
source, each client: CPU s per wall s), so that a row where a client or the fake node was the
limit says so.

Per worker and row (the gateway's own `pdserve_gateway_worker_*` series from /metrics, read at
the window's edges; pids from /health; CPU from /proc): TCP connections accepted before and
inside the window, requests routed and open at the window's start and end, tokens of the
requests it finished, the nodes' per-step messages it received and the deltas in each (the batch
a step gave it: a worker holding fewer streams gets smaller messages and pays the per-message
cost more often), its cores and CPU us per delta; and how many connections the clients opened
(one per request: the kernel places each request anew). The load starts only once /health
passes, which with `--workers N` is once every worker serves (gateway/process/workers.py): a first
wave sent earlier piles onto the workers that listen already. `--out FILE` writes the tables too.

`--decode-policy NAME` is the gateway's (default `kv_aware`, i.e. `least_load` here: fake nodes
publish no KV events). With `worker_affinity` gateway worker i sends all its requests to fake
node i mod M (the fake nodes register as fake-00, fake-01, ... so id order is start order):
with `--fake-nodes 4 --workers 4` each (worker, node) stream carries that worker's whole batch,
with `--workers 1` worker 0 uses fake-00 alone. Every row prints, per worker, the nodes its
requests went to (the gateway's `pdserve_gateway_worker_node_requests` counter) and each fake
node's CPU, so a run shows whether the pinning held.

With `--pin` (scripts/bench/pinning.py) every gateway worker gets a physical core of its own,
the fake nodes a core each, the clients the cores left, planned once for the largest `--workers`
so that every row runs on the same cores; `--clients-per-worker` sizes the client processes to
each row's workers. The gateway workers are pinned by the product itself, `gateway-server
--worker-cpus` with the first hardware thread of each worker's core (the measured setting is the
one a deployment gets; on an SMT host the core's other threads stay idle, given to no client);
the bench pins the fake nodes and the clients itself. `--idle-cpus LIST` gives some CPUs to no
process (a virtual machine's hidden SMT siblings).

Compare rows of different `--workers` with `--step-ms` near an engine's step (10 ms): at the
default 0 the fake node runs ahead of a fast gateway, sends each request's tokens as fast as
gRPC's window allows and then has only the newly opened requests left to step. One-worker rows
then get node messages of 3-25 deltas (four-worker rows 20-120) and pay the per-message cost
more often (`benchmarks/gpu-2026-11-26-gateway-host-h100.md`).

    python -m scripts.bench.gateway_cpu [--workers 1,2] [--intervals 1,8] [--duration 10]
    python -m scripts.bench.gateway_cpu --pin --workers 1,4 --clients-per-worker 2
    python -m scripts.bench.gateway_cpu --workers 2 --worker-cpus 0,1  (only the gateway pinned)
    python -m scripts.bench.gateway_cpu --workers 1,2 --intervals 1 --step-ms 10 --out x.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from multiprocessing.queues import Queue
from pathlib import Path

from engine.ports import LOCALHOST, free_port
from gateway.config import WORKER_LISTEN
from gateway.process.cpus import format_cpu_list
from gateway.process.launcher import (
    ServerProcess,
    bootstrap_ready,
    console_script,
    node_registered,
    running_node,
    session_pids,
)
from gateway.routing.policies import POLICIES
from scripts.bench.pinning import CpuPlan, host_cores, parse_cpu_list, pinned, plan_cpus
from scripts.flags import config_from_args
from scripts.serving.procstat import cpu_seconds as process_cpu_seconds

GOAL_US_PER_TOKEN = 25.0
GOAL_ONE_WORKER_TOKENS_S = 40_000.0
GOAL_SCALING = 0.8
_TEXT = (
    "The gateway of a serving system turns token ids into text and frames, one chunk after "
    "another, for every stream it holds open; it should never be the slowest part. "
)
_USAGE = re.compile(rb'"completion_tokens":(\d+)')


@dataclass(frozen=True)
class BenchConfig:
    workers: tuple[int, ...]
    intervals: tuple[int, ...]
    duration_s: float  # the measured window (raw load)
    clients: int  # client processes
    streams: int  # open streams per client process
    tokens: int  # per request
    tokens_per_message: int  # of the fake node (a decode node sends 1 per step)
    step_ms: float  # of the fake node; 0: a step whenever the stream takes the last one
    per_request_streams: bool  # the fake node offers Generate only (no per-step stream)
    load_tool: str  # "raw": this script's clients; "bench_serving": scripts/serving/bench_serving
    waves: int  # bench_serving: requests per concurrency slot
    fake_nodes: int
    model: str | None
    log_dir: Path
    pin: bool = False  # processes on cores of their own (scripts/bench/pinning.py)
    clients_per_worker: int = 0  # > 0: this many client processes per gateway worker
    warmup_s: float = 3.0  # raw load: from the clients' start to the measured window
    decode_policy: str = "kv_aware"  # the gateway's --decode-policy
    out: Path | None = None  # the tables are written here too
    worker_listen: str = "reuseport"  # the gateway's --worker-listen
    worker_cpus: str = ""  # the gateway's --worker-cpus without --pin ("": unpinned)
    idle_cpus: tuple[int, ...] = ()  # with --pin: CPUs no process gets

    def client_processes(self, workers: int) -> int:
        return self.clients_per_worker * workers if self.clients_per_worker else self.clients


@dataclass(frozen=True)
class TokenSource:
    bootstrap: str  # host:port of the bootstrap-server
    node_pids: tuple[int, ...]
    plan: CpuPlan | None = None  # with --pin


@dataclass(frozen=True)
class WorkerCounts:
    """One gateway worker's `pdserve_gateway_worker_*` counters at one moment (/metrics)."""

    connections: float = 0.0  # TCP connections it accepted
    requests: float = 0.0  # choices it sent to a node
    tokens: float = 0.0  # completion tokens of the choices it finished
    batches: float = 0.0  # per-step node messages it received
    deltas: float = 0.0  # request deltas in them
    inflight: float = 0.0  # requests it holds open (a gauge, not a counter)

    def minus(self, before: WorkerCounts) -> WorkerCounts:
        """The counters' growth since `before`; `inflight` stays this moment's."""
        return WorkerCounts(
            self.connections - before.connections,
            self.requests - before.requests,
            self.tokens - before.tokens,
            self.batches - before.batches,
            self.deltas - before.deltas,
            self.inflight,
        )


@dataclass(frozen=True)
class WorkerWindow:
    """One gateway worker over the measured window."""

    index: int
    pid: int  # 0: not known (no /health answer from it)
    before: WorkerCounts  # from the gateway's start to the window's start
    window: WorkerCounts  # growth inside the window (inflight: at its end)
    inflight_start: float  # requests it held open when the window opened
    cpu_s: float  # its process's CPU inside the window (nan: pid not known)

    @property
    def mean_batch(self) -> float:
        """Request deltas per node message it received (the batch a step gave it)."""
        return self.window.deltas / self.window.batches if self.window.batches else float("nan")


@dataclass(frozen=True)
class Row:
    workers: int
    interval: int
    tokens: int
    requests: int
    frames: int  # SSE `data:` frames with tokens (not the usage chunk or [DONE])
    wall_s: float
    cpu_s: float
    node_cpu_s: float  # the fake nodes' (the token source must not be the bottleneck)
    client_busy: float = float("nan")  # the busiest client process's CPU s per wall s
    process_busy: tuple[float, ...] = ()  # each gateway process's CPU s per wall s, busiest first
    clients: int = 0  # client processes
    decode_policy: str = ""
    nodes_per_worker: tuple[int, ...] = ()  # by worker index: the nodes its requests went to
    node_busy: tuple[float, ...] = ()  # each fake node's CPU s per wall s, in id order
    per_worker: tuple[WorkerWindow, ...] = ()  # by worker index: its share of the window
    step_ms: float = 0.0  # the fake node's
    worker_listen: str = ""  # the gateway's --worker-listen
    connections: int = 0  # TCP connections the clients opened (one per request)

    @property
    def us_per_token(self) -> float:
        return self.cpu_s / self.tokens * 1e6 if self.tokens else float("nan")

    @property
    def tokens_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def tokens_per_frame(self) -> float:
        return self.tokens / self.frames if self.frames else float("nan")

    @property
    def busy(self) -> float:
        """Gateway CPU seconds per wall second per worker."""
        return self.cpu_s / self.wall_s / self.workers


# ---- the clients ------------------------------------------------------------------------------
def _request_bytes(port: int, body: dict[str, object]) -> bytes:
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {LOCALHOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + payload


_FRAME = b"data: "
_NOT_TOKEN_FRAMES = 2  # the usage chunk and [DONE]


Window = tuple[float, float]  # [start, end) on the monotonic clock, shared by every process


async def _one_request(
    port: int, request: bytes, window: Window = (0.0, 0.0)
) -> tuple[int, int, int]:
    """Send one streaming request; its completion tokens (from the usage chunk), the number of
    frames that carried them, and how many of those arrived inside `window`."""
    reader, writer = await asyncio.open_connection(LOCALHOST, port)
    frames = inside = 0
    start, end = window
    try:
        writer.write(request)
        head = tail = await reader.read(1 << 16)
        piece = head
        while piece:
            # a frame marker split over two reads is counted once: the 5 bytes before a piece
            # cannot hold a whole marker
            count = head.count(_FRAME) if piece is head else (tail[-5:] + piece).count(_FRAME)
            if piece is not head:
                tail = (tail + piece)[-4096:]
            frames += count
            if start <= time.monotonic() < end:
                inside += count - (_NOT_TOKEN_FRAMES if b"data: [DONE]" in piece else 0)
            piece = await reader.read(1 << 16)
    finally:
        writer.close()
    if not head.startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in tail:
        raise RuntimeError(f"a stream failed: {head[:300]!r} ... {tail[-300:]!r}")
    found = _USAGE.findall(tail)
    return (int(found[-1]) if found else 0), frames - _NOT_TOKEN_FRAMES, max(inside, 0)


async def _client(port: int, request: bytes, streams: int, window: Window) -> tuple[float, ...]:
    """Keep `streams` requests open until the window ends; (tokens, requests, frames, frames
    inside the window, CPU seconds). Each request opens a connection of its own (`Connection:
    close`), so the kernel places every request on a worker anew."""
    tokens = requests = frames = inside = 0

    async def stream() -> None:
        nonlocal tokens, requests, frames, inside
        while True:  # at least one request: a client may start late on a busy host
            got, framed, counted = await _one_request(port, request, window)
            tokens += got
            frames += framed
            inside += counted
            requests += 1
            if time.monotonic() >= window[1]:
                break

    await asyncio.gather(*(stream() for _ in range(streams)))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return tokens, requests, frames, inside, usage.ru_utime + usage.ru_stime


def _client_main(
    port: int, request: bytes, streams: int, window: Window, results: Queue[tuple[float, ...]]
) -> None:
    results.put(asyncio.run(_client(port, request, streams, window)))


# ---- one measurement --------------------------------------------------------------------------
def cpu_seconds(pids: Sequence[int]) -> float:
    """utime + stime of these processes (all their threads); gone ones count 0."""
    return sum(process_cpu_seconds(pid) or 0.0 for pid in pids)


def _wait_gateway(gateway: ServerProcess, url: str, nodes: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not gateway.alive:
            raise RuntimeError(f"gateway-server exited:\n{gateway.log_tail()}")
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(url + "/health", timeout=5) as answer,
        ):
            if json.loads(answer.read()).get("colocated") == nodes:
                return
        time.sleep(0.2)
    raise RuntimeError(f"gateway-server not ready after 120 s:\n{gateway.log_tail()}")


def measure(config: BenchConfig, source: TokenSource, workers: int, interval: int) -> Row:
    port = free_port()
    command = [console_script("gateway-server"), "--bootstrap", source.bootstrap]
    command += [*(["--model", config.model] if config.model else [])]
    command += ["--workers", str(workers), "--stream-interval", str(interval)]
    command += ["--decode-policy", config.decode_policy]
    command += ["--worker-listen", config.worker_listen]
    command += ["--max-inflight", "100000", "--log-level", "warning"]
    # Every client is 127.0.0.1: the per-address cap (256 by default) would reset the rest.
    command += ["--max-connections-per-client", "100000"]
    command += ["--host", LOCALHOST, "--port", str(port)]
    log = config.log_dir / f"gateway-w{workers}-k{interval}.log"
    if source.plan is not None:  # the product's own pinning: worker i on its core's first CPU
        command += ["--worker-cpus", source.plan.worker_cpus(workers)]
    elif config.worker_cpus:
        command += ["--worker-cpus", config.worker_cpus]
    gateway = ServerProcess.start("gateway", command, address=f"{LOCALHOST}:{port}", log_path=log)
    try:
        _wait_gateway(gateway, f"http://{LOCALHOST}:{port}", config.fake_nodes)
        body = {
            "model": _served_name(port),
            "prompt": list(range(1000, 1016)),
            "max_tokens": config.tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        request = _request_bytes(port, body)
        asyncio.run(_one_request(port, request))  # warm: channels open, tokenizer caches
        pids = worker_pids(port, workers) if workers > 1 else {0: gateway.pid}
        if len(pids) < workers:
            print(f"  only workers {sorted(pids)} of {workers} answered /health", flush=True)
        if source.plan is not None or config.worker_cpus:  # show that --worker-cpus held
            on = ", ".join(f"{i} on {_affinity(pid)}" for i, pid in sorted(pids.items()))
            print(f"  --worker-cpus: gateway workers {on}", flush=True)
        shape = (workers, interval)
        if config.load_tool == "bench_serving":
            row = _bench_serving_load(config, source, gateway, port, shape)
        else:
            row = _raw_load(config, source, gateway, port, request, shape, pids)
        routes = requests_by_worker(_metrics(port))
        for worker, nodes in sorted(routes.items()):
            spread = ", ".join(f"{node} {count:,}" for node, count in sorted(nodes.items()))
            print(f"  worker {worker} ({config.decode_policy}) requests: {spread}", flush=True)
        spread_counts = tuple(len(routes.get(w, {})) for w in range(workers))
        return replace(
            row,
            decode_policy=config.decode_policy,
            nodes_per_worker=spread_counts,
            step_ms=config.step_ms,
            worker_listen=config.worker_listen,
        )
    finally:
        gateway.stop(15)


def _metrics(port: int) -> str:
    """The gateway's /metrics (merged over its workers)."""
    with urllib.request.urlopen(f"http://{LOCALHOST}:{port}/metrics", timeout=30) as answer:
        return str(answer.read().decode())


_NODE_REQUESTS = re.compile(r"^pdserve_gateway_worker_node_requests_total\{(.*)\} (\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def requests_by_worker(metrics: str) -> dict[int, dict[str, int]]:
    """Worker index -> node id -> choices it sent there, from the gateway's /metrics text."""
    routes: dict[int, dict[str, int]] = {}
    for labels, value in _NODE_REQUESTS.findall(metrics):
        named = dict(_LABEL.findall(labels))
        if "worker" in named and float(value) > 0:
            nodes = routes.setdefault(int(named["worker"]), {})
            nodes[named.get("node_id", "?")] = int(float(value))
    return routes


_WORKER_SERIES = re.compile(
    r"^pdserve_gateway_worker_(connections_total|completion_tokens_total|node_batches_total|"
    r"node_deltas_total|node_requests_total|inflight)\{(.*)\} (\S+)$",
    re.M,
)
_WORKER_FIELDS = {
    "connections_total": "connections",
    "completion_tokens_total": "tokens",
    "node_batches_total": "batches",
    "node_deltas_total": "deltas",
    "node_requests_total": "requests",  # summed over its nodes
    "inflight": "inflight",  # summed over the worker's live processes
}


def worker_counts(metrics: str) -> dict[int, WorkerCounts]:
    """Worker index -> its `pdserve_gateway_worker_*` series, from the gateway's /metrics."""
    sums: dict[int, dict[str, float]] = {}
    for series, labels, value in _WORKER_SERIES.findall(metrics):
        named = dict(_LABEL.findall(labels))
        if "worker" not in named:
            continue
        fields = sums.setdefault(int(named["worker"]), {})
        field = _WORKER_FIELDS[series]
        fields[field] = fields.get(field, 0.0) + float(value)
    return {worker: WorkerCounts(**fields) for worker, fields in sums.items()}


def worker_pids(port: int, workers: int, deadline_s: float = 20.0) -> dict[int, int]:
    """Worker index -> pid, from /health answers (each new connection reaches the worker the
    kernel picks); workers that did not answer by the deadline are left out."""
    found: dict[int, int] = {}
    deadline = time.monotonic() + deadline_s
    while len(found) < workers and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{LOCALHOST}:{port}/health", timeout=5) as got:
                body = json.loads(got.read())
        except urllib.error.HTTPError as exc:  # 503 (starting, draining) still names it
            body = json.loads(exc.read() or b"{}")
        except (OSError, ValueError):
            continue
        if "worker" in body and "pid" in body:
            found[int(body["worker"])] = int(body["pid"])
    return found


def _affinity(pid: int) -> str:
    """The CPUs a process may run on, as a cpulist ('?' once it is gone)."""
    try:
        return format_cpu_list(sorted(os.sched_getaffinity(pid)))
    except OSError:
        return "?"


def _served_name(port: int) -> str:
    with urllib.request.urlopen(f"http://{LOCALHOST}:{port}/v1/models", timeout=10) as answer:
        return str(json.loads(answer.read())["data"][0]["id"])


def _bench_serving_load(
    config: BenchConfig,
    source: TokenSource,
    gateway: ServerProcess,
    port: int,
    row: tuple[int, int],
) -> Row:
    """The load from `bench_serving --workers <clients>` (the project's load tool), with its
    own CPU report: can it drive this many tokens/s, and does it say when it cannot?"""
    out = config.log_dir / f"bench_serving-w{row[0]}-k{row[1]}.json"
    command = [sys.executable, "-m", "scripts.serving.bench_serving", "--no-progress"]
    command += ["--base-url", f"http://{LOCALHOST}:{port}", "--dataset", "random"]
    command += ["--random-input-len", "16", "--random-output-len", str(config.tokens)]
    clients = config.client_processes(row[0])
    concurrency = clients * config.streams
    command += ["--random-range-ratio", "0", "--ignore-eos", "--workers", str(clients)]
    command += ["--max-concurrency", str(concurrency), "--output-file", str(out)]
    command += ["--num-prompts", str(concurrency * config.waves)]
    pids, nodes = session_pids(gateway.pid), list(source.node_pids)
    cpu_before, node_before = cpu_seconds(pids), cpu_seconds(nodes)
    with pinned(source.plan.clients if source.plan else None):
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    cpu, node_cpu = cpu_seconds(pids) - cpu_before, cpu_seconds(nodes) - node_before
    if done.returncode != 0:
        raise RuntimeError(f"bench_serving failed ({done.returncode}):\n{done.stderr[-3000:]}")
    for line in done.stderr.splitlines():
        if line.startswith("warning:"):
            print(f"  bench_serving {line}", flush=True)
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    client_units = [u for u in doc["cpu"] if u["name"].startswith("client")]
    for u in client_units:
        lag = u.get("loop_lag_p99_ms") or 0.0
        late = f"event loop {lag:.0f} ms late (p99)"
        print(f"  {u['name']}: {u['core_fraction']:.0%} of a core, {late}", flush=True)
    # bench_serving's duration is the load's own (its start-up is not in it)
    return Row(
        *row,
        tokens=summary["output_tokens"],
        requests=summary["completed"],
        frames=0,
        wall_s=summary["duration_s"],
        cpu_s=cpu,
        node_cpu_s=node_cpu,
        client_busy=max((u["core_fraction"] for u in client_units), default=float("nan")),
        clients=clients,
    )


def _raw_load(
    config: BenchConfig,
    source: TokenSource,
    gateway: ServerProcess,
    port: int,
    request: bytes,
    row: tuple[int, int],
    worker_pid: dict[int, int],
) -> Row:
    """The clients' load, measured over a steady window: from `--warmup` seconds after the
    clients start (every stream open) for `--duration` seconds. CPU is read at the window's
    edges and the clients count the frames that arrive inside it, so neither the streams'
    start nor their ragged end (each finishes its last request after the window) is counted."""
    context = multiprocessing.get_context("spawn")
    results: Queue[tuple[float, ...]] = context.Queue()
    pids = session_pids(gateway.pid)
    nodes = list(source.node_pids)
    window = (time.monotonic() + config.warmup_s, 0.0)
    window = (window[0], window[0] + config.duration_s)
    clients = [
        context.Process(target=_client_main, args=(port, request, config.streams, window, results))
        for _ in range(config.client_processes(row[0]))
    ]
    with pinned(source.plan.clients if source.plan else None):
        for client in clients:
            client.start()
    time.sleep(max(0.0, window[0] - time.monotonic()))
    before = {pid: cpu_seconds([pid]) for pid in pids}
    counts_before = worker_counts(_metrics(port))
    node_before = [cpu_seconds([pid]) for pid in nodes]
    time.sleep(max(0.0, window[1] - time.monotonic()))
    used = {pid: cpu_seconds([pid]) - before[pid] for pid in pids}
    node_used = [cpu_seconds([pid]) - b for pid, b in zip(nodes, node_before, strict=True)]
    counts_after = worker_counts(_metrics(port))
    wall = config.duration_s
    per_worker = _worker_windows(row[0], worker_pid, counts_before, counts_after, used)
    for w in per_worker:
        print(f"  {describe_worker(w, wall)}", flush=True)
    totals = [results.get() for _ in clients]
    for client in clients:
        client.join()
    tokens, requests, frames, inside = (
        int(sum(column)) for column in list(zip(*totals, strict=True))[:4]
    )
    print(
        f"  clients: {len(clients)} processes x {config.streams} streams opened {requests:,} "
        "connections (one per request)",
        flush=True,
    )
    per_frame = tokens / frames if frames else 1.0
    return Row(
        *row,
        round(inside * per_frame),
        requests,
        inside,
        wall,
        sum(used.values()),
        sum(node_used),
        client_busy=max(total[4] for total in totals) / (wall + config.warmup_s),
        process_busy=tuple(sorted((cpu / wall for cpu in used.values()), reverse=True)),
        clients=len(clients),
        node_busy=tuple(cpu / wall for cpu in node_used),
        per_worker=per_worker,
        connections=requests,
    )


def _worker_windows(
    workers: int,
    worker_pid: dict[int, int],
    before: dict[int, WorkerCounts],
    after: dict[int, WorkerCounts],
    used: dict[int, float],
) -> tuple[WorkerWindow, ...]:
    """Each worker's counters before and inside the window, and its CPU in it."""
    windows = []
    for index in range(workers):
        start, end = before.get(index, WorkerCounts()), after.get(index, WorkerCounts())
        pid = worker_pid.get(index, 0)
        cpu = used.get(pid, float("nan"))
        windows.append(WorkerWindow(index, pid, start, end.minus(start), start.inflight, cpu))
    return tuple(windows)


def describe_worker(w: WorkerWindow, wall: float) -> str:
    """One line on one worker's window."""
    got = w.window
    return (
        f"worker {w.index} pid {w.pid or '?'}: {got.connections:,.0f} connections, "
        f"{got.requests:,.0f} requests in the window ({w.before.connections:,.0f} connections "
        f"before it), {w.inflight_start:.0f} -> {got.inflight:.0f} open, "
        f"{got.tokens:,.0f} tokens finished, {got.batches:,.0f} node messages with "
        f"{w.mean_batch:.1f} deltas each, {w.cpu_s / wall:.2f} cores"
    )


# ---- the run ----------------------------------------------------------------------------------
def _token_ids(model: str | None) -> list[int]:
    from engine.model_fetch import resolve_model
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(model))
    if tokenizer is None:
        raise SystemExit(f"{model}: no tokenizer in the model directory (--model)")
    return list(tokenizer.encode(_TEXT, add_special_tokens=False))


@contextlib.contextmanager
def token_source(config: BenchConfig) -> Iterator[TokenSource]:
    """A bootstrap-server and the fake nodes registered with it; yields the bootstrap address."""
    ids = ",".join(str(t) for t in _token_ids(config.model))
    plan = None
    if config.pin:
        try:
            plan = plan_cpus(host_cores(), max(config.workers), config.fake_nodes, config.idle_cpus)
        except ValueError as exc:
            raise SystemExit(f"--pin: {exc}") from None
        idle_text = f", idle {format_cpu_list(config.idle_cpus)}" if config.idle_cpus else ""
        print(f"pinned: {plan.describe()}{idle_text}", flush=True)
    with contextlib.ExitStack() as stack:
        with pinned(plan.nodes[0] if plan else None):  # idle while the load runs
            bootstrap = stack.enter_context(
                running_node("bootstrap-server", [], config.log_dir / "bootstrap.log",
                             probe=bootstrap_ready)
            )  # fmt: skip
        node = [sys.executable, "-m", "scripts.bench.fake_node"]
        node += ["--bootstrap", bootstrap.address, "--token-ids", ids]
        node += ["--tokens-per-message", str(config.tokens_per_message)]
        node += ["--step-ms", str(config.step_ms)]
        node += ["--per-request-streams"] if config.per_request_streams else []
        fakes = []
        for i in range(config.fake_nodes):
            named = [*node[1:], "--node-id", fake_node_id(i)]  # id order = start order
            with pinned(plan.nodes[i] if plan else None):
                fake = stack.enter_context(
                    running_node(node[0], named, config.log_dir / f"fake-node-{i}.log",
                                 probe=node_registered)
                )  # fmt: skip
            fakes.append(fake.pid)
        yield TokenSource(bootstrap.address, tuple(fakes), plan)


def fake_node_id(index: int) -> str:
    """The id fake node `index` registers with; ids sort as the indices do."""
    return f"fake-{index:02d}"


def table(rows: list[Row]) -> str:
    # each row against the one-worker row of its interval run last before it (repeats of
    # `--workers 1,4,1,4` pair up), else the first one after it
    ones: dict[int, Row] = {}
    for r in rows:
        if r.workers == 1:
            ones.setdefault(r.interval, r)
    lines = [
        "| workers | stream interval | gateway CPU us/token | goal 25 us | tokens/s | "
        "tokens/s per worker | vs 1 worker | goal 0.8 x N | workers busy | node busy | "
        "tokens / frame | clients | busiest client | gateway processes busy | requests | "
        "decode policy | nodes per worker | fake nodes busy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.workers == 1:
            ones[r.interval] = r
        one = ones.get(r.interval)
        scale = r.tokens_s / one.tokens_s if one else float("nan")
        per_worker = r.tokens_s / r.workers
        goal_rate = (
            f"{per_worker / GOAL_ONE_WORKER_TOKENS_S:.2f} of 40k"
            if r.workers == 1
            else f"{scale / (GOAL_SCALING * r.workers):.2f}"
        )
        lines.append(
            f"| {r.workers} | {r.interval} | {r.us_per_token:.1f} | "
            f"{GOAL_US_PER_TOKEN / r.us_per_token:.2f} | {r.tokens_s:,.0f} | {per_worker:,.0f} | "
            f"{scale:.2f}x | {goal_rate} | {r.busy:.2f} | {r.node_cpu_s / r.wall_s:.2f} | "
            f"{r.tokens_per_frame:.2f} | {r.clients} | {r.client_busy:.2f} | "
            f"{' '.join(f'{b:.2f}' for b in r.process_busy) or '-'} | {r.requests} | "
            f"{r.decode_policy or '-'} | {' '.join(map(str, r.nodes_per_worker)) or '-'} | "
            f"{' '.join(f'{b:.2f}' for b in r.node_busy) or '-'} |"
        )
    return "\n".join(lines)


def worker_table(rows: list[Row]) -> str:
    """Each row's workers over the window: how the load spread over them and what it cost."""
    lines = [
        "| workers | stream interval | step ms | worker listen | worker | pid | "
        "connections before the window "
        "| connections in it | requests in it | open at start -> end | tokens finished | "
        "node messages | deltas per message | cores | CPU us per delta |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for w in r.per_worker:
            got = w.window
            per_delta = w.cpu_s / got.deltas * 1e6 if got.deltas else float("nan")
            lines.append(
                f"| {r.workers} | {r.interval} | {r.step_ms:g} | {r.worker_listen or '-'} | "
                f"{w.index} | {w.pid or '?'} | "
                f"{w.before.connections:,.0f} | {got.connections:,.0f} | {got.requests:,.0f} | "
                f"{w.inflight_start:.0f} -> {got.inflight:.0f} | {got.tokens:,.0f} | "
                f"{got.batches:,.0f} | {w.mean_batch:.1f} | {w.cpu_s / r.wall_s:.2f} | "
                f"{per_delta:.1f} |"
            )
    return "\n".join(lines)


def build_config(argv: list[str] | None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="gateway workers to measure")
    parser.add_argument("--intervals", default="1,8", help="--stream-interval values")
    parser.add_argument(
        "--duration", type=float, default=10.0, help="seconds of load measured per row"
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=3.0,
        help="raw load: seconds from the clients' start to the measured window",
    )
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument(
        "--clients-per-worker",
        type=int,
        default=0,
        help="client processes per gateway worker of each row (instead of --clients)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="each gateway worker on a physical core of its own, the fake nodes a core each, the "
        "clients the rest (Linux; needs workers + fake nodes + 1 physical cores)",
    )
    parser.add_argument("--streams", type=int, default=32, help="open streams per client")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per request")
    parser.add_argument("--fake-nodes", type=int, default=1, help="token source processes")
    parser.add_argument(
        "--decode-policy",
        default="kv_aware",
        choices=sorted(POLICIES),
        help="the gateway's --decode-policy; worker_affinity: worker i uses fake node i mod "
        "--fake-nodes only (kv_aware, the default, is least_load here: no KV events)",
    )
    parser.add_argument(
        "--tokens-per-message",
        type=int,
        default=1,
        help="tokens per request per message of the fake node (a decode node sends 1 per step)",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="the fake node steps every this many ms (0: whenever the stream takes a batch)",
    )
    parser.add_argument(
        "--per-request-streams",
        action="store_true",
        help="the fake node offers only Generate, one gRPC stream per request (no GenerateStream)",
    )
    parser.add_argument(
        "--load-tool",
        choices=("raw", "bench_serving"),
        default="raw",
        help="raw: this script's clients for --duration; bench_serving: `bench_serving "
        "--workers <clients>` with <clients> x <streams> concurrent requests, --waves of them",
    )
    parser.add_argument("--waves", type=int, default=3, help="bench_serving: requests per slot")
    parser.add_argument("--model", default=None, help="tokenizer directory (default model)")
    parser.add_argument("--log-dir", type=Path, default=None, help="default: a temporary one")
    parser.add_argument(
        "--out", type=Path, default=None, help="also write the configuration and tables here"
    )
    parser.add_argument(
        "--worker-listen",
        default="reuseport",
        choices=WORKER_LISTEN,
        help="the gateway's --worker-listen: a listener per worker (reuseport) or one shared",
    )
    parser.add_argument(
        "--worker-cpus",
        default="",
        metavar="LIST",
        help="the gateway's --worker-cpus (worker i on CPU LIST[i mod len]), the rest unpinned; "
        "--pin sets it from its plan instead",
    )
    parser.add_argument(
        "--idle-cpus",
        default="",
        metavar="LIST",
        help="with --pin: CPUs given to no process (e.g. the hidden SMT siblings of the workers' "
        "CPUs on a virtual machine)",
    )
    args = parser.parse_args(argv)
    if args.idle_cpus and not args.pin:
        raise SystemExit("--idle-cpus needs --pin (it shapes the pinning plan)")
    numbers = [int(v) for v in f"{args.workers},{args.intervals}".split(",")]
    numbers += [args.clients, args.streams, args.tokens, args.tokens_per_message, args.fake_nodes]
    if args.pin and args.worker_cpus:
        raise SystemExit("--worker-cpus and --pin: choose one (--pin pins the workers itself)")
    if args.clients_per_worker < 0:
        raise SystemExit("--clients-per-worker must be >= 0")
    if min(numbers) < 1:
        raise SystemExit(
            "--workers, --intervals, --clients, --streams, --tokens, --tokens-per-message and "
            "--fake-nodes must be >= 1"
        )
    return config_from_args(
        BenchConfig,
        args,
        workers=tuple(int(v) for v in args.workers.split(",")),
        intervals=tuple(int(v) for v in args.intervals.split(",")),
        duration_s=args.duration,
        log_dir=args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-gateway-cpu-")),
        warmup_s=args.warmup,
        idle_cpus=parse_cpu_list(args.idle_cpus),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = build_config(argv)
    header = f"logs in {config.log_dir}; {os.cpu_count()} CPUs; {config}"
    print(header, flush=True)
    rows = []
    with token_source(config) as source:
        for interval in config.intervals:
            for workers in config.workers:
                row = measure(config, source, workers, interval)
                print(
                    f"workers {workers} interval {interval}: {row.us_per_token:.1f} us/token, "
                    f"{row.tokens_s:,.0f} tokens/s, busy {row.busy:.2f}, "
                    f"{row.tokens_per_frame:.2f} tokens/frame, node busy "
                    f"{row.node_cpu_s / row.wall_s:.2f}, busiest of {row.clients} clients "
                    f"{row.client_busy:.2f}",
                    flush=True,
                )
                rows.append(row)
    report = f"{table(rows)}\n\nPer worker over the window:\n\n{worker_table(rows)}\n"
    print(report, end="")
    if config.out is not None:
        config.out.write_text(f"{header}\n\n{report}")
        print(f"written to {config.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
