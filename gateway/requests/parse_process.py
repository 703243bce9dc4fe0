"""Parse processes: large request bodies parsed outside the gateway's process (issue 25).

`BodyParser` parses a small body on the event loop and hands a large one (`LARGE_BODY_BYTES`
or more) to one of `PARSE_PROCESSES` parse processes; why, in gateway/requests/body.py's docstring.
`ParseProcess` is one child (`python -m gateway.requests.parse_process`), started with `subprocess`,
not `multiprocessing`: gateway-server's `--workers` are daemonic multiprocessing processes, which
may not start multiprocessing children, and a fork of the threaded gateway is never safe.
It serves one body at a time over its stdin and stdout:

    gateway -> child   4-byte length, a pickled `ParseJob`; then the body's bytes
    child -> gateway   4-byte length, a pickled `ParseAnswer`

The body is written straight from its buffer (no pickled copy of it, unlike a
ProcessPoolExecutor's call), through a pipe enlarged to `PIPE_BYTES`, by the thread that waits
for the answer (one `parse-body` thread per process): the gateway's event loop only hands the
job over. What the child does with it is `gateway.requests.body.answer_job`. A child ends when the
gateway closes its pipe, or dies with it; Ctrl-C is the gateway's to handle, not the child's.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING

from gateway.requests.body import (
    LARGE_BODY_BYTES,
    MIN_CONTAINERS,
    ParseAnswer,
    ParsedBody,
    ParseJob,
    answer_job,
    parse_body,
)

if TYPE_CHECKING:
    from gateway.requests.tokenize import BodyRoute, PromptBounds

logger = logging.getLogger("pdserve.gateway")
PARSE_PROCESSES = 2  # per gateway process (or worker): large bodies queue for them
PIPE_BYTES = 1 << 20  # Linux's unprivileged maximum (/proc/sys/fs/pipe-max-size)
_LENGTH = struct.Struct(">I")


class ParseProcessDied(Exception):
    """The child exited (or closed its pipes) before answering."""


class ParseProcess:
    """One parse process, used by one body at a time (`BodyParser` keeps them)."""

    def __init__(self) -> None:
        command = [sys.executable, "-m", "gateway.requests.parse_process"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdin is not None and self.process.stdout is not None
        self._to_child = self.process.stdin
        self._from_child = self.process.stdout
        with contextlib.suppress(OSError, AttributeError):  # a larger pipe: fewer writes
            fcntl.fcntl(self._to_child.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)

    def parse(self, job: ParseJob, pieces: Sequence[bytes]) -> ParseAnswer:
        """Blocking (in a thread): the body's pieces to the child, its answer back."""
        header = pickle.dumps(job)
        try:
            self._to_child.write(_LENGTH.pack(len(header)) + header)
            for piece in pieces:
                self._to_child.write(piece)
            self._to_child.flush()
            answer = _read_message(self._from_child)
        except (OSError, ValueError) as exc:
            raise ParseProcessDied(f"parse process {self.process.pid}: {exc}") from None
        if answer is None:
            raise ParseProcessDied(f"parse process {self.process.pid} exited")
        assert isinstance(answer, ParseAnswer)
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._to_child.close()  # the child's read ends: it exits
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._from_child.close()


class BodyParser:
    """`parse_body` on the event loop for small bodies, in a parse process for large ones."""

    def __init__(
        self,
        max_containers: int = MIN_CONTAINERS,
        bounds: PromptBounds | None = None,
        processes: int = PARSE_PROCESSES,
    ) -> None:
        self.max_containers = max_containers
        self.bounds = bounds
        self.processes = processes
        self._idle: queue.SimpleQueue[ParseProcess] = queue.SimpleQueue()
        self._all: list[ParseProcess] = []
        self._threads = ThreadPoolExecutor(processes, thread_name_prefix="parse-body")

    def start(self) -> None:
        """Start the parse processes (with the app, once): their start-up is not a body's."""
        while len(self._all) < self.processes:
            self._add()

    def _add(self) -> None:
        process = ParseProcess()
        self._all.append(process)
        self._idle.put(process)

    async def parse(self, data: bytes, route: BodyRoute | None = None) -> ParsedBody:
        """The body's JSON object (APIError(400) if it is none); for a large body, also the
        `route`'s bound, applied in the parse process (see the module docstring)."""
        if len(data) < LARGE_BODY_BYTES:
            return ParsedBody(parse_body(data, self.max_containers))
        self.start()
        job = ParseJob(len(data), self.max_containers, route, self.bounds)
        loop = asyncio.get_running_loop()
        answer = await loop.run_in_executor(self._threads, self._in_process, job, data)
        return answer.parsed()

    def _in_process(self, job: ParseJob, data: bytes) -> ParseAnswer:
        """In a parse-body thread: an idle process parses; one that dies is replaced and the
        body tried once more (a second death is the request's 500)."""
        for attempt in (1, 2):
            process = self._idle.get()  # as many threads as processes: one is idle
            try:
                answer = process.parse(job, (data,))
            except ParseProcessDied as exc:
                logger.warning("%s; starting another (attempt %d for this body)", exc, attempt)
                self._all.remove(process)
                process.close()
                self._add()
                if attempt == 2:
                    raise
                continue
            self._idle.put(process)
            return answer
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        for process in self._all:
            process.close()
        self._all.clear()


def _read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    data = stream.read(size)
    return data if len(data) == size else None


def _read_message(stream: IO[bytes]) -> object | None:
    length = _read_exactly(stream, _LENGTH.size)
    if length is None:
        return None
    payload = _read_exactly(stream, _LENGTH.unpack(length)[0])
    return None if payload is None else pickle.loads(payload)


def serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """The child's loop: one job, its body, its answer; until the gateway closes the pipe."""
    from gateway.requests.memory import reuse_freed_memory

    reuse_freed_memory()
    while True:
        job = _read_message(requests)
        if job is None:
            return
        assert isinstance(job, ParseJob)
        data = _read_exactly(requests, job.body_bytes)
        if data is None:
            return
        answer = pickle.dumps(answer_job(job, data))
        del data
        answers.write(_LENGTH.pack(len(answer)) + answer)
        answers.flush()


def main() -> None:
    """The child: answers on what was stdout, which from here on is stderr (a stray print or
    warning must not corrupt the answers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import gateway.requests.tokenize  # noqa: F401  (what the jobs unpickle, before the first one)

    serve(sys.stdin.buffer, answers)
    os._exit(0)  # nothing to clean up; skip the interpreter's teardown


if __name__ == "__main__":
    main()
