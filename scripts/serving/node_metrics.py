"""A node's step split over a run, from the Prometheus metrics it already exports.

`--watch-metrics NAME=URL` names a node's /metrics (pd-cluster prints one
`[pd-cluster] metrics <name> <url>` line per process). It is read before and after the run;
the report shows the deltas: steps, decode and prefill tokens, and model-forward seconds
(engine/metrics.py: `pdserve_node_forward_seconds`, observed once per step with the step's
forward time). Over the run's wall time that gives the forward's share of the node's time.

What the node does not export (so the report lists it as missing instead of guessing): the time
per step spent scheduling and building the batch, the time spent turning the step's output into
streamed chunks (and the gRPC send), and the whole step's time, of which the forward is a part
(StepStats.step_s exists in engine/scheduler.py but no metric carries it).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from .probes import metric_values

FORWARD = "pdserve_node_forward_seconds"
COUNTERS = {
    "decode_tokens": "pdserve_node_decode_tokens_total",
    "prefill_tokens": "pdserve_node_prefill_tokens_total",
}
MISSING = (
    "scheduling + batch building per step",
    "output processing + streaming per step",
    "whole step time (StepStats.step_s is not exported)",
)


class MetricsError(RuntimeError):
    """A node's /metrics could not be read; the message names the URL."""


@dataclass(frozen=True)
class NodeReading:
    steps: float
    forward_s: float
    decode_tokens: float
    prefill_tokens: float

    def __sub__(self, other: NodeReading) -> NodeReading:
        return NodeReading(
            self.steps - other.steps,
            self.forward_s - other.forward_s,
            self.decode_tokens - other.decode_tokens,
            self.prefill_tokens - other.prefill_tokens,
        )


def parse_reading(text: str) -> NodeReading:
    samples = {name: sum(v for _, v in values) for name, values in metric_values(text).items()}
    return NodeReading(
        steps=samples.get(f"{FORWARD}_count", 0.0),
        forward_s=samples.get(f"{FORWARD}_sum", 0.0),
        decode_tokens=samples.get(COUNTERS["decode_tokens"], 0.0),
        prefill_tokens=samples.get(COUNTERS["prefill_tokens"], 0.0),
    )


def read_metrics(url: str, timeout_s: float = 10.0) -> NodeReading:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return parse_reading(response.read().decode())
    except (OSError, ValueError) as exc:
        raise MetricsError(f"cannot read {url}: {exc}; is it the node's --metrics-port?") from None


@dataclass(frozen=True)
class StepSplit:
    """One node over one run: the deltas and what they mean per step and per wall second."""

    name: str
    delta: NodeReading
    wall_s: float

    @property
    def forward_ms_per_step(self) -> float:
        return self.delta.forward_s * 1e3 / self.delta.steps if self.delta.steps else 0.0

    @property
    def forward_share(self) -> float:
        """Forward seconds / wall seconds: the rest is scheduling, output, idle and waiting."""
        return self.delta.forward_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_step(self) -> float:
        return self.delta.decode_tokens / self.delta.steps if self.delta.steps else 0.0


@dataclass
class MetricsWatch:
    targets: Sequence[tuple[str, str]]  # (name, /metrics URL)
    _before: dict[str, NodeReading] | None = None
    _started_at: float = 0.0

    def start(self, now: float) -> None:
        self._before = {name: read_metrics(url) for name, url in self.targets}
        self._started_at = now

    def stop(self, now: float) -> list[StepSplit]:
        assert self._before is not None, "start() first"
        wall = now - self._started_at
        return [
            StepSplit(name, read_metrics(url) - self._before[name], wall)
            for name, url in self.targets
        ]


def parse_target(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith("http"):
        raise ValueError(f"--watch-metrics wants NAME=http://HOST:PORT/metrics, got {text!r}")
    return name, url
