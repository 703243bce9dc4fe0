"""Output of a benchmark run: the summary table, the JSON document and the PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from planner.metrics import Distribution, RequestTrace, Summary

from .node_metrics import StepSplit
from .procstat import ProcessCpu


def table(summary: Summary, title: str) -> str:
    s = summary
    rows: list[tuple[str, str]] = [
        ("Successful requests", f"{s.completed}"),
        ("Failed requests", f"{s.failed}"),
    ]
    rows += [(f"  errors: {kind}", f"{n}") for kind, n in sorted(s.errors.items())]
    rows += [
        ("Benchmark duration (s)", f"{s.duration_s:.2f}"),
        ("Total input tokens", f"{s.input_tokens}"),
        ("Total output tokens", f"{s.output_tokens}"),
        ("Request throughput (req/s)", f"{s.request_throughput:.3f}"),
        ("Output token throughput (tok/s)", f"{s.output_token_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:.2f}"),
    ]
    if s.goodput is not None and s.slo_attainment is not None:
        rows += [
            ("Goodput (req/s)", f"{s.goodput:.3f}"),
            ("SLO attainment", f"{s.slo_attainment:.1%}"),
        ]
    width = 44
    lines = [f"{' ' + title + ' ':=^{width + 14}}"]
    lines += [f"{name:<{width}}{value:>14}" for name, value in rows]
    for label, dist in (
        ("TTFT", s.ttft_ms),
        ("TPOT", s.tpot_ms),
        ("ITL", s.itl_ms),
        ("E2E", s.e2e_ms),
    ):
        lines.append(f"{' ' + label + ' (ms) ':-^{width + 14}}")
        for stat in ("mean", "median", "p90", "p99", "max"):
            lines.append(f"{f'{stat} {label}':<{width}}{getattr(dist, stat):>14.2f}")
    lines.append("=" * (width + 14))
    return "\n".join(lines)


def document(
    summary: Summary, traces: Sequence[RequestTrace], settings: dict[str, Any]
) -> dict[str, Any]:
    """Every field: the settings, the summary and each request's trace."""
    return {
        "settings": _finite(settings),
        "summary": asdict(summary),
        "requests": [{**asdict(t), "ttft": t.ttft, "tpot": t.tpot, "e2e": t.e2e} for t in traces],
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def _finite(settings: dict[str, Any]) -> dict[str, Any]:
    """JSON has no inf: an infinite rate is written as the string "inf"."""
    return {
        k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in settings.items()
    }


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or an ImportError that says what to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "plots need matplotlib: pip install -e '.[bench]' (or pip install matplotlib)"
        ) from None
    return plt


def plot(traces: Sequence[RequestTrace], out_dir: Path, prefix: str) -> list[Path]:
    """Latency CDFs, TTFT and TPOT over time, throughput over time: one PNG each."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = [t for t in traces if t.ok]
    paths = []

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    series = {
        "TTFT": [t.ttft for t in ok if t.ttft is not None],
        "TPOT": [t.tpot for t in ok if t.tpot is not None],
        "ITL": [g for t in ok for g in t.itls],
        "E2E": [t.e2e for t in ok],
    }
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        ms = sorted(v * 1000 for v in values)
        ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))] if ms else [])
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
    paths.append(_save(fig, out_dir / f"{prefix}latency_cdf.png", plt))

    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    for ax, name, getter in (
        (axes[0], "TTFT", lambda t: t.ttft),
        (axes[1], "TPOT", lambda t: t.tpot),
    ):
        points = [(t.sent, getter(t)) for t in ok if getter(t) is not None]
        ax.scatter([p[0] for p in points], [p[1] * 1000 for p in points], s=8)
        ax.set(title=f"{name} by send time", xlabel="send time (s)", ylabel="ms")
        ax.grid(alpha=0.3)
    paths.append(_save(fig, out_dir / f"{prefix}latency_over_time.png", plt))

    fig, ax = plt.subplots(figsize=(8, 3.6))
    seconds, tokens, requests = throughput_series(ok)
    ax.plot(seconds, tokens, label="output tok/s")
    ax.set(title="throughput over time", xlabel="time (s)", ylabel="tokens / s")
    ax2 = ax.twinx()
    ax2.plot(seconds, requests, color="tab:orange", label="completed req/s")
    ax2.set_ylabel("requests / s")
    ax.grid(alpha=0.3)
    fig.legend(loc="upper right")
    paths.append(_save(fig, out_dir / f"{prefix}throughput_over_time.png", plt))
    return paths


def throughput_series(
    traces: Sequence[RequestTrace], bucket_s: float = 1.0
) -> tuple[list[float], list[float], list[float]]:
    """Per bucket: its start, output tokens per second, completed requests per second."""
    end = max((t.done for t in traces), default=0.0)
    n = max(1, math.ceil(end / bucket_s))
    tokens = [0.0] * n
    requests = [0.0] * n
    for t in traces:
        per_chunk = t.output_tokens / len(t.chunks) if t.chunks else 0.0
        for at in t.chunks:
            tokens[min(int(at / bucket_s), n - 1)] += per_chunk / bucket_s
        requests[min(int(t.done / bucket_s), n - 1)] += 1 / bucket_s
    return [i * bucket_s for i in range(n)], tokens, requests


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cpu_table(usages: Sequence[ProcessCpu], output_tokens: int) -> str:
    """Per process: CPU seconds, % of one core over the run, CPU-us per streamed token of the
    whole run, and for a client its event loop's lateness."""
    lines = [
        "| process | pids | CPU s | % of a core | CPU-us / streamed token "
        "| event-loop lag p99 ms | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for u in usages:
        per_token = u.us_per_token(output_tokens)
        lag = "-" if u.loop_lag_p99_ms is None else f"{u.loop_lag_p99_ms:.1f}"
        lines.append(
            f"| {u.name} | {' '.join(map(str, u.pids))} | {u.cpu_s:.2f} "
            f"| {u.core_fraction:.0%} | {'-' if per_token is None else f'{per_token:.1f}'} "
            f"| {lag} | {u.note} |"
        )
    return "\n".join(lines)


# The gateway's segments up to the first token, then the rest (gateway/dispatch/timeline.py's
# order).
TTFT_SEGMENTS = (
    "gateway_queue", "prefill_bootstrap_wait", "prefill_queue", "prefill", "transfer",
    "decode_queue", "decode_first",
)  # fmt: skip
LATER_SEGMENTS = ("decode", "rpc", "e2e", "transfer_kv")


def timing_table(traces: Sequence[RequestTrace]) -> str:
    """Where the time went, from the gateway's own breakdown of each completed request
    (`Server-Timing`): mean, p50 and p99 ms per segment, and each TTFT segment's share of their
    sum; "" when no request carried one."""
    timed = [t.timing_ms for t in traces if t.ok and t.timing_ms]
    if not timed:
        return ""
    ttft_total = sum(sum(t.get(n, 0.0) for n in TTFT_SEGMENTS) for t in timed)
    lines = [
        f"Server-side breakdown of {len(timed)} requests (ms; TTFT segments first):",
        "| segment | mean | p50 | p99 | share of TTFT |",
        "|---|---|---|---|---|",
    ]
    for name in (*TTFT_SEGMENTS, *LATER_SEGMENTS):
        values = sorted(t[name] for t in timed if name in t)
        if not values:
            continue
        share = sum(values) / ttft_total if name in TTFT_SEGMENTS and ttft_total > 0 else None
        lines.append(
            f"| {name} | {sum(values) / len(values):.1f} | {_pct(values, 0.5):.1f} "
            f"| {_pct(values, 0.99):.1f} | {'' if share is None else f'{share:.0%}'} |"
        )
    return "\n".join(lines)


def _pct(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def step_table(splits: Sequence[StepSplit]) -> str:
    """Per node: its engine thread's step split (model forward, scheduling and sampling, role
    hooks and output) from its /metrics."""
    lines = [
        "| node | steps | decode tok / step | forward ms / step | schedule + sample ms / step "
        "| role + output ms / step | forward / wall | engine loop / wall |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for s in splits:
        d, busy = s.delta, s.busy_share
        lines.append(
            f"| {s.name} | {d.steps:.0f} | {s.decode_tokens_per_step:.1f} "
            f"| {s.forward_ms_per_step:.2f} | {ms(s.schedule_ms_per_step)} "
            f"| {ms(s.output_ms_per_step)} | {s.forward_share:.0%} "
            f"| {'-' if busy is None else f'{busy:.0%}'} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class CacheSummary:
    """Prompt tokens a prefix cache saved (the server's `cached_tokens`) beside the most the
    workload allows: per request, what the dataset says other requests computed before
    (`reusable_tokens`) or its own session's previous turn (prompt + output), whichever is
    more, in whole `block` tokens, and never the whole prompt."""

    prompt_tokens: int
    cached_tokens: int
    best_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def best_rate(self) -> float:
        return self.best_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def best_cached(traces: Sequence[RequestTrace], block: int = 1) -> list[int]:
    """The best hit of each trace (in the order given), see `CacheSummary`."""
    previous: dict[int, RequestTrace] = {}
    best = []
    for t in sorted(traces, key=lambda t: (t.session, t.turn)):
        history = 0
        before = previous.get(t.session)
        if before is not None and t.turn == before.turn + 1:
            history = before.prompt_tokens + before.output_tokens
        tokens = min(max(t.reusable_tokens, history), max(t.prompt_tokens - 1, 0))
        best.append((id(t), tokens // block * block))
        previous[t.session] = t
    by_id = dict(best)
    return [by_id[id(t)] for t in traces]


def cache_summary(traces: Sequence[RequestTrace], block: int = 1) -> CacheSummary:
    ok = [t for t in traces if t.ok]
    return CacheSummary(
        sum(t.prompt_tokens for t in ok),
        sum(t.cached_tokens for t in ok),
        sum(best_cached(ok, block)),
    )


def turn_table(traces: Sequence[RequestTrace], block: int = 1) -> str:
    """Per turn index: requests, TTFT percentiles, the measured and the best cache hit rate."""
    ok = [t for t in traces if t.ok]
    best = dict(zip(map(id, ok), best_cached(ok, block), strict=True))
    lines = [
        "| turn | requests | TTFT p50 ms | TTFT p90 ms | TTFT mean ms | prompt tokens "
        "| cache hit | best hit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for turn in sorted({t.turn for t in ok}):
        group = [t for t in ok if t.turn == turn]
        ttft = Distribution.of_seconds([t.ttft for t in group if t.ttft is not None])
        cache = CacheSummary(
            sum(t.prompt_tokens for t in group),
            sum(t.cached_tokens for t in group),
            sum(best[id(t)] for t in group),
        )
        lines.append(
            f"| {turn + 1} | {len(group)} | {ttft.median:.1f} | {ttft.p90:.1f} | {ttft.mean:.1f} "
            f"| {cache.prompt_tokens} | {cache.hit_rate:.1%} | {cache.best_rate:.1%} |"
        )
    total = cache_summary(ok, block)
    lines.append(
        f"| all | {len(ok)} | | | | {total.prompt_tokens} | {total.hit_rate:.1%} "
        f"| {total.best_rate:.1%} |"
    )
    return "\n".join(lines)
