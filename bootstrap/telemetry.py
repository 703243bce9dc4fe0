"""Logging and the Prometheus port, the same in every pdserve process.

It lives here, not in `engine/`, because every process imports `bootstrap` (the bootstrap
server, and the client in nodes and the gateway) while importing `engine` loads torch, which the
bootstrap-server must not pay for.

Log lines: `time level component room message`, e.g.

    2026-11-22T05:31:03.123Z INFO prefill room=4711 KV write failed: ...

`component` is the logger name without the `pdserve.` prefix; `room` is the bootstrap room of the
request the line is about, or `-`. It is taken from, in order: `extra={"room": n}` on the call,
the `current_room` context variable (set by the gateway and the node RPC handlers for the
request they serve, so every line logged while serving it carries it), or a `room N` in the
message itself. `--log-format json` writes the same fields as one JSON object per line.

Metrics: each process keeps its metrics in its own `CollectorRegistry` (no global state) and,
with `--metrics-port`, serves them as `GET /metrics` on a small HTTP port of its own (the
gateway serves /metrics on its API port instead).
"""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
import re
import sys
import threading
import time
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")

current_room: contextvars.ContextVar[int] = contextvars.ContextVar("pdserve_room", default=0)

_ROOM_IN_MESSAGE = re.compile(r"\broom (\d+)\b")


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"
    format: str = "text"  # text | json

    def __post_init__(self) -> None:
        if self.level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}, got {self.level!r}")
        if self.format not in LOG_FORMATS:
            raise ValueError(f"--log-format must be one of {LOG_FORMATS}, got {self.format!r}")


def add_log_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--log-level` and `--log-format` on an argparse parser or argument group."""
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    parser.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text: `time level component room message`; json: one object per line",
    )


def add_metrics_port_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics as GET /metrics on this HTTP port (default: off; "
        "0: a free port, logged)",
    )


class RoomFilter(logging.Filter):
    """Gives every record `room` (int, 0 = none) and `component` attributes."""

    def filter(self, record: logging.LogRecord) -> bool:
        room = getattr(record, "room", None)
        if not room:
            room = current_room.get()
        if not room:
            match = _ROOM_IN_MESSAGE.search(record.getMessage())
            room = int(match.group(1)) if match else 0
        record.room = room
        record.component = record.name.removeprefix("pdserve.")
        return True


def _utc_time(record: logging.LogRecord) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        room = getattr(record, "room", 0) or "-"
        component = getattr(record, "component", record.name)
        line = f"{_utc_time(record)} {record.levelname} {component} room={room} "
        line += record.getMessage()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, object] = {
            "time": _utc_time(record),
            "level": record.levelname,
            "component": getattr(record, "component", record.name),
            "room": getattr(record, "room", 0) or None,
            "message": record.getMessage(),
        }
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False)


def configure_logging(config: LogConfig) -> None:
    """Root handler on stderr in the chosen format; replaces any earlier configuration."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RoomFilter())
    handler.setFormatter(JsonFormatter() if config.format == "json" else TextFormatter())
    logging.basicConfig(level=config.level.upper(), handlers=[handler], force=True)


class MetricsServer:
    """`GET /metrics` for one registry on its own HTTP port (a daemon thread)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise OSError(
                f"cannot serve metrics on {host}:{port} (--metrics-port): {exc.strerror}"
            ) from None
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.address = f"{host}:{server.server_address[1]}"
        logging.getLogger("pdserve.metrics").info("metrics on http://%s/metrics", self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None) -> MetricsServer | None:
    """Start the metrics port when one is configured (`None`: no metrics port)."""
    return None if port is None else MetricsServer(registry, host, port)
