"""One streamed request to an OpenAI-compatible server, recorded as a `RequestTrace`.

Random and prefix prompts (token ids) go to /v1/completions; chat turns to /v1/chat/completions
with the session's history. Every request streams with `stream_options.include_usage`, so the
token counts are the server's; a server that sends no usage gets the chunk count instead.
A failure never raises: it becomes the trace's error type (http_<status>, connect_error,
timeout, stream_error, read_error, no_output) and a one-line detail.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from planner.datasets import RequestSpec
from planner.metrics import RequestTrace


class ServerUnreachable(RuntimeError):
    """The base URL does not answer like an OpenAI-compatible server."""


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # without /v1
    model: str
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 600.0
    api_key: str = ""


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {url!r}")
    return url.removesuffix("/v1")


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model of GET /v1/models; ServerUnreachable with the reason if it fails."""
    try:
        response = httpx.get(base_url + "/v1/models", timeout=timeout_s)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except httpx.ConnectError as exc:
        raise ServerUnreachable(f"cannot connect to {base_url}: {exc}; is the server up?") from None
    except httpx.TimeoutException:
        raise ServerUnreachable(f"{base_url} did not answer within {timeout_s:g} s") from None
    except httpx.HTTPStatusError as exc:
        raise ServerUnreachable(
            f"{base_url}/v1/models answered HTTP {exc.response.status_code}: not an "
            "OpenAI-compatible server, or pass --model"
        ) from None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ServerUnreachable(f"{base_url}/v1/models gave no model list: {exc}") from None


def request_body(
    config: ClientConfig, spec: RequestSpec, history: list[dict[str, str]], system: str = ""
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) for one request."""
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": spec.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True  # an extension (vLLM, SGLang, pdserve); others ignore it
    if spec.chat:
        first = [{"role": "system", "content": system}] if system else []
        body["messages"] = [*first, *history, {"role": "user", "content": spec.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = list(spec.prompt) if isinstance(spec.prompt, tuple) else spec.prompt
    return "/v1/completions", body


async def send(
    http: httpx.AsyncClient,
    config: ClientConfig,
    spec: RequestSpec,
    history: list[dict[str, str]],
    clock_zero: float,
    system: str = "",
) -> tuple[RequestTrace, str]:
    """Send one request and stream it to the end: (trace, the generated text)."""
    path, body = request_body(config, spec, history, system)
    trace = RequestTrace(
        sent=time.perf_counter() - clock_zero,
        prompt_tokens=spec.prompt_len,
        reusable_tokens=spec.reusable_tokens,
    )
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return _failed(trace, clock_zero, f"http_{response.status_code}", detail), ""
            async for line in response.aiter_lines():
                if line.startswith(TIMING_COMMENT):  # the stream's last comment
                    trace.timing_ms = parse_server_timing(line[len(TIMING_COMMENT) :])
                    continue
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    detail = str(error.get("message", error) if isinstance(error, dict) else error)
                    return _failed(trace, clock_zero, "stream_error", detail[:200]), ""
                text = _chunk_text(event)
                if text:
                    trace.chunks.append(time.perf_counter() - clock_zero)
                    pieces.append(text)
                usage = event.get("usage") or usage
    except httpx.ConnectError as exc:
        return _failed(trace, clock_zero, "connect_error", str(exc)), ""
    except httpx.TimeoutException as exc:
        return _failed(trace, clock_zero, "timeout", str(exc) or type(exc).__name__), ""
    except (httpx.HTTPError, ValueError) as exc:
        return _failed(trace, clock_zero, "read_error", str(exc) or type(exc).__name__), ""
    trace.done = time.perf_counter() - clock_zero
    if usage:
        trace.prompt_tokens = int(usage.get("prompt_tokens") or trace.prompt_tokens)
        trace.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        trace.cached_tokens = int(details.get("cached_tokens") or 0)
    trace.output_tokens = trace.output_tokens or len(trace.chunks)
    if not trace.chunks:
        trace.error, trace.error_detail = "no_output", "the stream ended without any text"
    return trace, "".join(pieces)


TIMING_COMMENT = ": Server-Timing: "  # how the gateway ends a stream (gateway/api/app.py)


def parse_server_timing(value: str) -> dict[str, float]:
    """`name;dur=12.5, other;dur=3` -> {"name": 12.5, "other": 3.0} (ms); entries without a
    duration are skipped."""
    found = {}
    for entry in value.split(","):
        name, _, params = entry.strip().partition(";")
        for param in params.split(";"):
            key, _, number = param.strip().partition("=")
            if key == "dur" and name:
                with contextlib.suppress(ValueError):
                    found[name] = float(number)
    return found


def _chunk_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or "")


def _failed(trace: RequestTrace, clock_zero: float, kind: str, detail: str) -> RequestTrace:
    trace.done = time.perf_counter() - clock_zero
    trace.error, trace.error_detail = kind, detail
    return trace
