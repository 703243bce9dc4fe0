"""Run a node server (decode-server, prefill-server, bootstrap-server, ...) as a real subprocess.

End-to-end tests start the console script exactly as an operator would: on 127.0.0.1, on a free
port, with stdout and stderr going to a log file that failures quote. `running_node` waits until
the server answers its readiness probe (the node API's `Health` by default) and always stops it
afterwards: SIGTERM, then SIGKILL if it has not exited within the stop timeout.

The server runs in its own session (`start_new_session`), so `session_pids` can tell whether
it left any process behind, grandchildren included, after it exited.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import grpc

from proto import node_pb2, node_pb2_grpc
from scripts.serving.probes import session_pids

LOCALHOST = "127.0.0.1"
# A server that lost the race for its port exits with this in its log; it is started again.
_PORT_IN_USE = "cannot listen on"
_PORT_ATTEMPTS = 3

# Returns True once the server behind the channel is ready; may raise grpc.RpcError before that.
ReadinessProbe = Callable[[grpc.Channel], bool]


class NodeStartError(RuntimeError):
    """The server exited or did not become ready in time; the message quotes its log."""


def node_health_probe(channel: grpc.Channel) -> bool:
    stub = node_pb2_grpc.NodeStub(channel)
    return bool(stub.Health(node_pb2.HealthRequest(), timeout=5).ok)


@dataclass
class NodeServer:
    process: subprocess.Popen[bytes]
    address: str
    channel: grpc.Channel
    stub: node_pb2_grpc.NodeStub
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def integrity(self) -> node_pb2.CheckIntegrityResponse:
        return self.stub.CheckIntegrity(node_pb2.CheckIntegrityRequest(), timeout=30)

    def wait_idle(self, timeout: float = 60.0) -> node_pb2.CheckIntegrityResponse:
        """Poll until no request runs or waits and no page is in use; returns the last check."""
        deadline = time.monotonic() + timeout
        while True:
            load = self.stub.GetLoad(node_pb2.GetLoadRequest(), timeout=30)
            check = self.integrity()
            idle = load.running_requests == 0 and load.queued_requests == 0
            if idle and check.used_pages == 0:
                return check
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"server not idle after {timeout:.0f} s: {load} {check}\n{self.log_tail()}"
                )
            time.sleep(0.1)


def free_port() -> int:
    """A port that was free a moment ago (the kernel picks it; the caller retries on a clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOCALHOST, 0))
        return int(sock.getsockname()[1])


def console_script(name: str) -> str:
    """The console script installed next to the running interpreter (the project's venv)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: install the project (`make setup`)")
    return str(path)


def stop_process(process: subprocess.Popen[bytes], timeout: float) -> int:
    """SIGTERM, then SIGKILL after `timeout` seconds; returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait(timeout)


def _kill_leftovers(session_id: int) -> None:
    for pid in session_pids(session_id):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_ready(
    process: subprocess.Popen[bytes],
    channel: grpc.Channel,
    probe: ReadinessProbe,
    timeout: float,
) -> None:
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        try:
            if probe(channel):
                return
        except grpc.RpcError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout:.0f} s")
        time.sleep(0.2)


def _start_once(
    command: list[str],
    log_path: Path,
    env: Mapping[str, str] | None,
    probe: ReadinessProbe,
    ready_timeout: float,
    port: int | None = None,
) -> NodeServer | None:
    """Start and wait for readiness; None if the port was taken meanwhile."""
    port = port or free_port()
    address = f"{LOCALHOST}:{port}"
    with log_path.open("ab") as log:
        log.write(f"$ {' '.join(command)} --host {LOCALHOST} --port {port}\n".encode())
        log.flush()
        process = subprocess.Popen(
            [*command, "--host", LOCALHOST, "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    channel = grpc.insecure_channel(address)
    server = NodeServer(process, address, channel, node_pb2_grpc.NodeStub(channel), log_path)
    try:
        _wait_ready(process, channel, probe, ready_timeout)
    except TimeoutError as exc:
        _shutdown(server, stop_timeout=10)
        raise NodeStartError(f"{command[0]}: {exc}; log tail:\n{server.log_tail()}") from None
    except BaseException:
        _shutdown(server, stop_timeout=10)
        raise
    if process.poll() is None:
        return server
    _shutdown(server, stop_timeout=10)
    if _PORT_IN_USE in server.log_text().rsplit("$ ", 1)[-1]:
        return None
    raise NodeStartError(
        f"{command[0]} exited with code {process.returncode} before it was ready; "
        f"log tail:\n{server.log_tail()}"
    )


def _shutdown(server: NodeServer, stop_timeout: float) -> None:
    server.channel.close()
    try:
        stop_process(server.process, stop_timeout)
    finally:
        _kill_leftovers(server.pid)


@contextmanager
def running_node(
    script: str,
    args: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    ready_timeout: float = 120.0,
    stop_timeout: float = 30.0,
    probe: ReadinessProbe = node_health_probe,
    port: int | None = None,
) -> Iterator[NodeServer]:
    """Run `script args --host 127.0.0.1 --port <free>` until the block ends, whatever happens.

    `script` is a console script name (`decode-server`) or a path; `env` adds to (or overrides)
    this process's environment; `port` fixes the port (a process started again after a crash
    keeps its address). The block may stop the server itself (for example to test
    SIGTERM); stopping an exited server does nothing.
    """
    command = [console_script(script) if os.sep not in script else script, *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = None
    for _ in range(_PORT_ATTEMPTS):
        server = _start_once(command, log_path, env, probe, ready_timeout, port)
        if server is not None:
            break
    if server is None:
        raise NodeStartError(f"{script}: no free port after {_PORT_ATTEMPTS} attempts")
    try:
        yield server
    finally:
        _shutdown(server, stop_timeout)
