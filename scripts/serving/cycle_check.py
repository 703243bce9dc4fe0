"""Reference cycles the gateway leaves behind, request class by request class (issue 25).

    python -m scripts.serving.cycle_check [--model DIR]

A failed handler's exception once held its traceback, which held the handler's frame, which
held the task, which held the exception: a cycle that kept a long prompt and its token ids
alive until the cyclic GC ran. This check looks for such garbage in a real gateway: it starts
`pd-cluster --prefill 1 --decode 1` and beside it a second gateway on the same bootstrap whose
cyclic GC is off (this module, `--gateway`); after each class of requests (completions,
complete streams, streams the client leaves, rejected requests, a stream aborted by
`--stream-stall-timeout`) the gateway runs a collection with `gc.DEBUG_SAVEALL` and prints what
it would have freed: objects by type, frames by function, exceptions by type, and how long
that full collection took over how many objects (start-up objects frozen out of it since
gateway/requests/memory.py's `freeze_startup_objects`). Counts add up from class to class (the
garbage found is kept); an exception or a frame in the garbage is a cycle like the one above.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import httpx

from engine.ports import free_port
from scripts.serving.hostile_probe import _healthy, cluster, wait_until

REPORT_ENV = "PDSERVE_CYCLE_REPORT"
STALL_TIMEOUT_S = 3


def _report_garbage(signum: int, frame: Any) -> None:
    gc.set_debug(gc.DEBUG_SAVEALL)
    tracked = len(gc.get_objects())  # the permanent generation (gc.freeze) left out
    start = time.perf_counter()
    found = gc.collect()
    took_ms = (time.perf_counter() - start) * 1000
    kinds = collections.Counter(type(o).__name__ for o in gc.garbage)
    frames = collections.Counter(
        o.f_code.co_qualname for o in gc.garbage if isinstance(o, types.FrameType)
    )
    errors = collections.Counter(
        type(o).__name__ for o in gc.garbage if isinstance(o, BaseException)
    )
    with open(os.environ[REPORT_ENV], "a") as out:
        out.write(f"  full collection: {took_ms:.1f} ms over {tracked} objects "
                  f"({gc.get_freeze_count()} frozen)\n")  # fmt: skip
        out.write(f"  garbage: {found} objects; most: {kinds.most_common(8)}\n")
        out.write(f"  frames: {dict(frames)}; exceptions: {dict(errors)}\n")
    gc.set_debug(0)  # gc.garbage keeps what was found: the next report counts it again


def _gateway(argv: list[str]) -> int:
    """gateway-server with the cyclic GC off; SIGUSR1 reports what a collection finds."""
    from gateway.process.server import main

    gc.disable()
    signal.signal(signal.SIGUSR1, _report_garbage)
    return main(argv)


def _requests(url: str, model: str) -> dict[str, Any]:
    """The request classes, each a function sending a few requests."""

    def completions() -> None:
        for _ in range(5):
            body = {"model": model, "prompt": "Hi", "max_tokens": 2}
            httpx.post(url + "/v1/completions", json=body, timeout=60)

    def streams() -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                "stream": True}  # fmt: skip
        for _ in range(10):
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                for _ in r.iter_bytes():
                    pass

    def streams_left() -> None:
        body = {"model": model, "prompt": "Tell a story", "max_tokens": 200, "stream": True,
                "ignore_eos": True}  # fmt: skip
        for _ in range(10):
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                next(r.iter_bytes())
        time.sleep(1)

    def rejected() -> None:
        bodies = [
            {"model": model, "prompt": "x" * 600_000, "max_tokens": 1},
            {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": -1},
            {"model": model, "prompt": "Hi", "max_tokens": 100_000, "stream": True},
            {"model": model, "prompt": [[1]] * 100_000, "max_tokens": 1},
        ]
        for _ in range(5):
            for body in bodies:
                httpx.post(url + "/v1/completions", json=body, timeout=60)

    def stalled() -> None:
        body = json.dumps({
            "model": model, "messages": [{"role": "user", "content": "Tell a long story"}],
            "max_tokens": 4000, "ignore_eos": True, "stream": True, "logprobs": True,
            "top_logprobs": 20,
        }).encode()  # fmt: skip
        host, port = url.removeprefix("http://").rsplit(":", 1)
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(head + body)
            sock.recv(4096)
            time.sleep(STALL_TIMEOUT_S + 8)  # the buffers fill, then the stall timeout

    return {
        "5 completions (warm-up)": completions,
        "nothing": lambda: None,
        "10 complete streams": streams,
        "10 streams left by their client after the first frame": streams_left,
        "20 rejected requests (too long, bad temperature, max_tokens, 100k prompts)": rejected,
        f"a stream aborted by --stream-stall-timeout {STALL_TIMEOUT_S}": stalled,
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--gateway"]:
        return _gateway(args[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    options = parser.parse_args(args)
    tmp = Path(tempfile.mkdtemp(prefix="cycle-check-"))
    report = tmp / "garbage.txt"
    report.touch()
    with cluster(options.model, tmp / "cluster.log") as probe:
        bootstrap = re.search(r"--bootstrap (\S+)", (tmp / "cluster.log").read_text())
        assert bootstrap, "no bootstrap address in the cluster's log"
        port = free_port()
        command = [sys.executable, "-m", "scripts.serving.cycle_check", "--gateway",
                   "--bootstrap", bootstrap.group(1), "--port", str(port),
                   "--stream-stall-timeout", str(STALL_TIMEOUT_S)]  # fmt: skip
        if options.model:
            command += ["--model", options.model]
        log = (tmp / "gateway.log").open("wb")
        env = {**os.environ, REPORT_ENV: str(report)}
        gateway = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            died = f"the gateway exited: see {tmp / 'gateway.log'}"
            wait_until(lambda: _healthy(url), gateway, died)
            for name, send in _requests(url, probe.model).items():
                send()
                with report.open("a") as out:
                    out.write(f"after {name}:\n")
                os.kill(gateway.pid, signal.SIGUSR1)
                time.sleep(2)
        finally:
            gateway.terminate()
            gateway.wait(30)
            log.close()
    print(report.read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
