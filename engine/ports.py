"""`free_port`: the one way every part of the project picks a TCP port for a process it starts.

Torch-free and import-free on purpose: the TP rank group (engine/tp/workers.py), `pd-cluster`
and its launcher (gateway/process/launcher.py), the tests and the scripts all take it from here.

A port handed to a child is bound only when the child gets that far, seconds later. A port the
kernel picked (`bind(("", 0))`) comes from the ephemeral range, which every outgoing connection
on the machine draws from too, so in the meantime a gRPC, ZMQ or HTTP client could take it and
the child would fail with "Address already in use". So the ports come from below that range,
where the kernel never puts a connection, and each one is reserved for `RESERVE_S` seconds by a
file that no other process picking ports here will pass over.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

LOCALHOST = "127.0.0.1"

LOWEST = 10000  # below it lie the well-known and registered ports that services listen on
RESERVE_S = 120.0  # long enough for any child to start and bind; the mark is reused after it
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FALLBACK_EPHEMERAL = (32768, 60999)  # Linux's default, where /proc can't be read

_handed_out: set[int] = set()  # this process never gives a port out twice


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (outgoing connections, `bind` to 0)."""
    try:
        low, high = (int(part) for part in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return _FALLBACK_EPHEMERAL
    return low, high


def candidate_ports() -> range:
    """The ports `free_port` draws from: those between `LOWEST` and the ephemeral range."""
    low, high = ephemeral_range()
    if low - LOWEST >= 1000:
        return range(LOWEST, low)
    return range(high + 1, 65536)  # a machine whose ephemeral range starts low


def _reserve(port: int, directory: Path) -> bool:
    """Mark `port` as taken for `RESERVE_S` s; False if another picker marked it since."""
    mark = directory / str(port)
    try:
        if time.time() - mark.stat().st_mtime < RESERVE_S:
            return False
        mark.unlink(missing_ok=True)  # a stale mark: its port was bound or given up long ago
    except FileNotFoundError:
        pass
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except FileExistsError:
        return False  # another process won the race for this very port
    return True


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _marks_dir() -> Path:
    directory = Path(tempfile.gettempdir()) / f"pdserve-ports-{os.getuid()}"
    directory.mkdir(exist_ok=True)
    return directory


def free_port(host: str = LOCALHOST) -> int:
    """A port that is free now and that nobody else picking ports here will get for a while."""
    ports = candidate_ports()
    directory = _marks_dir()
    for _ in range(200):
        port = random.choice(ports)
        if port in _handed_out or not _bindable(port, host):
            continue
        if _reserve(port, directory):
            _handed_out.add(port)
            return port
    raise RuntimeError(
        f"no free port in {ports.start}-{ports.stop - 1} on {host} after 200 tries: "
        f"free some, or clear {directory}"
    )
