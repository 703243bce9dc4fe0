"""`free_port`: the one way every part of the project picks a TCP port for a process it starts.

Torch-free and import-free on purpose: the TP rank group (engine/tp/workers.py), `pd-cluster`
and its launcher (gateway/launcher.py), the tests and the scripts all take it from here.
"""

from __future__ import annotations

import socket

LOCALHOST = "127.0.0.1"


def free_port(host: str = LOCALHOST) -> int:
    """A port that was free a moment ago (the kernel picks it; the caller retries on a clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
