"""Slow and careless clients, handled where the connection is (issue 25).

uvicorn times out idle keep-alive connections only. A client that sends headers and one body
byte, or opens connections and sends nothing, or stops reading a stream, holds its socket (and
its request) for as long as it likes. `guarded_protocol` returns uvicorn's httptools protocol
with four guards, all per connection (`ConnectionLimits`), and one economy:

- header timeout: from the connection's start (or, on keep-alive, the next request's first
  byte) to its last header; then 408 and close.
- body timeout: from the last header to the last body byte; then 408 and close. The app sees a
  disconnect and answers nothing more; the request never counted in flight (app.py admits only
  complete bodies).
- connections per client address: beyond the cap a new connection is answered 429 and closed
  before anything is read.
- stream stall: a response whose client takes no byte for `stream_stall_timeout_s` has its
  connection aborted. The app then sees a disconnect, which cancels the stream and aborts the
  request on its nodes (their pages are freed). The stall is the kernel's to see: bytes wait
  for the client and none has gone out since its receive window closed (`_stalled_for`, Linux's
  `TCP_INFO` and `SIOCOUTQ`); a response in progress is looked at every `STALL_CHECK_S`, so
  the stream ends at most that much after its timeout. The transport pausing writes (its
  buffer full) was the old start of the clock: that comes only once the kernel's buffer and the
  transport's have filled at the stream's token rate, 1.4 to 2.7 s late on a 2 s timeout in
  tests/test_hostile_clients.py. It stays as the clock where the kernel does not say (another
  OS) or keeps sending (retransmissions to a peer that vanished). A connection's kernel send
  buffer is capped at `SEND_BUFFER_BYTES` (Linux doubles it) and its transport buffer at the
  same: otherwise they grow to megabytes for a client that does not read, pinning memory.
  Token streams need far less; the cost is a throughput cap of about 64 KiB per round trip
  for one large non-streamed answer on a long-RTT link. The check costs two system calls per
  streaming connection per `STALL_CHECK_S`.
- large bodies handed over whole: uvicorn pauses reading at every 64 KiB of body and wakes the
  app, which copies what came (its bytearray into bytes) and asks for more: for a 3.9 MB body
  about 20 wake-ups and, with the app's join, four copies on the event loop (6 ms of its time
  a body on the 2-core test host, the gateway's largest share of a burst of them). A body whose
  declared `Content-Length` is at least `LARGE_BODY_BYTES` and within `--max-body-bytes` is
  kept as the pieces the parser gives, without pausing, and handed to the app once complete,
  joined once (uvicorn passes a `bytes` body on without copying it). It holds no more memory
  than the app would have; a larger declared length is answered 413 by the app at once, as
  before, and a body sent without a length takes uvicorn's path.

Why a protocol subclass and not ASGI middleware: an ASGI app is called only once the headers are
complete, never sees connections that send nothing, and cannot see write back-pressure (its
`send` just waits). The transport events (`connection_made`, the parser's callbacks,
`pause_writing`) are where all four are visible. The subclass uses uvicorn's documented
protocol hooks plus `cycle` and `transport`, which tests/test_hostile_clients.py exercises.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import socket
import struct
import sys
import termios
from collections import Counter
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import ConnectionLimits
from gateway.errors import APIError
from gateway.requests.body import LARGE_BODY_BYTES

SEND_BUFFER_BYTES = 32 << 10
STALL_CHECK_S = 0.5  # (at most a quarter of the timeout) how often a response looks for a stall


def _raw_error(exc: APIError) -> bytes:
    body = json.dumps(exc.body()).encode()
    reason = {408: b"Request Timeout", 429: b"Too Many Requests"}.get(exc.status, b"Error")
    head = b"HTTP/1.1 %d %s\r\n" % (exc.status, reason)
    for name, value in exc.headers.items():
        head += f"{name}: {value}\r\n".encode()
    head += b"content-type: application/json\r\nconnection: close\r\n"
    head += b"content-length: %d\r\n\r\n" % len(body)
    return head + body


def _timeout_error(what: str, seconds: float, flag: str) -> bytes:
    message = (
        f"the client sent no complete request {what} within {seconds:g} s ({flag}): send the "
        "whole request at once"
    )
    return _raw_error(APIError(408, message, code="request_timeout"))


# struct tcp_info (linux/tcp.h): `tcpi_last_data_sent`, milliseconds since data last went out
_LAST_DATA_SENT = struct.Struct("=I")
_LAST_DATA_SENT_AT = 44
_TCP_INFO_BYTES = 64


def _stalled_for(sock: socket.socket | None) -> float | None:
    """Seconds that bytes have waited for the peer with none sent (its receive window shut); 0
    when none wait; None where the kernel does not say."""
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
        waiting = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4))  # == SIOCOUTQ
    except OSError:
        return None
    if len(info) < _LAST_DATA_SENT_AT + _LAST_DATA_SENT.size:
        return None
    if not int.from_bytes(waiting, sys.byteorder):
        return 0.0
    (ms,) = _LAST_DATA_SENT.unpack_from(info, _LAST_DATA_SENT_AT)
    return float(ms) / 1000


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def guarded_protocol(
    limits: ConnectionLimits,
    max_body_bytes: int = 0,
    on_connection: Callable[[], None] | None = None,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the four guards; one connection count per process.
    Bodies declared between LARGE_BODY_BYTES and `max_body_bytes` are handed over whole.
    `on_connection` is called for every connection accepted (refused ones too)."""
    open_per_client: Counter[str] = Counter()
    too_many = _raw_error(
        APIError(
            429,
            f"this client address has {limits.max_connections_per_client} connections open "
            "(--max-connections-per-client): reuse them, or close some first",
            type_="rate_limit_error",
            code="too_many_connections",
            headers={"Retry-After": "1"},
        )
    )
    check_s = min(STALL_CHECK_S, limits.stream_stall_timeout_s / 4)
    header_late = _timeout_error("header", limits.header_timeout_s, "--header-timeout")
    body_late = _timeout_error("body", limits.body_timeout_s, "--body-timeout")

    class GuardedProtocol(HttpToolsProtocol):
        _peer: str | None = None  # counted under this address while open
        _timer: asyncio.TimerHandle | None = None  # the header, body or stall deadline
        _whole: list[bytes] | None = None  # a large body's pieces, handed to the app at its end
        _stall_check: asyncio.TimerHandle | None = None  # while a response is in progress

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if on_connection is not None:
                on_connection()
            peer = self.client[0] if self.client else ""
            if open_per_client[peer] >= limits.max_connections_per_client:
                transport.write(too_many)
                transport.close()
                return
            open_per_client[peer] += 1
            self._peer = peer
            transport.set_write_buffer_limits(high=SEND_BUFFER_BYTES)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self._arm(limits.header_timeout_s, header_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._check_stall_in(None)
            self._whole = None
            if self._peer is not None:
                open_per_client[self._peer] -= 1
                if open_per_client[self._peer] <= 0:
                    del open_per_client[self._peer]
                self._peer = None
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._timer is None:  # a keep-alive connection's next request
                self._arm(limits.header_timeout_s, header_late)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(limits.body_timeout_s, body_late)
            declared = _declared_length(self.headers)
            large = declared is not None and LARGE_BODY_BYTES <= declared <= max_body_bytes
            self._whole = [] if large and not self.parser.should_upgrade() else None

        def on_body(self, body: bytes) -> None:
            if self._whole is None:
                super().on_body(body)
            elif not self.cycle.response_complete:
                self._whole.append(body)  # no pause, no wake-up: the app waits for the end

        def on_message_complete(self) -> None:
            if self._whole is not None and not self.cycle.response_complete:
                self.cycle.body = b"".join(self._whole)  # type: ignore[assignment]
            self._whole = None
            super().on_message_complete()
            self._disarm()
            self._check_stall_in(check_s)

        def pause_writing(self) -> None:
            super().pause_writing()
            self._arm(limits.stream_stall_timeout_s, None)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._disarm()

        def _arm(self, seconds: float, answer: bytes | None) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expire, answer)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _check_stall_in(self, seconds: float | None) -> None:
            if self._stall_check is not None:
                self._stall_check.cancel()
            self._stall_check = None
            if seconds is not None:
                self._stall_check = self.loop.call_later(seconds, self._check_stall)

        def _check_stall(self) -> None:
            self._stall_check = None
            cycle = self.cycle
            if self.transport.is_closing() or cycle is None or cycle.response_complete:
                return
            stalled_s = _stalled_for(self.transport.get_extra_info("socket"))
            if stalled_s is None:
                return  # the kernel does not say: the transport's pause starts the clock
            if stalled_s >= limits.stream_stall_timeout_s:
                self.transport.abort()
                return
            self._check_stall_in(check_s)

        def _expire(self, answer: bytes | None) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            if answer is None:  # a stalled stream: nothing more can be written anyway
                self.transport.abort()
                return
            cycle = self.cycle  # the previous request's on a keep-alive connection
            if cycle is None or cycle.response_complete or not cycle.response_started:
                self.transport.write(answer)
            self.transport.close()

    return GuardedProtocol
