"""Where a gateway worker's samples go, from a py-spy profile in raw (collapsed) format.

    py-spy record -p <worker pid> -d 8 -r 200 --native -f raw -o worker.raw
    python -m scripts.bench.profile_split worker.raw

Each stack is put in one bucket: the gRPC C-core thread, gRPC receive on the event loop (the
call's read, its wake-up syscalls, deserializing), the cyclic GC, the HTTP frame writes (socket
syscalls under the gateway's own frames), the gateway's Python, uvicorn/Starlette/httptools, and
the rest. Samples in `epoll_wait` are idle and left out. py-spy samples wall time: a thread that
is runnable but not running still counts, so on a loaded host these are shares of samples, not
of CPU time (read CPU time from scripts/bench/gateway_cpu.py).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable

# Frames every stack of the main thread starts with: they say nothing about where time goes.
_ROOT = (
    "uvicorn/server.py",
    "uvicorn/_compat.py",
    "uvicorn/main.py",
    "gateway/process/server.py",
    "gateway-server",
    "asyncio/runners.py",
)
_WRITES = ("write (", "writev (", "sendmsg (", "sendto (", "send (")
IDLE = "idle"


def bucket(frames: list[str]) -> str:
    """The bucket of one stack (root first, as py-spy's raw format lists them)."""
    leaf = frames[-1]
    if leaf.startswith(("epoll_wait", "epoll_pwait")):
        return IDLE
    whole = ";".join(frames)
    if "Thread._bootstrap" in whole and "cygrpc" in whole:
        return "gRPC C-core thread (poller; futex waits included)"
    body = ";".join(f for f in frames if not any(root in f for root in _ROOT))
    if "grpc/" in body or "cygrpc" in body:
        return "gRPC receive on the event loop (read, wake-up syscalls, parse)"
    if "gc_collect" in whole:
        return "cyclic GC"
    if leaf.startswith(_WRITES) and "gateway/" in body:
        return "HTTP frame writes (socket syscalls)"
    server = ("uvicorn", "starlette", "httptools")
    if "gateway/" in body and not any(name in leaf for name in server):
        return "gateway Python (stream path, handlers)"
    if any(name in body for name in server):
        return "uvicorn / Starlette / httptools"
    return "other (event loop callbacks, interpreter)"


def split(lines: Iterable[str]) -> Counter[str]:
    """Samples per bucket (idle included) of py-spy raw lines: `frame;frame;... count`."""
    samples: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            samples[bucket(stack.split(";"))] += int(count)
    return samples


def table(samples: Counter[str]) -> str:
    busy = sum(n for name, n in samples.items() if name != IDLE)
    rows = ["| where | share of non-idle samples |", "|---|---|"]
    for name, n in samples.most_common():
        if name != IDLE:
            rows.append(f"| {name} | {n / busy:.0%} |")
    rows.append(f"| (non-idle samples) | {busy} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", help="py-spy record -f raw output")
    args = parser.parse_args(argv)
    with open(args.raw) as lines:
        print(table(split(lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
