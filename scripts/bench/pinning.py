"""CPU sets for a benchmark's processes, so that the one measured does not share a core.

On a host with SMT (e.g. 8 cores x 2 hardware threads) two processes on sibling threads slow
each other down as two on one core do, and the kernel places client processes next to gateway
workers as it likes: per-worker CPU per token then rises with the number of workers for reasons
that are not the gateway's. `plan_cpus` gives each gateway worker a physical core of its own
(all its hardware threads: the worker's event loop on one, its gRPC threads free to use the
other), each token-source process a core of its own, and the client processes every hardware
thread left. `pinned` starts processes inside a CPU set (what a process starts inherits its
affinity, threads and children included). The gateway pins its own workers
(`gateway-server --worker-cpus`, one CPU a worker): `CpuPlan.worker_cpus` is that flag's value.

    plan = plan_cpus(host_cores(), gateway=4, nodes=1)
    with pinned(plan.nodes[0]):
        start the token source
    start gateway-server --workers 4 --worker-cpus plan.worker_cpus(4)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

Core = tuple[int, ...]  # the hardware threads (logical CPUs) of one physical core


@dataclass(frozen=True)
class CpuPlan:
    gateway: tuple[Core, ...]  # a whole core per worker
    nodes: tuple[Core, ...]  # a whole core per token source
    clients: tuple[int, ...]  # every thread of the cores left

    @property
    def gateway_cpus(self) -> tuple[int, ...]:
        return tuple(c for core in self.gateway for c in core)

    def worker_cpus(self, workers: int) -> str:
        """`gateway-server --worker-cpus` for the first `workers` gateway cores: the first
        hardware thread of each (the product pins a worker to one CPU; the core's other
        threads are in no other set, so nothing else runs there)."""
        return ",".join(str(core[0]) for core in self.gateway[:workers])

    def describe(self) -> str:
        return (
            f"gateway workers {' '.join(_cpu_list(core) for core in self.gateway)}, "
            f"token sources {' '.join(_cpu_list(core) for core in self.nodes)}, "
            f"clients {_cpu_list(self.clients)}"
        )


def plan_cpus(cores: Sequence[Core], gateway: int, nodes: int, idle: Sequence[int] = ()) -> CpuPlan:
    """`gateway` workers one core each, `nodes` token sources one core each, clients the rest;
    a core holding a CPU of `idle` goes to no one (e.g. a virtual machine's hidden SMT
    siblings of the workers' CPUs). Raises ValueError naming what is missing when the host
    has too few cores."""
    cores = [core for core in cores if not set(idle) & set(core)]
    wanted = gateway + nodes + 1  # at least one core for the clients
    if len(cores) < wanted:
        raise ValueError(
            f"pinning {gateway} gateway workers and {nodes} token sources to cores of their own, "
            f"with one core left for the clients, needs {wanted} physical cores; this host has "
            f"{len(cores)} ({_cpu_list([c for core in cores for c in core])}): run without --pin "
            "or with fewer workers"
        )
    ordered = sorted(cores, key=lambda core: core[0])
    gateway_cores, rest = ordered[:gateway], ordered[gateway:]
    node_cores, client_cores = rest[:nodes], rest[nodes:]
    return CpuPlan(
        gateway=tuple(gateway_cores),
        nodes=tuple(node_cores),
        clients=tuple(c for core in client_cores for c in core),
    )


def group_cores(cpus: Sequence[int], siblings: dict[int, Core]) -> list[Core]:
    """The physical cores of `cpus` (each CPU's thread siblings, limited to `cpus`)."""
    allowed = set(cpus)
    cores: dict[Core, None] = {}
    for cpu in sorted(allowed):
        core = tuple(sorted(c for c in siblings.get(cpu, (cpu,)) if c in allowed)) or (cpu,)
        cores[core] = None
    return list(cores)


def host_cores() -> list[Core]:
    """The cores of the CPUs this process may run on (Linux: sysfs thread siblings)."""
    cpus = sorted(os.sched_getaffinity(0))
    siblings = {}
    for cpu in cpus:
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        with contextlib.suppress(OSError, ValueError):
            siblings[cpu] = parse_cpu_list(path.read_text())
    return group_cores(cpus, siblings)


def parse_cpu_list(text: str) -> Core:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return tuple(cpus)


def _cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in cpus)


@contextlib.contextmanager
def pinned(cpus: Sequence[int] | None) -> Iterator[None]:
    """Run the block with this thread's affinity set to `cpus` (None: unchanged), so that the
    processes it starts inherit it; the affinity is restored after."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
