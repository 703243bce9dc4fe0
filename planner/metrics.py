"""Serving metrics from per-request timestamp traces, defined as the usual serving benchmarks do.

- TTFT: request sent -> first streamed chunk that carries output text.
- ITL: every gap between consecutive output chunks of a request (all requests pooled).
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests with one token have none.
- E2E: request sent -> end of its stream.
- Request / token throughput: completed requests (tokens) / benchmark duration.
- Goodput: completed requests meeting every given SLO (TTFT, TPOT, E2E) / benchmark duration.

Times in a trace are seconds since the benchmark started; figures are reported in ms.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


class SLOError(ValueError):
    """SLO flags that no request could meet, or that are not positive finite numbers."""


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            flag = "--slo-" + name.replace("_", "-")
            if value is not None and not (math.isfinite(value) and value > 0):
                raise SLOError(f"{flag} must be a positive number of milliseconds, got {value}")
        if self.ttft_ms is not None and self.e2e_ms is not None and self.e2e_ms < self.ttft_ms:
            raise SLOError(
                f"--slo-e2e-ms {self.e2e_ms:g} is below --slo-ttft-ms {self.ttft_ms:g}: a "
                "request's end-to-end time includes its TTFT, so no request could meet both"
            )

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


@dataclass
class RequestTrace:
    """What the client saw of one request (times in seconds since the benchmark started)."""

    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with output text
    done: float = 0.0  # end of the stream (or the failure)
    prompt_tokens: int = 0  # the server's usage; the dataset's estimate if it sent none
    output_tokens: int = 0  # the server's usage; the number of chunks if it sent none
    error: str = ""  # "" on success, else the error type (e.g. http_503, connect_error)
    error_detail: str = ""
    session: int = 0
    turn: int = 0
    # The gateway's breakdown of this request (its `Server-Timing`, ms per segment; see
    # gateway/dispatch/timeline.py); empty where the server sent none.
    timing_ms: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (0 if not sent)
    reusable_tokens: int = 0  # a perfect cache's hit, as the dataset knows it (datasets.py)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)

    def meets(self, slo: SLO) -> bool:
        if not self.ok:
            return False
        ttft, tpot = self.ttft, self.tpot
        if slo.ttft_ms is not None and (ttft is None or ttft * 1000 > slo.ttft_ms):
            return False
        # A one-token request has no TPOT: that SLO does not apply to it.
        if slo.tpot_ms is not None and tpot is not None and tpot * 1000 > slo.tpot_ms:
            return False
        return slo.e2e_ms is None or self.e2e * 1000 <= slo.e2e_ms


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency in milliseconds (all zero, count 0, when nothing was measured)."""

    count: int = 0
    mean: float = 0.0
    median: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls()
        ms = [v * 1000 for v in values]
        return cls(
            count=len(ms),
            mean=sum(ms) / len(ms),
            median=percentile(ms, 50),
            p90=percentile(ms, 90),
            p99=percentile(ms, 99),
            max=max(ms),
        )


@dataclass(frozen=True)
class Summary:
    duration_s: float
    completed: int
    failed: int
    errors: dict[str, int]
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    input_token_throughput: float  # prompt tokens of completed requests / s
    output_token_throughput: float
    total_token_throughput: float
    goodput: float | None  # requests / s meeting every SLO; None without SLOs
    slo_attainment: float | None  # fraction of all requests meeting every SLO
    ttft_ms: Distribution
    itl_ms: Distribution
    tpot_ms: Distribution
    e2e_ms: Distribution


def summarize(traces: Sequence[RequestTrace], duration_s: float, slo: SLO) -> Summary:
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be > 0 s, got {duration_s}")
    ok = [t for t in traces if t.ok]
    good = sum(1 for t in traces if t.meets(slo))
    input_tokens = sum(t.prompt_tokens for t in ok)
    output_tokens = sum(t.output_tokens for t in ok)
    return Summary(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(traces) - len(ok),
        errors=dict(Counter(t.error for t in traces if not t.ok)),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        input_token_throughput=input_tokens / duration_s,
        output_token_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        goodput=good / duration_s if slo.given else None,
        slo_attainment=(good / len(traces) if traces else 0.0) if slo.given else None,
        ttft_ms=Distribution.of_seconds([t.ttft for t in ok if t.ttft is not None]),
        itl_ms=Distribution.of_seconds([gap for t in ok for gap in t.itls]),
        tpot_ms=Distribution.of_seconds([t.tpot for t in ok if t.tpot is not None]),
        e2e_ms=Distribution.of_seconds([t.e2e for t in ok]),
    )
