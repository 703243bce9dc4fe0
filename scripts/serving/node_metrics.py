"""A node's step split over a run, from the Prometheus metrics it already exports.

`--watch-metrics NAME=URL` names a node's /metrics (pd-cluster prints one
`[pd-cluster] metrics <name> <url>` line per process). It is read before and after the run;
the report shows the deltas and the step split (engine/metrics.py, each observed once per
step): the model forward (`pdserve_node_forward_seconds`), the rest of the scheduler's step,
i.e. scheduling, batch building and sampling (`pdserve_node_step_seconds` minus the forward),
and the rest of the engine loop's iteration, i.e. the role's hooks and turning the step's
outputs into one batch for the streams (`pdserve_node_loop_seconds` minus the step). Over the
run's wall time the three give the engine thread's busy share; the gRPC and HTTP side runs on
other threads (their CPU is in the per-process rows). With the overlap scheduler the "forward"
is the launch, and waiting for the previous step's tokens counts in the scheduler's rest.
A node of an older build exports the forward only: the other columns then read "-".
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
STEP = "pdserve_node_step_seconds"
LOOP = "pdserve_node_loop_seconds"


class MetricsError(RuntimeError):
    """A node's /metrics could not be read; the message names the URL."""


@dataclass(frozen=True)
class NodeReading:
    steps: float
    forward_s: float
    decode_tokens: float
    prefill_tokens: float
    step_s: float = 0.0  # whole scheduler steps (0: not exported)
    loop_s: float = 0.0  # whole engine-loop iterations with a step (0: not exported)

    def __sub__(self, other: NodeReading) -> NodeReading:
        return NodeReading(
            self.steps - other.steps,
            self.forward_s - other.forward_s,
            self.decode_tokens - other.decode_tokens,
            self.prefill_tokens - other.prefill_tokens,
            self.step_s - other.step_s,
            self.loop_s - other.loop_s,
        )


def parse_reading(text: str) -> NodeReading:
    samples = {name: sum(v for _, v in values) for name, values in metric_values(text).items()}
    return NodeReading(
        steps=samples.get(f"{FORWARD}_count", 0.0),
        forward_s=samples.get(f"{FORWARD}_sum", 0.0),
        decode_tokens=samples.get(COUNTERS["decode_tokens"], 0.0),
        prefill_tokens=samples.get(COUNTERS["prefill_tokens"], 0.0),
        step_s=samples.get(f"{STEP}_sum", 0.0),
        loop_s=samples.get(f"{LOOP}_sum", 0.0),
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
    def schedule_ms_per_step(self) -> float | None:
        """Scheduling, batch building and sampling: the step without its forward."""
        if not self.delta.steps or not self.delta.step_s:
            return None
        return (self.delta.step_s - self.delta.forward_s) * 1e3 / self.delta.steps

    @property
    def output_ms_per_step(self) -> float | None:
        """The role's hooks and the step's output batch: the loop iteration without the step."""
        if not self.delta.steps or not self.delta.loop_s:
            return None
        return (self.delta.loop_s - self.delta.step_s) * 1e3 / self.delta.steps

    @property
    def busy_share(self) -> float | None:
        """Engine-loop seconds with a step / wall seconds."""
        if not self.delta.loop_s or self.wall_s <= 0:
            return None
        return self.delta.loop_s / self.wall_s

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
