"""`gateway-server --workers N`: N gateway processes serving one port.

Why SO_REUSEPORT rather than one listening socket shared by the workers: each worker binds its
own listener on the same address and the kernel spreads new connections over them by a hash
of the connection, so no worker can starve the others by winning every wake-up on a shared
accept queue (the epoll imbalance of pre-forked servers), and no descriptor has to be passed
to a spawned process. The kernel admits only processes of the same user into the group. The
supervisor binds the address first and keeps it bound without listening (a bound socket takes
no connection): a port taken by another program fails at once with a clear error, and
`--port 0` resolves to one port that every worker then joins. The cost: connections waiting in
the accept queue of a worker that crashes are reset, and the spread is per connection, not per
request (a client that keeps one connection stays on one worker), and the hash ignores load: a
closed-loop client piles its streams onto a worker that gets less CPU. `--worker-listen shared`
is the other way: the supervisor binds and listens once and hands the socket to every worker
(as uvicorn's `--workers` and vLLM's `--api-server-count` do), so each connection goes to the
worker that accepts first, and a busy worker accepts later.

Every worker is a whole gateway (app.py): it loads the tokenizer, follows the bootstrap's node
events itself (so its routing table is always the one discovery describes, with no state shared
between processes) and keeps its own per-node in-flight counts, prefix table and
`--max-inflight` budget (the limits are per worker). A later feed such as the nodes' KV-cache
events for a prefix index belongs in the same place as the discovery watch, the app's lifespan:
each worker subscribes on its own and holds a full index, exactly as it holds the full node
table now. Metrics are merged over the workers (gateway/metrics.py). Each worker is told its
index (0..N-1 in `GatewayConfig.worker_index`; a replacement takes its predecessor's): the
`worker_affinity` routing policy pins a worker to one node by it, and
`pdserve_gateway_worker_node_requests` counts each worker's requests per node by it.

The supervisor starts the workers with the `spawn` start method (a fresh interpreter: no forked
gRPC or event-loop state), waits until every one serves, and then watches them: a worker that
crashes after it served is reported and started again; one that dies before it ever served
(bad model directory, address unusable) stops the whole gateway with exit code 1. SIGTERM or
SIGINT stops the workers gracefully (uvicorn lets open requests finish), then kills what is
left. Workers ask the kernel for SIGTERM when the supervisor dies, however it dies.

`--worker-cpus LIST` pins worker i to CPU LIST[i % len(LIST)] (gateway/process/cpus.py): the worker
sets its affinity as the first thing it does, before it starts any thread, and a replacement
takes its predecessor's index and so its CPU. The supervisor itself stays unpinned (it only
waits). Unpinned workers on a busy 32-core host paid 31-37 µs of CPU per streamed token each
against 22 µs for a lone worker; pinned, 23-30 µs
(benchmarks/gpu-2026-11-26-gateway-spread-h100.md).

Readiness is the whole gateway's: every worker's /health answers 503 "starting" until every
worker has served once (the supervisor then sets an event all of them read). The kernel spreads
connections over the listeners that exist, so load sent while some workers are still starting
lands on the others only, and long streams keep it there: on the 32-core host two of four
workers got the whole first wave of 2,048 streams (~1,000 each, the other two none) and four
workers streamed 2.05x one instead of 3.04x (benchmarks/gpu-2026-11-26-gateway-workers-h100.md,
read with scripts/bench/gateway_cpu.py's per-worker table). Workers come up 0.4-1.1 s apart on
the 2-core test host. A worker started in place of a crashed one does not close the gate: the
others serve meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event
from types import FrameType

from bootstrap.telemetry import LogConfig, configure_logging
from gateway.config import GatewayConfig
from gateway.metrics import MULTIPROCESS_ENV
from gateway.process.cpus import pin_this_process

logger = logging.getLogger("pdserve.gateway.workers")

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5
_STOP_GRACE_S = 10.0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT (not listening yet)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port}: {exc.strerror}; the port is in use by another "
            "program or the host is not local: choose another --port"
        ) from None
    return sock


SHARED_BACKLOG = 4096  # the one accept queue of --worker-listen shared (the kernel caps it)


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port for every worker to accept from (`shared`)."""
    sock = reuse_port_socket(host, port)  # the same bind and error as the reuseport mode
    sock.listen(SHARED_BACKLOG)
    return sock


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is started with (pickled to the spawned interpreter)."""

    config: GatewayConfig
    log: LogConfig
    index: int
    metrics_dir: str
    supervisor_pid: int


def worker_main(
    spec: WorkerSpec, ready: Event, all_serving: Event, shared: socket.socket | None = None
) -> None:
    """A worker's whole life (in the spawned process): serve until SIGTERM. `ready`: set by
    this worker once it serves; `all_serving`: set by the supervisor once every worker has;
    `shared`: the supervisor's listener (`--worker-listen shared`), else the worker binds its
    own with SO_REUSEPORT."""
    _die_with_supervisor(spec.supervisor_pid)
    config = spec.config
    if config.cpu is not None:  # first: every thread started from here on inherits it
        pin_this_process(config.cpu)
    configure_logging(spec.log)
    from gateway.process.server import serve
    from gateway.requests.text import TextCodec

    codec = TextCodec.load(config.model.path)
    sock = shared if shared is not None else reuse_port_socket(config.host, config.port)
    on_cpu = "" if config.cpu is None else f" on CPU {config.cpu}"
    logger.info("gateway worker %d (pid %d) starting%s", spec.index, os.getpid(), on_cpu)
    serve(config, codec, sock, spec.metrics_dir, ready.set, all_serving.is_set)


def _die_with_supervisor(supervisor_pid: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor_pid:  # it died before the request took effect
        os._exit(1)


@dataclass
class Worker:
    index: int
    process: SpawnProcess
    ready: Event
    served: bool = False  # it signalled readiness at least once

    @property
    def pid(self) -> int:
        return self.process.pid or 0


class Supervisor:
    """Starts, watches and stops the workers (see the module docstring)."""

    def __init__(self, config: GatewayConfig, log: LogConfig) -> None:
        self.config = config
        self.log = log
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[Worker] = []
        self.metrics_dir = ""
        self.stopping = False
        self.all_serving = self.context.Event()  # every worker served once: /health may pass
        self.shared: socket.socket | None = None  # --worker-listen shared: the one listener

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT (0) or until a worker cannot start (1)."""
        shared = self.config.worker_listen == "shared"
        make = shared_socket if shared else reuse_port_socket
        holder = make(self.config.host, self.config.port)
        self.shared = holder if shared else None
        self.config = replace(self.config, port=holder.getsockname()[1])
        self.metrics_dir = tempfile.mkdtemp(prefix="pdserve-gateway-metrics-")
        os.environ[MULTIPROCESS_ENV] = self.metrics_dir  # the spawned workers inherit it
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._stop_signal)
        try:
            self.workers = [self._start(index) for index in range(self.config.workers)]
            code = self._watch()
        finally:
            self._stop_all()
            holder.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return code

    def _stop_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _start(self, index: int) -> Worker:
        ready = self.context.Event()
        config = replace(self.config, worker_index=index)  # what `worker_affinity` pins by
        spec = WorkerSpec(config, self.log, index, self.metrics_dir, os.getpid())
        process = self.context.Process(
            target=worker_main,
            args=(spec, ready, self.all_serving, self.shared),
            name=f"gateway-worker-{index}",
            daemon=True,
        )
        process.start()
        return Worker(index, process, ready)

    def _watch(self) -> int:
        announced = False
        while not self.stopping:
            wait([w.process.sentinel for w in self.workers], timeout=_POLL_S)
            for worker in self.workers:
                if not worker.served and worker.ready.is_set():
                    worker.served = True
            if not announced and all(w.served for w in self.workers):
                announced = True
                self.all_serving.set()
                logger.info(
                    "gateway on http://%s:%d: %d workers serving (%s)",
                    self.config.host,
                    self.config.port,
                    len(self.workers),
                    "one shared listener" if self.shared else "SO_REUSEPORT",
                )
            for position, worker in enumerate(self.workers):
                if worker.process.is_alive() or self.stopping:
                    continue
                if not self._replace(position, worker):
                    return 1
        return 0

    def _replace(self, position: int, worker: Worker) -> bool:
        """Report a dead worker and start another in its place (False: give up)."""
        from prometheus_client import multiprocess

        code = worker.process.exitcode
        multiprocess.mark_process_dead(worker.pid, self.metrics_dir)  # its live gauges go
        if not worker.served:
            logger.error(
                "gateway worker %d (pid %d) exited with code %s before it served: stopping "
                "the gateway (see the worker's error above)",
                worker.index,
                worker.pid,
                code,
            )
            return False
        logger.error(
            "gateway worker %d (pid %d) exited with code %s: starting another",
            worker.index,
            worker.pid,
            code,
        )
        self.workers[position] = self._start(worker.index)
        return True

    def _stop_all(self) -> None:
        for worker in self.workers:
            if worker.process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGTERM)
        # Each worker drains first (--drain-timeout), then stops.
        deadline = time.monotonic() + self.config.drain_timeout_s + _STOP_GRACE_S
        for worker in self.workers:
            worker.process.join(max(deadline - time.monotonic(), 0.1))
            if worker.process.is_alive():
                logger.warning("gateway worker %d did not stop: killing it", worker.index)
                worker.process.kill()
                worker.process.join()
