"""`pd-cluster`: a whole local cluster in one command, for trying pdserve and for tests.

Starts, on 127.0.0.1 with free ports: a bootstrap-server, `--prefill N` prefill-servers,
`--decode M` decode-servers (disaggregated) and a gateway-server (`--gateways N`: N of them on
the one bootstrap, named gateway-0.., each printed with its URL); waits until every gateway's
/health is 200 with every node registered; prints the base URL, a curl example and where each
process serves its Prometheus metrics (the bootstrap and every node get a free `--metrics-port`;
the gateway serves /metrics on its API port: one `[pd-cluster] metrics <name> <url>` line each,
for scrape configs and tests); streams the
children's logs with a `[name]` prefix. On Ctrl-C / SIGTERM, or when the bootstrap or the
gateway dies, it stops everything: SIGTERM to each child (gateway first, bootstrap last), SIGKILL
after the grace period, and a kill of each child's whole session (gateway/process/launcher.py), so
nothing is left behind even if a child died or left processes of its own. Children also get
SIGTERM from the kernel if pd-cluster itself is killed (PR_SET_PDEATHSIG).

SIGHUP (`kill -HUP <pd-cluster pid>`) is the upgrade command: a rolling restart of every child,
one at a time (`rolling_restart`): each gets SIGTERM and drains (a node finishes or hands over its
requests, a gateway its streams), is started again on the same ports, and the next one waits
until every gateway routes to the whole cluster again.

Internal gRPC security (`--internal-token-file`, `--tls-*`, see bootstrap/security.py) is passed
to every child by the same flags; a token given by value (`--internal-token` or the environment)
reaches the children through their environment, never their argv. `--room-key-file` goes to the
bootstrap and the gateway only (the nodes must not hold it: bootstrap/security.py, RoomTickets).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from bootstrap.security import (
    TOKEN_ENV,
    add_internal_auth_args,
    add_room_key_arg,
    internal_auth_argv,
    internal_auth_from_args,
    room_tickets_from_args,
)
from bootstrap.telemetry import add_log_args
from engine.ports import LOCALHOST as HOST
from engine.ports import free_port
from gateway.config import MAX_WORKERS
from gateway.process.cpus import allowed_cpus, worker_cpus
from gateway.process.launcher import ServerProcess, console_script, loopback_transports

_POLL_S = 0.25
_CPUS_FLAG = "--gateway-worker-cpus"


@dataclass(frozen=True)
class ClusterConfig:
    prefill: int
    decode: int
    backend: str
    model: str | None
    port: int  # gateway port; 0: a free one
    max_total_tokens: int
    node_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    gateway_workers: int = 1  # gateway-server --workers
    gateway_worker_cpus: str = ""  # gateway-server --worker-cpus (checked; "": unpinned)
    gateways: int = 1  # gateway-servers on the one bootstrap, each on its own port
    ready_timeout_s: float = 600.0
    stop_grace_s: float = 15.0
    log_dir: Path | None = None
    log_args: tuple[str, ...] = ()  # --log-level / --log-format for every child
    auth_args: tuple[str, ...] = ()  # internal token file and TLS flags for every child
    internal_token: str = field(default="", repr=False)  # by value: to the children's env
    room_key_args: tuple[str, ...] = ()  # --room-key-file for the bootstrap and the gateway
    devices: tuple[str, ...] = ()  # `--device` of each node in turn, prefill nodes first
    kv_stream_layers: int = 0  # the prefill nodes' --kv-stream-layers (0: off)


@dataclass(frozen=True)
class ChildSpec:
    """How a child was started: what a rolling restart starts again, on the same ports."""

    name: str
    script: str
    args: tuple[str, ...]
    port: int
    metrics_port: int = 0  # 0: no --metrics-port


@dataclass
class Child(ServerProcess):
    essential: bool = False  # its death takes the cluster down
    metrics_url: str = ""
    reported_exit: bool = False
    spec: ChildSpec | None = None


@dataclass
class Cluster:
    config: ClusterConfig
    out: IO[str] = field(default_factory=lambda: sys.stdout)
    children: list[Child] = field(default_factory=list)
    _role_args: dict[str, list[str]] = field(default_factory=dict)  # a node's flags, by role
    _devices: dict[str, list[str]] = field(default_factory=dict)  # node name -> its --device
    _freed_devices: list[list[str]] = field(default_factory=list)  # of stopped nodes, for new
    _print_lock: threading.Lock = field(default_factory=threading.Lock)

    def say(self, line: str) -> None:
        with self._print_lock:
            self.out.write(line + "\n")
            self.out.flush()

    def start(self, stop: threading.Event) -> str:
        """Start every process and wait until the gateway is healthy; returns its base URL."""
        c = self.config
        bootstrap = self._spawn(
            "bootstrap", "bootstrap-server", [*c.room_key_args], essential=True, metrics=True
        )
        common = ["--bootstrap", bootstrap.address, "--transfer-backend", c.backend]
        common += ["--max-total-tokens", str(c.max_total_tokens), *self._model_args()]
        common += list(c.node_args)
        self._role_args = {
            "prefill": [*common, *self._stream_args(), *c.prefill_args],
            "decode": ["--mode", "disaggregated", *common, *c.decode_args],
        }
        devices = node_devices(c)
        for i in range(c.prefill):
            self._devices[f"prefill-{i}"] = devices[i]
            args = [*self._role_args["prefill"], *devices[i]]
            self._spawn(f"prefill-{i}", "prefill-server", args, metrics=True)
        for i in range(c.decode):
            self._devices[f"decode-{i}"] = devices[c.prefill + i]
            args = [*self._role_args["decode"], *devices[c.prefill + i]]
            self._spawn(f"decode-{i}", "decode-server", args, metrics=True)
        gateway_args = ["--bootstrap", bootstrap.address, *self._model_args(), *c.room_key_args]
        gateway_args += ["--workers", str(c.gateway_workers), *c.gateway_args]
        gateway_args += ["--worker-cpus", c.gateway_worker_cpus] if c.gateway_worker_cpus else []
        for i in range(c.gateways):
            name = "gateway" if c.gateways == 1 else f"gateway-{i}"
            # One gateway is essential; of several, the others serve on when one dies.
            port = c.port if i == 0 else 0
            gateway = self._spawn(name, "gateway-server", gateway_args, c.gateways == 1, port)
            gateway.metrics_url = f"http://{gateway.address}/metrics"
        urls = self.gateway_urls()
        for url in urls:
            self._wait_healthy(url, stop)
        return urls[0]

    def _stream_args(self) -> list[str]:
        groups = self.config.kv_stream_layers
        return ["--kv-stream-layers", str(groups)] if groups else []

    def gateways(self) -> list[Child]:
        return [c for c in self.children if c.name.startswith("gateway")]

    def gateway_urls(self) -> list[str]:
        return [f"http://{g.address}" for g in self.gateways()]

    def live_nodes(self, role: str) -> list[Child]:
        """The running nodes of `role` ("prefill" or "decode"), oldest first."""
        return [c for c in self.children if c.name.startswith(f"{role}-") and c.alive]

    def add_node(self, role: str, extra_args: Sequence[str] = ()) -> Child:
        """Start one more node of `role` with the flags its peers got (after `start`) and
        `extra_args` (later flags win), on the device of a node stopped before if any; it
        registers with the bootstrap and the gateway routes to it once it is up."""
        index = sum(1 for c in self.children if c.name.startswith(f"{role}-"))
        name = f"{role}-{index}"
        self._devices[name] = self._freed_devices.pop(0) if self._freed_devices else []
        args = [*self._role_args[role], *self._devices[name], *extra_args]
        return self._spawn(name, f"{role}-server", args, metrics=True)

    def remove_node(self, role: str) -> Child | None:
        """Stop the newest running node of `role`: SIGTERM (it finishes its in-flight work and
        deregisters), then a kill after the stop grace. None when there is none."""
        nodes = self.live_nodes(role)
        if not nodes:
            return None
        child = nodes[-1]
        child.reported_exit = True  # a planned stop: `watch` does not report it as a death
        child.terminate()
        if not child.wait(self.config.stop_grace_s):
            self.say(f"[pd-cluster] {child.name} did not stop: killing it")
        child.kill()
        if self._devices.get(child.name):
            self._freed_devices.append(self._devices[child.name])
        return child

    def metrics_lines(self) -> list[str]:
        return [f"[pd-cluster] metrics {c.name} {c.metrics_url}" for c in self.children]

    def _model_args(self) -> list[str]:
        return ["--model", self.config.model] if self.config.model else []

    def _spawn(
        self,
        name: str,
        script: str,
        args: list[str],
        essential: bool = False,
        port: int = 0,
        metrics: bool = False,
    ) -> Child:
        spec = ChildSpec(
            name, script, tuple(args), port or free_port(), free_port() if metrics else 0
        )
        child = self._launch(spec)
        child.essential = essential
        self.children.append(child)
        return child

    def _launch(self, spec: ChildSpec) -> Child:
        try:
            executable = console_script(spec.script)
        except FileNotFoundError as exc:
            raise ClusterError(str(exc)) from None
        command = [executable, *self.config.log_args, *self.config.auth_args, *spec.args]
        command += ["--host", HOST]
        command += ["--port", str(spec.port)]
        if spec.metrics_port:
            command += ["--metrics-port", str(spec.metrics_port)]
        self.say(f"[pd-cluster] starting {spec.name}: {shlex.join(command)}")
        log_dir = self.config.log_dir
        child = Child.start(
            spec.name,
            command,
            address=f"{HOST}:{spec.port}",
            log_path=log_dir / f"{spec.name}.log" if log_dir is not None else None,
            relay=self.say,
            env=self._child_env(),
            die_with_parent=True,
        )
        child.spec = spec
        if spec.metrics_port:
            child.metrics_url = f"http://{HOST}:{spec.metrics_port}/metrics"
        return child

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.config.internal_token:
            env[TOKEN_ENV] = self.config.internal_token
        return env

    def _wait_healthy(
        self, url: str, stop: threading.Event, required: list[Child] | None = None
    ) -> None:
        """Until the gateway at `url` routes to every node; ClusterError if one of `required`
        (default: every child) died meanwhile."""
        c = self.config
        deadline = time.monotonic() + c.ready_timeout_s
        want = {"prefill": c.prefill, "decode": c.decode}
        while not stop.is_set():
            dead = [child for child in required or self.children if not child.alive]
            if dead:
                raise ClusterError(f"{dead[0].name} exited with code {dead[0].process.returncode}")
            health = _get_json(url + "/health")
            # "ok": every gateway worker serves (gateway/process/workers.py), and the nodes are
            # known
            counts = health is not None and all(health.get(k) == n for k, n in want.items())
            if counts and health is not None and health.get("status") == "ok":
                return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"not healthy after {c.ready_timeout_s:.0f} s (last /health: {health})"
                )
            time.sleep(_POLL_S)
        raise ClusterError("interrupted while starting")

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if not c.alive]

    def watch(self, stop: threading.Event, restart: threading.Event | None = None) -> int:
        """Until asked to stop, an essential child dies or every gateway did; returns the exit
        code to use. When `restart` is set (SIGHUP), restarts every child, one at a time."""
        while not stop.wait(_POLL_S):
            if restart is not None and restart.is_set():
                restart.clear()
                rolling_restart(self, stop)
            for child in self.dead_children():
                if child.reported_exit:
                    continue
                child.reported_exit = True
                self.say(f"[pd-cluster] {child.name} exited with code {child.process.returncode}")
                if child.essential or not any(g.alive for g in self.gateways()):
                    return 1
        return 0

    def restart(self, child: Child, stop: threading.Event) -> None:
        """SIGTERM `child` (a node drains, a gateway finishes its streams), start it again on
        the same ports and wait until every gateway routes to the whole cluster again."""
        assert child.spec is not None
        self.say(f"[pd-cluster] restarting {child.name}")
        child.terminate()
        if not child.wait(self.config.stop_grace_s + DRAIN_ALLOWANCE_S):
            self.say(f"[pd-cluster] {child.name} did not stop: killing it")
        child.kill()
        fresh = self._launch(child.spec)
        fresh.essential, fresh.metrics_url = child.essential, child.metrics_url
        self.children[self.children.index(child)] = fresh
        for gateway in self.gateways():
            if gateway.alive:  # a gateway that died before is started again in its turn
                self._wait_healthy(f"http://{gateway.address}", stop, [fresh])
        self.say(f"[pd-cluster] restarted {child.name} (exit code {child.process.returncode})")

    def stop(self) -> None:
        """Stop every child (gateway first, bootstrap last); kill what does not stop."""
        # Gateway first (no new work reaches the nodes), bootstrap last (nodes deregister).
        gateways = self.gateways()
        phases = [
            gateways,
            [c for c in self.children if c not in gateways and c.name != "bootstrap"],
            [c for c in self.children if c.name == "bootstrap"],
        ]
        for phase in phases:
            for child in phase:
                child.terminate()
            deadline = time.monotonic() + self.config.stop_grace_s
            for child in phase:
                if not child.wait(max(deadline - time.monotonic(), 0.1)):
                    self.say(f"[pd-cluster] {child.name} did not stop: killing it")
                child.kill()  # the whole session, grandchildren included


def node_devices(config: ClusterConfig) -> list[list[str]]:
    """Each node's `--device` flag (prefill nodes, then decode nodes), the devices taken in
    turn; none without `--devices`. Appended after the other node flags, so it wins."""
    nodes = config.prefill + config.decode
    if not config.devices:
        return [[] for _ in range(nodes)]
    return [["--device", config.devices[i % len(config.devices)]] for i in range(nodes)]


class ClusterError(RuntimeError):
    """The cluster could not start; the message names the process or the wait that failed."""


# A child's SIGTERM drain takes at most its --drain-timeout (5 s nodes, 20 s gateways) beyond
# the stop grace; a rolling restart waits this much longer before it kills one.
DRAIN_ALLOWANCE_S = 30.0
BOOTSTRAP_SETTLE_S = 3.0  # nodes heartbeat every second; NOT_FOUND makes them register again


def rolling_restart(cluster: Cluster, stop: threading.Event) -> None:
    """Restart every child, one at a time, for an upgrade with no failed request: prefill
    nodes, decode nodes (each drains: its streams finish or move), the bootstrap (on its
    address; the nodes register again), then the gateways (each finishes its streams; with
    several, the others serve meanwhile)."""
    order = ["prefill", "decode", "bootstrap", "gateway"]
    # What died before (e.g. one of several gateways) is started first: it serves meanwhile.
    children = sorted(cluster.children, key=lambda c: (c.alive, order.index(c.name.split("-")[0])))
    cluster.say(f"[pd-cluster] rolling restart of {len(children)} processes")
    for child in children:
        if stop.is_set():
            return
        cluster.restart(child, stop)
        if child.name == "bootstrap":  # the gateways kept their tables; the nodes rejoin at
            time.sleep(BOOTSTRAP_SETTLE_S)  # their next heartbeat
    cluster.say("[pd-cluster] rolling restart done")


def _get_json(url: str) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as exc:  # 503 while no decode node is up: still JSON
        with contextlib.suppress(ValueError):
            return json.loads(exc.read())  # type: ignore[no-any-return]
        return None
    except (OSError, ValueError):
        return None


def banner(url: str, model: str) -> str:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
    )
    return "\n".join(
        [
            f"[pd-cluster] ready: {url}",
            f"[pd-cluster] OpenAI-compatible API at {url}/v1 (model {model!r})",
            "[pd-cluster] try:",
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
            "[pd-cluster] Ctrl-C stops the cluster",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=1, help="prefill nodes (0: colocated)")
    parser.add_argument("--decode", type=int, default=1, help="decode nodes")
    parser.add_argument(
        "--transfer-backend", default="mooncake", choices=["mooncake", "nixl", "cuda_ipc"]
    )
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M)")
    parser.add_argument("--port", type=int, default=0, help="gateway port (default: a free one)")
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="KV tokens per node")
    parser.add_argument("--node-args", default="", help="extra flags for every node (quoted)")
    parser.add_argument("--prefill-args", default="", help="extra flags for prefill nodes")
    parser.add_argument("--decode-args", default="", help="extra flags for decode nodes")
    parser.add_argument("--gateway-args", default="", help="extra flags for the gateway")
    parser.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway-servers on the one bootstrap, each on its own port (the first on --port) "
        "and printed with its URL; with several, one dying leaves the others serving",
    )
    parser.add_argument(
        "--gateway-workers", type=int, default=1, help="gateway processes on its port"
    )
    parser.add_argument(
        "--gateway-worker-cpus",
        default="",
        metavar="LIST",
        help="gateway-server --worker-cpus: gateway worker i on CPU LIST[i mod len(LIST)] "
        "(Linux cpulist, e.g. 0-3; fewer CPUs than workers: they share; with --gateways N "
        "every gateway uses the same list)",
    )
    parser.add_argument(
        "--devices",
        default="",
        help="comma-separated devices given to the nodes in turn, prefill nodes first "
        "(e.g. cuda:0,cuda:1: one GPU a node); a TP node on cuda:b takes b..b+tp-1",
    )
    parser.add_argument(
        "--kv-stream-layers",
        type=int,
        default=0,
        metavar="G",
        help="the prefill nodes write each chunk's KV in G layer groups as they are computed "
        "(prefill-server --kv-stream-layers); 0 = after each chunk's forward",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds")
    parser.add_argument("--log-dir", type=Path, default=None, help="also write <name>.log here")
    add_log_args(parser)
    add_internal_auth_args(parser)
    add_room_key_arg(parser)
    return parser


def build_config(args: argparse.Namespace) -> ClusterConfig:
    if args.prefill < 0 or args.decode < 1:
        raise ValueError("--prefill must be >= 0 and --decode >= 1")
    if args.kv_stream_layers < 0:
        raise ValueError(f"--kv-stream-layers must be >= 0 (0: off), got {args.kv_stream_layers}")
    if args.gateways < 1:
        raise ValueError(f"--gateways must be >= 1, got {args.gateways}")
    if not 1 <= args.gateway_workers <= MAX_WORKERS:
        raise ValueError(
            f"--gateway-workers must be in [1, {MAX_WORKERS}], got {args.gateway_workers}"
        )
    if args.gateway_worker_cpus.strip():  # a bad list fails here, not in the gateway's log
        worker_cpus(args.gateway_worker_cpus, allowed_cpus(_CPUS_FLAG), _CPUS_FLAG)
    auth = internal_auth_from_args(args)  # reads the files now: a bad path fails here
    room_tickets_from_args(args)
    return ClusterConfig(
        prefill=args.prefill,
        decode=args.decode,
        backend=args.transfer_backend,
        model=args.model,
        port=args.port,
        max_total_tokens=args.max_total_tokens,
        node_args=tuple(shlex.split(args.node_args)),
        prefill_args=tuple(shlex.split(args.prefill_args)),
        decode_args=tuple(shlex.split(args.decode_args)),
        gateway_args=tuple(shlex.split(args.gateway_args)),
        gateway_workers=args.gateway_workers,
        gateway_worker_cpus=args.gateway_worker_cpus.strip(),
        gateways=args.gateways,
        ready_timeout_s=args.ready_timeout,
        log_dir=args.log_dir,
        log_args=("--log-level", args.log_level, "--log-format", args.log_format),
        auth_args=tuple(internal_auth_argv(args)),
        internal_token="" if args.internal_token_file else auth.token,
        room_key_args=("--room-key-file", args.room_key_file) if args.room_key_file else (),
        devices=parse_devices(args.devices),
        kv_stream_layers=args.kv_stream_layers,
    )


def parse_devices(text: str) -> tuple[str, ...]:
    devices = tuple(d.strip() for d in text.split(",") if d.strip())
    bad = [d for d in devices if d != "cpu" and not re.fullmatch(r"cuda(:\d+)?", d)]
    if bad:
        raise ValueError(f"--devices: {bad[0]!r} is not cpu, cuda or cuda:N")
    return devices


def _served_name(config: ClusterConfig, url: str) -> str:
    models = _get_json(url + "/v1/models") or {}
    data = models.get("data")
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return str(data[0].get("id", ""))
    return Path(config.model or "model").name


def run(config: ClusterConfig, on_ready: Callable[[str], None] | None = None) -> int:
    loopback_transports()
    stop = threading.Event()
    restart = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: restart.set())
    cluster = Cluster(config)
    try:
        url = cluster.start(stop)
        cluster.say(banner(url, _served_name(config, url)))
        for child, gateway_url in zip(cluster.gateways(), cluster.gateway_urls(), strict=True):
            cluster.say(f"[pd-cluster] gateway {child.name} {gateway_url}")
        for line in cluster.metrics_lines():
            cluster.say(line)
        if on_ready is not None:
            on_ready(url)
        code = cluster.watch(stop, restart)
    except ClusterError as exc:
        cluster.say(f"[pd-cluster] error: {exc}")
        code = 1
    cluster.say("[pd-cluster] stopping")
    cluster.stop()
    cluster.say("[pd-cluster] stopped")
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = build_config(args)
    except ValueError as exc:
        print(f"pd-cluster: {exc}", file=sys.stderr)
        return 2
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
