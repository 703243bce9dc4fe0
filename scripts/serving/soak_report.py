"""The soak test's judgement and report: samples -> verdicts -> CSV rows and a markdown summary.

Which sampled quantities are judged by the growth rule (scripts/serving/growth.py), with what
tolerance, is `JUDGED`; the others (kv_cached: bounded by the pool and meant to fill; running:
bounded by --max-running-requests; cumulative errors) are shown but judged otherwise: errors by
the count that appeared during the load, against --max-errors.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from planner.metrics import Summary

from . import growth
from .growth import Tolerance, Verdict, judge
from .probes import Sample

JUDGED: dict[str, Tolerance] = {
    "rss_mib": Tolerance(abs_tol=16.0, rel_tol=0.03),
    "open_fds": Tolerance(abs_tol=8.0, rel_tol=0.10),
    "threads": Tolerance(abs_tol=4.0, rel_tol=0.10),
    "kv_used": Tolerance(abs_tol=0.10),  # fraction of the node's pages
    "queued": Tolerance(abs_tol=8.0, rel_tol=0.5),
    "inflight": Tolerance(abs_tol=8.0, rel_tol=0.5),
    "quarantine": Tolerance(abs_tol=8.0, rel_tol=0.5),
    "rooms_open": Tolerance(abs_tol=8.0, rel_tol=0.5),
    "rooms_unsettled": Tolerance(abs_tol=8.0, rel_tol=0.5),
}
CSV_FIELDS = ("t_s", "process", "quantity", "value")


class SampleLog:
    """Samples kept in memory and appended to a CSV file as they come (a crash keeps them)."""

    def __init__(self, stream: IO[str]) -> None:
        self.samples: list[Sample] = []
        self._writer = csv.writer(stream)
        self._stream = stream
        self._writer.writerow(CSV_FIELDS)

    def add(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            self.samples.append(s)
            self._writer.writerow((f"{s.t:.1f}", s.process, s.quantity, f"{s.value:.6g}"))
        self._stream.flush()

    def series(self, process: str, quantity: str) -> tuple[list[float], list[float]]:
        pairs = [
            (s.t, s.value) for s in self.samples if (s.process, s.quantity) == (process, quantity)
        ]
        return [t for t, _ in pairs], [v for _, v in pairs]

    def series_keys(self) -> list[tuple[str, str]]:
        return sorted({(s.process, s.quantity) for s in self.samples})

    def latest(self, process: str, quantity: str) -> float | None:
        for s in reversed(self.samples):
            if (s.process, s.quantity) == (process, quantity):
                return s.value
        return None


@dataclass
class Findings:
    """Everything the soak concluded; `failed` decides the exit code."""

    verdicts: dict[tuple[str, str], Verdict] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)  # process -> new errors during load
    client_failed: int = 0
    probe_failures: int = 0
    leaks: list[str] = field(default_factory=list)  # integrity problems after the drain
    dead: list[str] = field(default_factory=list)  # processes that exited during the run
    max_errors: int = 0

    @property
    def growing(self) -> list[tuple[str, str]]:
        return [key for key, v in self.verdicts.items() if v.grows]

    @property
    def error_total(self) -> float:
        return sum(self.errors.values()) + self.client_failed

    @property
    def failed(self) -> bool:
        too_many = self.error_total > self.max_errors
        return bool(self.growing or too_many or self.leaks or self.dead)

    def reasons(self) -> list[str]:
        out = [f"{p} {q} grows (rule: scripts/serving/growth.py)" for p, q in self.growing]
        if self.error_total > self.max_errors:
            out.append(f"{self.error_total:g} errors > --max-errors {self.max_errors}")
        out += [f"leak: {line}" for line in self.leaks]
        out += [f"{name} exited during the run" for name in self.dead]
        return out


def judge_samples(log: SampleLog, min_samples: int = 4) -> dict[tuple[str, str], Verdict]:
    verdicts = {}
    for process, quantity in log.series_keys():
        tolerance = JUDGED.get(quantity)
        if tolerance is not None:
            times, values = log.series(process, quantity)
            verdicts[(process, quantity)] = judge(times, values, tolerance, min_samples)
    return verdicts


def new_errors(log: SampleLog, processes: Sequence[str]) -> dict[str, float]:
    """Per process: errors counted from its first sample (taken as the load began) to its last."""
    out = {}
    for process in processes:
        _, values = log.series(process, "errors")
        out[process] = values[-1] - values[0] if values else 0.0
    return out


def verdict_table(verdicts: dict[tuple[str, str], Verdict]) -> list[str]:
    lines = [
        "| process | quantity | baseline | final | peak | fitted rise | slope /h | tolerance "
        "| verdict |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (process, quantity), v in sorted(verdicts.items()):
        word = "too short" if v.too_short else ("GROWS" if v.grows else "bounded")
        lines.append(
            f"| {process} | {quantity} | {v.baseline:.4g} | {v.final:.4g} | {v.peak:.4g} "
            f"| {v.trend:+.3g} | {v.slope_per_hour:+.3g} | {v.tolerance:.3g} | {word} |"
        )
    return lines


def markdown(
    title: str,
    settings: dict[str, object],
    summary: Summary | None,
    findings: Findings,
) -> str:
    lines = [f"# {title}", "", "## Settings", ""]
    lines += [f"- {key}: {value}" for key, value in settings.items()]
    lines += ["", "## Requests", ""]
    if summary is not None:
        s = summary
        lines += [
            f"- completed {s.completed}, failed {s.failed} {dict(s.errors) or ''}".rstrip(),
            f"- throughput {s.request_throughput:.3f} req/s, "
            f"{s.output_token_throughput:.1f} output tok/s over {s.duration_s:.0f} s",
            f"- TTFT ms: median {s.ttft_ms.median:.0f}, p99 {s.ttft_ms.p99:.0f}, "
            f"max {s.ttft_ms.max:.0f}",
            f"- E2E ms: median {s.e2e_ms.median:.0f}, p99 {s.e2e_ms.p99:.0f}, "
            f"max {s.e2e_ms.max:.0f}",
        ]
    lines += ["", "## Errors counted by each process during the load", ""]
    lines += [f"- {p}: {n:g}" for p, n in sorted(findings.errors.items())]
    lines += [f"- client-side failed requests: {findings.client_failed}"]
    lines += [f"- probe failures (scrapes/RPCs that did not answer): {findings.probe_failures}"]
    lines += ["", "## Growth (second half of the run; rule in scripts/serving/growth.py)", ""]
    lines += verdict_table(findings.verdicts)
    lines += ["", "Rule:", "", *rule_lines()]
    lines += ["", "## After the drain", ""]
    lines += [f"- {line}" for line in findings.leaks] or ["- every node idle, 0 pages in use"]
    lines += [f"- {name} exited during the run" for name in findings.dead]
    lines += ["", "## Result", ""]
    reasons = findings.reasons()
    lines += [f"- FAIL: {r}" for r in reasons] or ["- PASS: nothing grew, no error, no leak"]
    return "\n".join(lines) + "\n"


def rule_lines() -> list[str]:
    """The growth rule (growth.py's docstring) and the tolerances, for the report."""
    doc = (growth.__doc__ or "").strip().partition("\n")[2].strip().splitlines()
    lines = [f"> {line}".rstrip() for line in doc]
    lines += ["", "| quantity | abs_tol | rel_tol |", "|---|---:|---:|"]
    lines += [f"| {q} | {t.abs_tol:g} | {t.rel_tol:g} |" for q, t in JUDGED.items()]
    return lines


def write_markdown(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
