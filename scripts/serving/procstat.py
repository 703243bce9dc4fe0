"""CPU time of the processes a load test watches (gateway, nodes), read from /proc (Linux).

A watched process is named on the command line as `NAME=PID` (`--watch-pid`) or `NAME=PORT`
(`--watch-port`: the processes holding a listening TCP socket on that port, found through
/proc/net/tcp{,6} and each process's socket inodes). A port is the robust handle: pd-cluster
prints every child's address and metrics URL, not its pid, and a gateway that forks workers
sharing one listening socket has them all found by the port. Each watched name then also
counts every descendant process alive at either reading (workers a supervisor forked).

CPU is user + system time (utime + stime of /proc/PID/stat, all threads). A process that exits
between the two readings loses its last interval; that is said in `ProcessCpu.note`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SATURATED = 0.85  # fraction of one core above which a process is the likely bottleneck
LATE_LOOP_MS = 50.0  # a client event loop this late (p99) stamps its own delay on the figures
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


class WatchError(ValueError):
    """A --watch-* flag that names no process; the message says which and what to give."""


@dataclass(frozen=True)
class WatchSpec:
    name: str
    pid: int | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str, kind: str) -> WatchSpec:
        name, sep, value = text.partition("=")
        if not sep or not name or not value.isdigit():
            raise WatchError(f"--watch-{kind} wants NAME={kind.upper()}, got {text!r}")
        return cls(name, pid=int(value)) if kind == "pid" else cls(name, port=int(value))

    def resolve(self) -> list[int]:
        """The pids this spec names now (a port: its listeners); WatchError if none."""
        if self.pid is not None:
            if not (PROC / str(self.pid)).exists():
                raise WatchError(f"--watch-pid {self.name}={self.pid}: no such process")
            return [self.pid]
        assert self.port is not None
        pids = listening_pids(self.port)
        if not pids:
            raise WatchError(
                f"--watch-port {self.name}={self.port}: no process of this user listens on "
                "that TCP port; give its pid with --watch-pid instead"
            )
        return pids


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (all its threads), or None once it has gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _parent_of(pid: int) -> int | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def descendants(roots: Iterable[int]) -> set[int]:
    """The roots and every live process below them."""
    parents = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            parent = _parent_of(int(entry.name))
            if parent is not None:
                parents[int(entry.name)] = parent
    found = set(roots)
    grew = True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in found} - found
        found |= below
        grew = bool(below)
    return found


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def listening_pids(port: int) -> list[int]:
    """Processes (of this user: others' fds are unreadable) listening on a TCP port."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not inodes:
        return []
    return sorted(
        int(entry.name)
        for entry in PROC.iterdir()
        if entry.name.isdigit() and _fd_links(entry) & inodes
    )


def _fd_links(process: Path) -> set[str]:
    """What a process's file descriptors point at (one may close while we read: skipped)."""
    links: set[str] = set()
    try:
        fds = list((process / "fd").iterdir())
    except OSError:  # gone, or another user's
        return links
    for fd in fds:
        try:
            links.add(os.readlink(fd))
        except OSError:
            continue
    return links


@dataclass
class ProcessCpu:
    """CPU a watched name used over a window: its processes and their descendants."""

    name: str
    pids: list[int]
    cpu_s: float
    wall_s: float
    note: str = ""
    loop_lag_p99_ms: float | None = None  # client processes: their event loop's lateness

    @property
    def core_fraction(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def us_per_token(self, tokens: int) -> float | None:
        return self.cpu_s * 1e6 / tokens if tokens else None


@dataclass
class CpuWatch:
    """Readings at the start and at the end of a run for each watched name."""

    specs: Sequence[WatchSpec]
    _roots: dict[str, list[int]] = field(default_factory=dict)
    _start: dict[str, dict[int, float]] = field(default_factory=dict)
    _started_at: float = 0.0

    def start(self, now: float) -> None:
        self._roots = {s.name: s.resolve() for s in self.specs}  # WatchError before any load
        self._start = {name: self._read(roots) for name, roots in self._roots.items()}
        self._started_at = now

    def stop(self, now: float) -> list[ProcessCpu]:
        """One row per watched name; where several of its processes used CPU (a gateway's
        workers), one row per process after it, named `NAME pid PID`."""
        wall = now - self._started_at
        usages = []
        for name, roots in self._roots.items():
            end = self._read(roots)
            before = self._start[name]
            gone = sorted(set(before) - set(end))
            per_pid = {pid: end[pid] - before.get(pid, 0.0) for pid in sorted(end)}
            note = f"exited during the run: {gone}" if gone else ""
            pids = sorted(set(before) | set(end))
            usages.append(ProcessCpu(name, pids, sum(per_pid.values()), wall, note))
            busy = {pid: cpu for pid, cpu in per_pid.items() if cpu > 0}
            if len(busy) > 1:
                usages += [ProcessCpu(f"{name} pid {p}", [p], c, wall) for p, c in busy.items()]
        return usages

    @staticmethod
    def _read(roots: list[int]) -> dict[int, float]:
        readings = {}
        for pid in descendants(roots):
            seconds = cpu_seconds(pid)
            if seconds is not None:
                readings[pid] = seconds
        return readings


def saturation_warnings(usages: Sequence[ProcessCpu]) -> list[str]:
    """One line per client process that may have set the figures itself: above SATURATED of a
    core, or with an event loop late by more than LATE_LOOP_MS (p99)."""
    lines = []
    for u in usages:
        if u.core_fraction > SATURATED:
            lines.append(
                f"warning: {u.name} used {u.core_fraction:.0%} of a core: it may be the "
                "bottleneck (for a client process: raise --workers)"
            )
        if u.loop_lag_p99_ms is not None and u.loop_lag_p99_ms > LATE_LOOP_MS:
            lines.append(
                f"warning: {u.name}'s event loop ran {u.loop_lag_p99_ms:.0f} ms late (p99): "
                "its timestamps carry its own delay (busy host or too few --workers)"
            )
    return lines
