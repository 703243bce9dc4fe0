"""Where a process's host time goes, beside a benchmark (imported, not run): Linux /proc only.

bench_kv_staging.py's two-process `cuda_ipc` rows showed every host step of a page-id write
twice as slow as in tune_ipc_copy.py's one process (numpy planning as much as the driver
calls), and as fast in the GPU0 -> GPU1 run. Something about the process, not the code path;
these are the facts that tell the candidates apart, measured in the sender itself:

- `calibration_ms`: a fixed piece of numpy (the page-id plan of 256 pages into a plain array,
  no CUDA, no pinned memory); the same figure in the parent process is the control. Slower
  here means the CPU the sender runs on is slower (frequency, a busy SMT sibling, another
  NUMA node), not our code.
- `snapshot`: the CPU the process is on, its allowed CPUs, the NUMA node of that CPU and of
  the GPU, its threads (OS and Python: a thread holding the GIL would show here), the load,
  the interpreter's hooks (a trace or profile function, tracemalloc, dev mode: each slows
  every Python line), its tracked objects, and the libcuda it mapped.
- `CpuUse`: CPU seconds other processes (the receiver, the parent) burned during a window,
  against its wall time: a peer that spins instead of blocking shows as ~1 s per second; and
  the busiest processes of the whole host meanwhile (a leftover of an earlier step, say the
  PD check's node processes, would show there).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


def _stat_fields(pid: int | str = "self") -> list[str]:
    """Fields of /proc/<pid>/stat after the command name (field 3 onwards)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2 :].split()


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds of a process so far (0 if it is gone)."""
    try:
        fields = _stat_fields(pid)
    except (OSError, ValueError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15)


def current_cpu() -> int:
    """The CPU this process last ran on (field 39 of /proc/self/stat)."""
    return int(_stat_fields()[36])


def cpu_node(cpu: int) -> int | None:
    """The NUMA node of a CPU, None where sysfs does not say."""
    for entry in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node*"):
        return int(entry.name[4:])
    return None


def node_cpus(node: int) -> set[int]:
    """The CPUs of a NUMA node (empty where sysfs does not say)."""
    try:
        text = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
    except OSError:
        return set()
    return parse_cpu_list(text)


def parse_cpu_list(text: str) -> set[int]:
    """ "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pci_numa_node(bus_id: str) -> int | None:
    """The NUMA node sysfs gives a PCI device ("0000:1b:00.0"); None if unknown (-1)."""
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus_id.lower()}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def thread_names() -> list[str]:
    """The OS threads of this process by name (/proc/self/task/*/comm)."""
    names = []
    for task in sorted(Path("/proc/self/task").iterdir()):
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            continue
    return names


def calibration_ms(repeats: int = 200) -> float:
    """Median ms of a fixed numpy workload: 256 random page ids planned into kernel rows the
    way `plan_pages` does (min/max, two multiplies, a fill), into a plain array."""
    rng = np.random.default_rng(0)
    src = rng.permutation(1024)[:256].astype(np.int64)
    dst = rng.permutation(1024)[:256].astype(np.int64)
    rows = np.empty((256, 3), dtype=np.int64)
    times = []
    for _ in range(repeats + 10):
        start = time.perf_counter()
        lo, hi = int(src.min()), int(src.max()) + int(dst.min()) + int(dst.max())
        np.multiply(src, 128, out=rows[:, 0])
        np.multiply(dst, 128, out=rows[:, 1])
        rows[:, 2] = 128 + (lo + hi) * 0
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[10:])


@dataclass
class Snapshot:
    pid: int
    cpu: int
    cpu_node: int | None
    gpu_node: int | None
    allowed_cpus: int
    os_threads: list[str]
    python_threads: list[str]
    load: tuple[float, float, float]
    hooks: str = ""
    libcuda: str = ""

    def line(self) -> str:
        names = self.os_threads
        threads = ", ".join(f"{n} x{names.count(n)}" for n in sorted(set(names)))
        return (f"pid {self.pid} on cpu {self.cpu} (NUMA node {self.cpu_node}; the GPU's: "
                f"{self.gpu_node}), {self.allowed_cpus} CPUs allowed; OS threads: {threads}; "
                f"Python threads: {', '.join(self.python_threads)}; load "
                f"{'/'.join(f'{x:.1f}' for x in self.load)}; {self.hooks}; libcuda "
                f"{self.libcuda or 'not mapped'}")  # fmt: skip


def snapshot(gpu_bus_id: str = "") -> Snapshot:
    cpu = current_cpu()
    return Snapshot(
        os.getpid(),
        cpu,
        cpu_node(cpu),
        pci_numa_node(gpu_bus_id) if gpu_bus_id else None,
        len(os.sched_getaffinity(0)),
        thread_names(),
        [t.name for t in threading.enumerate()],
        os.getloadavg(),
        interpreter_hooks(),
        mapped_library("libcuda.so"),
    )


def interpreter_hooks() -> str:
    """What makes every Python line slower here, if anything, and the GC's load."""
    import gc
    import sys
    import tracemalloc

    hooks = [name for name, on in (("a trace function", sys.gettrace() is not None),
                                   ("a profile function", sys.getprofile() is not None),
                                   ("tracemalloc", tracemalloc.is_tracing()),
                                   ("dev mode", sys.flags.dev_mode)) if on]  # fmt: skip
    return (f"interpreter hooks: {', '.join(hooks) or 'none'}; {len(gc.get_objects())} "
            f"GC-tracked objects, thresholds {gc.get_threshold()}")  # fmt: skip


def mapped_library(name: str) -> str:
    """The path of the first mapping of a library whose file name starts with `name`."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return ""
    for line in maps:
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if Path(path).name.startswith(name):
            return path
    return ""


@dataclass
class CpuUse:
    """CPU seconds each watched process used during a window, the window's wall time, and
    the host's busiest processes meanwhile ("command[pid]" -> seconds)."""

    wall_s: float = 0.0
    used_s: dict[str, float] = field(default_factory=dict)
    busiest: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        used = ", ".join(f"{name} {s:.3f} s" for name, s in self.used_s.items())
        top = ", ".join(f"{name} {s:.3f} s" for name, s in self.busiest.items())
        return f"CPU used during the {self.wall_s:.3f} s window: {used}; busiest on the host: {top}"


def all_cpu_seconds() -> dict[str, float]:
    """ "command[pid]" -> CPU seconds so far, for every process this one can read."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2 :].split()
        out[f"{name}[{entry.name}]"] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return out


@contextmanager
def cpu_use(pids: dict[str, int], top: int = 4) -> Iterator[CpuUse]:
    """Measure the CPU seconds of `pids` (name -> pid) over the block, and the `top`
    busiest processes of the host."""
    use = CpuUse()
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    everyone = all_cpu_seconds()
    start = time.perf_counter()
    yield use
    use.wall_s = time.perf_counter() - start
    use.used_s = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    grew = {k: v - everyone.get(k, 0.0) for k, v in all_cpu_seconds().items()}
    use.busiest = dict(sorted(grew.items(), key=lambda kv: -kv[1])[:top])


def on_cpus(cpus: set[int], fn: Callable[[], T]) -> T:
    """`fn()` with this process allowed only `cpus`, then its old CPUs again."""
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return fn()
    finally:
        os.sched_setaffinity(0, old)
