"""The one launcher of server processes: `pd-cluster`, the end-to-end tests and the scripts use it.

`ServerProcess.start` runs a server (a console script with its flags, `--host` and `--port`
appended by the caller or by `running_node`) in a session of its own, its output either
appended to a log file (after a `$ command` line) or relayed line by line with a `[name]`
prefix (and copied raw to the log file, if any). `wait_ready` polls a readiness probe until it
says yes, the process exits or the timeout passes. Stopping is SIGTERM, a grace period, then
SIGKILL of the whole session: the process group and any member that left it, so that nothing
is left behind even when the server itself died first.

`running_node` is the context manager the tests and scripts use: a server on 127.0.0.1 and a
free port, ready on exit from `with`, stopped whatever happens; a server that lost the race for
its port is started again on another. `pd_trio` runs a bootstrap + prefill + decode trio of
them (the two nodes start side by side) and sends requests through it without a gateway
(gateway/dispatch/pd_client.py).

No torch here (the gateway package must not import it): only the standard library, grpc and
the generated stubs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

import grpc

from engine.ports import LOCALHOST, free_port
from gateway.dispatch.pd_client import PDResult, pd_generate
from gateway.routing.nodes import NodeTarget
from proto import bootstrap_pb2, bootstrap_pb2_grpc, node_pb2, node_pb2_grpc

# A server that lost the race for its port exits with this in its log; it is started again.
_PORT_IN_USE = "cannot listen on"
_PORT_ATTEMPTS = 3
_PR_SET_PDEATHSIG = 1
_READY_POLL_S = 0.2

# Returns True once the server behind the channel is ready; may raise grpc.RpcError before that.
ReadinessProbe = Callable[[grpc.Channel], bool]


class NodeStartError(RuntimeError):
    """The server exited or did not become ready in time; the message quotes its log."""


def console_script(name: str) -> str:
    """The console script installed next to the running interpreter (the project's venv)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: install the project (`make setup`)")
    return str(path)


def loopback_transports() -> None:
    """NIXL's UCX over loopback only and a quiet Mooncake, for this process and the servers it
    starts (they inherit the environment), unless the environment says otherwise."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def session_pids(session_id: int) -> list[int]:
    """Live members of a session (the leader included)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        fields = stat.rsplit(")", 1)[1].split()  # comm may hold spaces and parentheses
        if fields[0] != "Z" and int(fields[3]) == session_id:
            pids.append(int(entry.name))
    return pids


# ---- readiness probes ---------------------------------------------------------------------------
def node_healthy(channel: grpc.Channel) -> bool:
    """A prefill or decode node whose engine loop runs."""
    stub = node_pb2_grpc.NodeStub(channel)
    return bool(stub.Health(node_pb2.HealthRequest(), timeout=5).ok)


def node_registered(channel: grpc.Channel) -> bool:
    """A node that is healthy and has its node id from the bootstrap."""
    health = node_pb2_grpc.NodeStub(channel).Health(node_pb2.HealthRequest(), timeout=5)
    return bool(health.ok and health.node_id)


def bootstrap_ready(channel: grpc.Channel) -> bool:
    stub = bootstrap_pb2_grpc.BootstrapStub(channel)
    stub.ListNodes(bootstrap_pb2.ListNodesRequest(), timeout=5)
    return True


_Server = TypeVar("_Server", bound="ServerProcess")


# ---- one server process -------------------------------------------------------------------------
@dataclass
class ServerProcess:
    name: str
    process: subprocess.Popen[bytes]
    address: str  # host:port it serves on ("" when the caller did not say)
    log_path: Path | None = None
    _channel: grpc.Channel | None = None

    @classmethod
    def start(
        cls: type[_Server],
        name: str,
        command: Sequence[str],
        *,
        address: str = "",
        log_path: Path | None = None,
        relay: Callable[[str], None] | None = None,
        env: Mapping[str, str] | None = None,
        die_with_parent: bool = False,
        shown: str = "",
    ) -> _Server:
        """Run `command` in a new session. With `relay`, each output line goes to it prefixed
        with `[name]` (and raw to `log_path`); otherwise the output is appended to `log_path`
        after a `$ <shown or command>` line. `env` is the child's whole environment (default:
        ours); `die_with_parent` asks the kernel for SIGTERM when this process dies."""
        log = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log = log_path.open("ab")
            if relay is None:
                log.write(f"$ {shown or ' '.join(command)}\n".encode())
                log.flush()
        try:
            process = subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if relay is not None else (log or subprocess.DEVNULL),
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                start_new_session=True,  # our own signal order; the whole session can be killed
                preexec_fn=_die_with_parent if die_with_parent else None,
            )
        except BaseException:
            if log is not None:
                log.close()
            raise
        server = cls(name, process, address, log_path)
        if relay is not None:  # the relay thread owns the log from here
            threading.Thread(target=_relay, args=(server, relay, log), daemon=True).start()
        elif log is not None:
            log.close()  # the child holds its own descriptor
        return server

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return self._channel

    @property
    def stub(self) -> node_pb2_grpc.NodeStub:
        return node_pb2_grpc.NodeStub(self.channel)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_ready(self, probe: ReadinessProbe, timeout: float) -> None:
        """Poll `probe` until it says yes; returns early if the process exits (the caller looks
        at `alive`); TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.alive:
            try:
                if probe(self.channel):
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout:.0f} s")
            time.sleep(_READY_POLL_S)

    # ---- node API conveniences ---------------------------------------------------------------
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

    # ---- stopping ----------------------------------------------------------------------------
    def terminate(self) -> None:
        if self.alive:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> bool:
        """Whether the process exited within `timeout` seconds."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        return not self.alive

    def kill(self) -> int:
        """SIGKILL to the whole session (it may outlive a dead leader); returns the exit code."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in session_pids(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        code = self.process.wait()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        return code

    def stop(self, timeout: float) -> int:
        """SIGTERM, then SIGKILL of the session after `timeout` seconds; the exit code."""
        self.terminate()
        self.wait(timeout)
        return self.kill()


def _relay(server: ServerProcess, say: Callable[[str], None], log: IO[bytes] | None) -> None:
    """Copy a child's output to `say`, each line prefixed with its name (and raw to its log)."""
    assert server.process.stdout is not None
    with contextlib.ExitStack() as stack:
        if log is not None:
            stack.enter_context(log)
        for raw in server.process.stdout:
            if log is not None:
                log.write(raw)
                log.flush()
            say(f"[{server.name}] {raw.decode(errors='replace').rstrip()}")


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# ---- a node server for the length of a block ----------------------------------------------------
def _start_ready(
    command: list[str],
    log_path: Path,
    env: Mapping[str, str],
    probe: ReadinessProbe,
    ready_timeout: float,
    port: int | None,
) -> ServerProcess | None:
    """Start and wait for readiness; None if the port was taken meanwhile."""
    port = port or free_port()
    address = f"{LOCALHOST}:{port}"
    full = [*command, "--host", LOCALHOST, "--port", str(port)]
    name = Path(command[0]).name
    server = ServerProcess.start(name, full, address=address, log_path=log_path, env=env)
    try:
        server.wait_ready(probe, ready_timeout)
    except TimeoutError as exc:
        server.stop(10)
        raise NodeStartError(f"{command[0]}: {exc}; log tail:\n{server.log_tail()}") from None
    except BaseException:
        server.stop(10)
        raise
    if server.alive:
        return server
    server.stop(10)
    if _PORT_IN_USE in server.log_text().rsplit("$ ", 1)[-1]:
        return None
    raise NodeStartError(
        f"{command[0]} exited with code {server.process.returncode} before it was ready; "
        f"log tail:\n{server.log_tail()}"
    )


@contextlib.contextmanager
def running_node(
    script: str,
    args: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    ready_timeout: float = 120.0,
    stop_timeout: float = 30.0,
    probe: ReadinessProbe = node_healthy,
    port: int | None = None,
) -> Iterator[ServerProcess]:
    """Run `script args --host 127.0.0.1 --port <free>` until the block ends, whatever happens.

    `script` is a console script name (`decode-server`) or a path; `env` adds to (or overrides)
    this process's environment; `port` fixes the port (a process started again after a crash
    keeps its address). The block may stop the server itself (for example to test
    SIGTERM); stopping an exited server does nothing.
    """
    command = [console_script(script) if os.sep not in script else script, *args]
    server = None
    for _ in range(_PORT_ATTEMPTS):
        server = _start_ready(
            command, log_path, {**os.environ, **(env or {})}, probe, ready_timeout, port
        )
        if server is not None:
            break
    if server is None:
        raise NodeStartError(f"{script}: no free port after {_PORT_ATTEMPTS} attempts")
    try:
        yield server
    finally:
        server.stop(stop_timeout)


_T = TypeVar("_T")


def enter_together(
    stack: contextlib.ExitStack, managers: Sequence[contextlib.AbstractContextManager[_T]]
) -> list[_T]:
    """Enter `managers` at once, each in a thread (servers that start side by side: the nodes
    of a trio only wait for the bootstrap), their exits on `stack`; if one fails, the others
    that started are exited too (by `stack`) and its error raised."""
    with concurrent.futures.ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
    entered: list[_T] = []
    errors: list[BaseException] = []
    for manager, future in zip(managers, futures, strict=True):
        error = future.exception()
        if error is not None:
            errors.append(error)
            continue
        stack.push(manager.__exit__)
        entered.append(future.result())
    if errors:
        raise errors[0]
    return entered


# ---- a bootstrap + prefill + decode trio --------------------------------------------------------
@dataclass
class PDTrio:
    bootstrap: ServerProcess
    prefill: ServerProcess
    decode: ServerProcess
    prefill_id: str
    decode_id: str

    def generate(
        self, input_ids: list[int], sampling: node_pb2.SamplingParams, room: int | None = None
    ) -> PDResult:
        return asyncio.run(self.generate_async(input_ids, sampling, room))

    async def generate_async(
        self,
        input_ids: list[int],
        sampling: node_pb2.SamplingParams,
        room: int | None = None,
        through_prefill: bool = True,
    ) -> PDResult:
        """One request; `through_prefill=False` lets the decode node prefill it itself."""
        async with (
            grpc.aio.insecure_channel(self.decode.address) as d_chan,
            grpc.aio.insecure_channel(self.prefill.address) as p_chan,
        ):
            decode = NodeTarget(self.decode_id, node_pb2_grpc.NodeStub(d_chan))
            prefill = NodeTarget(self.prefill_id, node_pb2_grpc.NodeStub(p_chan))
            return await pd_generate(
                decode, prefill if through_prefill else None, input_ids, sampling, room
            )

    def generate_many(
        self, prompts: Sequence[list[int]], sampling: node_pb2.SamplingParams
    ) -> list[PDResult]:
        async def run() -> list[PDResult]:
            return list(await asyncio.gather(*(self.generate_async(p, sampling) for p in prompts)))

        return asyncio.run(run())

    def check_no_leaks(self) -> None:
        for node in (self.prefill, self.decode):
            report = node.wait_idle()
            assert report.ok, f"{node.address}: {report.error}"
            assert report.used_pages == 0, f"{node.address}: {report.used_pages} pages leaked"


@contextlib.contextmanager
def pd_trio(
    log_dir: Path,
    model: Path | str,
    backend: str,
    node_args: Sequence[str] = (),
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    bootstrap_args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    ready_timeout: float = 120.0,
    scripts: Mapping[str, str] | None = None,
) -> Iterator[PDTrio]:
    """A bootstrap-server, a prefill-server and a decode-server (`--mode disaggregated`) of
    `model` over the `backend` transfer engine, each on a free port with its log in `log_dir`;
    ready once both nodes are registered. `node_args` go to both nodes; `scripts` maps a console
    script name to another command (a wrapper, where the project is not installed)."""
    loopback_transports()
    scripts = scripts or {}
    with contextlib.ExitStack() as stack:

        def node(
            name: str, args: Sequence[str], probe: ReadinessProbe, timeout: float
        ) -> contextlib.AbstractContextManager[ServerProcess]:
            script = scripts.get(f"{name}-server", f"{name}-server")
            log_path = log_dir / f"{name}.log"
            return running_node(script, args, log_path, env=env, probe=probe, ready_timeout=timeout)

        bootstrap = stack.enter_context(node("bootstrap", bootstrap_args, bootstrap_ready, 120.0))
        common = ["--model", str(model), "--bootstrap", bootstrap.address]
        common += ["--transfer-backend", backend, *node_args]
        decode_all = ["--mode", "disaggregated", *common, *decode_args]
        prefill, decode = enter_together(
            stack,
            [
                node("prefill", [*common, *prefill_args], node_registered, ready_timeout),
                node("decode", decode_all, node_registered, ready_timeout),
            ],
        )
        ids = [
            server.stub.Health(node_pb2.HealthRequest(), timeout=5).node_id
            for server in (prefill, decode)
        ]
        yield PDTrio(bootstrap, prefill, decode, ids[0], ids[1])
