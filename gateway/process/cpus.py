"""`gateway-server --worker-cpus LIST`: the CPU each gateway worker runs on.

Why pin at all: measured on a 32-core host (benchmarks/gpu-2026-11-26-gateway-spread-h100.md),
one unpinned worker paid ~22 µs of CPU per streamed token, but each of two or four unpinned
workers paid 31-37 µs (the kernel moves them among the client processes and the token
sources); with every process on a core of its own, four workers stayed at 23-30 µs.

LIST is Linux cpulist syntax (`0-3`, `4,6,8,10`, `0-1,8-9`), in the order the workers take it:
worker i runs on `LIST[i % len(LIST)]`, so fewer CPUs than workers means some workers share a
CPU, and a worker started in place of a crashed one takes its predecessor's CPU (it keeps the
index). The worker pins itself (`pin_this_process`) before it starts any thread, so every
thread it starts later (gRPC, tokenizer pool) inherits the CPU. The parsing and the checks
against the process's allowed CPUs are pure functions; the server calls them at the edge.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence

FLAG = "--worker-cpus"
MAX_CPU = 8191  # the kernel's largest CPU number (NR_CPUS is at most 8192)


def parse_cpu_list(text: str, flag: str = FLAG) -> tuple[int, ...]:
    """'0-3,8' -> (0, 1, 2, 3, 8), in the order written. Raises ValueError naming `flag` for
    anything that is not comma-separated CPUs and ascending ranges, or a CPU listed twice."""
    cpus: list[int] = []
    seen: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(
                f"{flag} {text!r}: {part!r} is not a CPU number or range; write Linux cpulist "
                "syntax such as 0-3 or 4,6,8,10"
            )
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(
                f"{flag} {text!r}: the range {part!r} runs backwards; write {high}-{low}"
            )
        if high > MAX_CPU:
            raise ValueError(f"{flag} {text!r}: CPU {high} is beyond Linux's largest, {MAX_CPU}")
        for cpu in range(low, high + 1):
            if cpu in seen:
                raise ValueError(
                    f"{flag} {text!r} lists CPU {cpu} more than once: list each CPU once "
                    "(with fewer CPUs than workers, workers share them in turn)"
                )
            cpus.append(cpu)
            seen.add(cpu)
    return tuple(cpus)


def check_allowed(cpus: Sequence[int], allowed: Collection[int], flag: str = FLAG) -> None:
    """ValueError naming `flag` and the allowed set when a CPU is not one this process may
    run on (`os.sched_getaffinity(0)`: the host's CPUs, less a taskset or container's limit)."""
    outside = [cpu for cpu in cpus if cpu not in allowed]
    if outside:
        raise ValueError(
            f"{flag}: CPU {outside[0]} is not one this process may run on; allowed: "
            f"{format_cpu_list(sorted(allowed))}"
        )


def worker_cpus(text: str, allowed: Collection[int], flag: str = FLAG) -> tuple[int, ...]:
    """The checked CPU list of `flag` (empty text: no pinning, the empty tuple)."""
    if not text.strip():
        return ()
    cpus = parse_cpu_list(text, flag)
    check_allowed(cpus, allowed, flag)
    return cpus


def allowed_cpus(flag: str = FLAG) -> set[int]:
    """The CPUs this process may run on; ValueError naming `flag` where Linux's affinity
    calls do not exist."""
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError(f"{flag} needs Linux (os.sched_setaffinity): leave it out here")
    return set(os.sched_getaffinity(0))


def pin_this_process(cpu: int) -> None:
    """Run the calling thread, and every thread it starts after, on `cpu` only (call it
    before the process starts threads: those already running keep their affinity)."""
    os.sched_setaffinity(0, {cpu})


def format_cpu_list(cpus: Sequence[int]) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8' (runs of ascending CPUs as ranges)."""
    parts: list[str] = []
    start = previous = None
    for cpu in [*cpus, None]:
        if cpu is not None and previous is not None and cpu == previous + 1:
            previous = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = cpu
    return ",".join(parts)
