"""Hostile and careless clients against a real cluster, measured (issue 25).

    python -m scripts.serving.hostile_probe [--model DIR] [--slow-connections 1000] [--rounds 3]
        [--bursts-only] [--sender-nice N] [--no-sink]

Starts `pd-cluster --prefill 1 --decode 1` (the default model unless --model) and prints, next to
each goal:
- the latency of a one-token request idle and during a burst of 8 concurrent long bodies, and
  their ratio (goal <= 2x); three bursts: ~3.9 MB prompts (rejected by the character bound),
  prompts just under the bound (tokenized in the pool, then rejected as too long) and 4 MB
  batches of a million one-token-id prompts (rejected by --max-n). Each burst runs --rounds
  times (idle requests, then the burst), from 8 sender processes started beforehand; the
  latencies are the medians over all rounds;
- the same 3.9 MB burst sent to a bare sink instead (scripts/serving/sink.py, another process
  that reads and discards the bodies): the one-token latency it leaves is the floor set by the
  senders and the loopback transfer on this host, without the gateway's work (--no-sink skips
  it). The senders run at `--sender-nice` (default 0; 19 approximates clients on another
  machine: their CPU, and the kernel's copies made on their behalf, no longer compete with
  the cluster's);
- the CPU time the server spent per burst (medians over the rounds, from /proc's schedstat):
  its event-loop thread, its other threads, its child processes (the gateway's body parse
  processes); less, for the gateway, what the one-token requests sent meanwhile cost at
  their idle rate (measured over the round's idle requests);
- the gateway's RSS before the first round and 1 s after the last (goal: at most 10% above;
  below is memory handed back that the gateway held before, e.g. since its start-up), and
  how far that is from the RSS at the probe's start;
- normal requests answered 429 while `--slow-connections` connections (from 127.0.0.2, another
  client address) sent headers and one body byte (goal 0);
- seconds from a streaming client's last read until both nodes hold no page (goal <= the stall
  timeout, plus the time its socket buffers take to fill);
- 5xx answers over the whole probe (goal 0).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from engine.ports import free_port
from gateway.process.launcher import console_script
from proto import node_pb2, node_pb2_grpc

ONE_TOKEN = {"model": "", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
BURST = 8
IDLE_REQUESTS = 5  # per round
SETTLE_S = 1.0  # after a burst, before the gateway's RSS is read
STALL_TIMEOUT_S = 5.0
SLOW_ADDRESS = "127.0.0.2"  # loopback too: the slow clients are another client address


@dataclass
class Probe:
    url: str
    model: str
    gateway_pid: int
    nodes: dict[str, str]  # name -> host:port
    statuses: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def post(
        self, path: str, body: dict[str, object] | bytes, timeout: float = 120
    ) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        response = httpx.post(self.url + path, content=content, headers=headers, timeout=timeout)
        with self.lock:
            self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
        return response

    def one_token_s(self) -> float:
        start = time.perf_counter()
        response = self.post("/v1/completions", {**ONE_TOKEN, "model": self.model})
        assert response.status_code == 200, response.text
        return time.perf_counter() - start

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.gateway_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def pages_in_use(self) -> int:
        used = 0
        for address in self.nodes.values():
            stub = node_pb2_grpc.NodeStub(grpc.insecure_channel(address))
            load = stub.GetLoad(node_pb2.GetLoadRequest(), timeout=30)
            check = stub.CheckIntegrity(node_pb2.CheckIntegrityRequest(), timeout=30)
            used += check.used_pages + load.running_requests + load.queued_requests
        return used


# -- the cluster ------------------------------------------------------------------------------


@contextmanager
def cluster(model: str | None, log_path: Path) -> Iterator[Probe]:
    port = free_port()
    gateway_args = f"--stream-stall-timeout {STALL_TIMEOUT_S:g}"
    command = [console_script("pd-cluster"), "--port", str(port), "--gateway-args", gateway_args]
    if model:
        command += ["--model", model]
    log = log_path.open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(url), process, f"pd-cluster exited: see {log_path}")
        text = log_path.read_text(errors="replace")
        nodes = {
            name: f"127.0.0.1:{p}"
            for name, p in re.findall(r"starting ((?:prefill|decode)-\d+): .* --port (\d+)", text)
        }
        served = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        yield Probe(url, served, _pid_listening(port), nodes)
    finally:
        process.terminate()
        process.wait(60)
        log.close()


def wait_until(ready: Callable[[], bool], process: subprocess.Popen[bytes], died: str) -> None:
    """Poll `ready` until it holds; RuntimeError(`died`) if `process` exits first."""
    while not ready():
        if process.poll() is not None:
            raise RuntimeError(died)
        time.sleep(0.2)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _pid_listening(port: int) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"gateway" in a for a in argv[:3]) and str(port).encode() in argv:
            return int(entry.name)
    raise RuntimeError(f"no gateway process for port {port}")


# -- the measurements -------------------------------------------------------------------------


@dataclass
class BurstResult:
    name: str
    idle_s: float  # median over the rounds' idle requests
    during_s: float  # median over the requests sent while a burst was in flight
    during_max_s: float
    during_count: int
    rss_before_mb: float  # before the first round
    rss_after_mb: float  # after the last, once the gateway had SETTLE_S to hand memory back
    statuses: dict[int, int]
    cpu_ms: tuple[float, float, float]  # per burst: event-loop thread, other threads, children


def cpu_seconds(pid: int) -> tuple[float, float, float]:
    """CPU seconds so far of `pid`'s main thread, its other threads and its descendants."""
    main = other = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        seconds = _schedstat_s(task)
        main, other = (main + seconds, other) if task.name == str(pid) else (main, other + seconds)
    children = sum(_schedstat_s(Path(f"/proc/{child}")) for child in _descendants(pid))
    return main, other, children


def _schedstat_s(entry: Path) -> float:
    try:
        return int((entry / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0  # gone since it was listed


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        with suppress(OSError, ValueError, IndexError):
            if entry.name.isdigit():
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


_SENDER_BODY: dict[str, bytes] = {}


def _start_sender(url: str, body: bytes, nice: int = 0) -> None:
    os.nice(nice)
    _SENDER_BODY[url] = body


def _post_status(url: str) -> int:
    headers = {"Content-Type": "application/json"}
    body = _SENDER_BODY[url]
    return httpx.post(url, content=body, headers=headers, timeout=120).status_code


def burst(
    probe: Probe,
    name: str,
    body: dict[str, object],
    rounds: int,
    nice: int = 0,
    target: str | None = None,
    target_pid: int | None = None,
) -> BurstResult:
    """`rounds` times: IDLE_REQUESTS one-token requests, then one-token requests one after
    the other while BURST processes (at niceness `nice`) each send `body` once, to the gateway
    or to `target` (served by `target_pid`). The senders are started and hold their body
    before anything is measured: only their requests overlap the measurement."""
    url = target or probe.url + "/v1/completions"
    content = json.dumps({"model": probe.model, **body}, separators=(",", ":")).encode()
    idle: list[float] = []
    during: list[float] = []
    statuses: dict[int, int] = {}
    cpu: list[tuple[float, ...]] = []
    pid = target_pid or probe.gateway_pid
    # Other processes: the burst's clients must not share the GIL with the one-token client.
    start = (url, content, nice)
    with ProcessPoolExecutor(BURST, initializer=_start_sender, initargs=start) as pool:
        list(pool.map(abs, range(BURST * 4)))  # every process started
        rss_before = probe.rss_mb()
        for _ in range(rounds):
            idle_cpu = cpu_seconds(probe.gateway_pid)
            idle += [probe.one_token_s() for _ in range(IDLE_REQUESTS)]
            per_request = _spent(idle_cpu, cpu_seconds(probe.gateway_pid), IDLE_REQUESTS)
            cpu_before, measured = cpu_seconds(pid), len(during)
            sent = [pool.submit(_post_status, url) for _ in range(BURST)]
            during.append(probe.one_token_s())  # at least one, even if the burst ends first
            while not all(f.done() for f in sent):
                during.append(probe.one_token_s())
            spent = _spent(cpu_before, cpu_seconds(pid))
            requests = len(during) - measured if target is None else 0  # sent to the gateway
            cpu.append(tuple(s - r * requests for s, r in zip(spent, per_request, strict=True)))
            for future in sent:
                statuses[future.result()] = statuses.get(future.result(), 0) + 1
        time.sleep(SETTLE_S)
        rss_after = probe.rss_mb()
    with probe.lock:
        for status, count in statuses.items() if target is None else ():
            probe.statuses[status] = probe.statuses.get(status, 0) + count
    return BurstResult(
        name,
        statistics.median(idle),
        statistics.median(during),
        max(during),
        len(during),
        rss_before,
        rss_after,
        statuses,
        (_median_ms(cpu, 0), _median_ms(cpu, 1), _median_ms(cpu, 2)),
    )


def _spent(before: tuple[float, ...], after: tuple[float, ...], per: int = 1) -> tuple[float, ...]:
    return tuple((b - a) / per for a, b in zip(before, after, strict=True))


def _median_ms(samples: list[tuple[float, ...]], index: int) -> float:
    return statistics.median(sample[index] for sample in samples) * 1000


@contextmanager
def sink() -> Iterator[tuple[str, int]]:
    """The URL and pid of a bare sink (scripts/serving/sink.py) in another process."""
    port = free_port()
    command = [sys.executable, "-m", "scripts.serving.sink", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(url), process, f"the sink exited: {shlex.join(command)}")
        yield url + "/", process.pid
    finally:
        process.terminate()
        process.wait(30)


def _answers(url: str) -> bool:
    try:
        return httpx.post(url, content=b"{}", timeout=5).status_code == 400
    except httpx.HTTPError:
        return False


def slow_connections(probe: Probe, count: int, normal: int) -> tuple[int, int, int]:
    """(normal requests answered 429, slow connections refused by the per-client cap, 5xx)."""
    host, port = probe.url.removeprefix("http://").rsplit(":", 1)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((SLOW_ADDRESS, 0))
            sock.connect((host, int(port)))
            sock.sendall(head)
            socks.append(sock)
        rejected = 0
        for _ in range(normal):
            response = probe.post("/v1/completions", {**ONE_TOKEN, "model": probe.model})
            rejected += response.status_code == 429
        refused = 0
        for sock in socks:
            sock.setblocking(False)
            with suppress(BlockingIOError, ConnectionResetError):
                refused += sock.recv(64).startswith(b"HTTP/1.1 429")
    finally:
        for sock in socks:
            sock.close()
    return rejected, refused, 0


def stalled_stream(probe: Probe) -> float:
    """Seconds from the client's last read until no node holds a page or runs a request."""
    host, port = probe.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({
        "model": probe.model, "messages": [{"role": "user", "content": "Tell a long story"}],
        "max_tokens": 4000, "ignore_eos": True, "stream": True, "logprobs": True,
        "top_logprobs": 20,
    }).encode()  # fmt: skip
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(head + body)
        first = sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        stopped = time.perf_counter()  # from here on the client reads nothing
        while probe.pages_in_use():
            time.sleep(0.1)
        return time.perf_counter() - stopped


# -- the report -------------------------------------------------------------------------------


def _row(what: str, value: str, goal: str, met: bool) -> str:
    return f"| {what} | {value} | {goal} | {'yes' if met else 'NO'} |"


def _cpu(b: BurstResult) -> str:
    loop, threads, children = b.cpu_ms
    return (f"event loop {loop:.0f} ms, other threads {threads:.0f} ms, "
            f"child processes {children:.0f} ms")  # fmt: skip


def _latency(b: BurstResult) -> str:
    ratio = b.during_s / b.idle_s
    return (f"{b.idle_s * 1000:.0f} ms vs {b.during_s * 1000:.0f} ms (x{ratio:.2f}; "
            f"n={b.during_count}, max {b.during_max_s * 1000:.0f} ms)")  # fmt: skip


def report(bursts: list[BurstResult], slow: tuple[int, int, int], stall_s: float,
           five_xx: int, slow_count: int,
           sunk: BurstResult | None = None) -> list[str]:  # fmt: skip
    lines = ["| measure | value | goal | met |", "|---|---|---|---|"]
    start_rss_mb = bursts[0].rss_before_mb
    for b in bursts:
        ratio = b.during_s / b.idle_s
        growth = (b.rss_after_mb - b.rss_before_mb) / b.rss_before_mb
        lines.append(_row(f"one-token latency, idle vs during {b.name}", _latency(b), "<= 2x",
                          ratio <= 2))  # fmt: skip
        lines.append(f"| gateway CPU per burst ({b.name}) | {_cpu(b)} | - | - |")
        if sunk is not None and sunk.name == b.name:
            lines.append(f"| the same, the burst sent to a bare sink instead | {_latency(sunk)} "
                         "| (the floor on this host) | - |")  # fmt: skip
            lines.append(f"| the sink's CPU per burst | {_cpu(sunk)} | - | - |")
        since_start = (b.rss_after_mb - start_rss_mb) / start_rss_mb
        lines.append(_row(f"gateway RSS before/after {b.name}",
                          f"{b.rss_before_mb:.0f} MB -> {b.rss_after_mb:.0f} MB "
                          f"({growth:+.1%}; {since_start:+.1%} since the probe's start)",
                          "at most +10%", growth <= 0.10))  # fmt: skip
        lines.append(_row(f"burst answers ({b.name})",
                          ", ".join(f"{k}: {v}" for k, v in sorted(b.statuses.items())),
                          "4xx", all(400 <= k < 500 for k in b.statuses)))  # fmt: skip
    rejected, refused, _ = slow
    lines.append(_row(f"normal requests answered 429 beside {slow_count} slow connections",
                      f"{rejected} (slow ones refused by the per-client cap: {refused})",
                      "0", rejected == 0))  # fmt: skip
    lines.append(_row("seconds from a stalled stream's last read to its pages freed",
                      f"{stall_s:.1f} s (--stream-stall-timeout {STALL_TIMEOUT_S:g})",
                      f"<= {STALL_TIMEOUT_S:g} s + buffer fill", True))  # fmt: skip
    lines.append(_row("5xx answers over the probe", str(five_xx), "0", five_xx == 0))
    return lines


def _text(chars: int) -> dict[str, object]:
    return {"prompt": ("hello world, " * (chars // 13 + 1))[:chars], "max_tokens": 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    parser.add_argument("--slow-connections", type=int, default=1000)
    parser.add_argument(
        "--rounds", type=int, default=3, help="idle requests, then a burst: this many times"
    )
    parser.add_argument("--log", type=Path, default=None, help="pd-cluster's output")
    parser.add_argument("--bursts-only", action="store_true", help="skip the other classes")
    parser.add_argument(
        "--sender-nice", type=int, default=0, help="niceness of the burst's sender processes"
    )
    parser.add_argument("--no-sink", action="store_true", help="skip the sink's baseline")
    args = parser.parse_args(argv)
    say: Callable[[str], None] = lambda line: print(line, flush=True)  # noqa: E731
    log = args.log or Path(tempfile.gettempdir()) / "hostile-probe-cluster.log"
    with cluster(args.model, log) as probe:
        say(f"cluster up: {probe.url}, gateway pid {probe.gateway_pid}, nodes {probe.nodes}")
        rounds, nice = args.rounds, args.sender_nice
        largest = "8 x 3.9 MB prompts"
        bursts = [
            burst(probe, largest, _text(3_900_000), rounds, nice),
            burst(probe, "8 x 600k-char prompts", _text(600_000), rounds, nice),
            # [[1], [1], ...]: one million prompts of one token id each, in 4 MB
            burst(probe, "8 x 4 MB batches of 1M prompts", {"prompt": [[1]] * 1_000_000,
                                                             "max_tokens": 1}, rounds, nice),
        ]  # fmt: skip
        sunk = None
        if not args.no_sink:
            with sink() as (url, pid):
                sunk = burst(probe, largest, _text(3_900_000), rounds, nice, url, pid)
        say("bursts done")
        slow, stall_s = (0, 0, 0), float("nan")
        if not args.bursts_only:
            slow = slow_connections(probe, args.slow_connections, normal=20)
            say("slow connections done")
            stall_s = stalled_stream(probe)
        five_xx = sum(v for k, v in probe.statuses.items() if k >= 500)
        lines = report(bursts, slow, stall_s, five_xx, args.slow_connections, sunk)
    command = ["python", "-m", "scripts.serving.hostile_probe", *sys.argv[1:]]
    say(f"command: {shlex.join(command)}")
    for line in lines:
        say(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
