"""The host CPU a cluster spends outside its engine steps, per streamed token, by measurement.

On a shared host (this CPU) the gateway, the load generator, the nodes' gRPC and transfer
threads and bootstrap compete with the engine steps for the same cores. The simulator charges
that work as CPU-seconds per streamed token (simulator.HostConfig.overhead_s_per_token). It is
measured on a real cluster of the launcher's processes running the workload at one rate: the CPU
time of every cluster process and of this process (the client) over the measured run, minus the
engine's forward time the nodes report (`pdserve_node_forward_seconds_sum`), divided by the
output tokens streamed. With one thread per node the forward time is CPU time.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, replace

from gateway.process.cluster import Cluster, ClusterConfig
from scripts.serving.benchmark import BenchmarkConfig, run_benchmark, warm
from scripts.serving.client import served_model

_FORWARD = re.compile(r"^pdserve_node_forward_seconds_sum(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)


@dataclass(frozen=True)
class HostCost:
    cpu_s: float  # every process of the cluster and the client, over the measured run
    forward_s: float  # the nodes' engine forward time in that run
    output_tokens: int
    requests: int

    @property
    def overhead_s_per_token(self) -> float:
        return max(0.0, self.cpu_s - self.forward_s) / max(1, self.output_tokens)


def process_cpu_s(pid: int) -> float:
    """utime + stime of a live process, in seconds (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def forward_seconds(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(m) for m in _FORWARD.findall(text))


def _snapshot(cluster: Cluster) -> tuple[float, float]:
    cpu = time.process_time() + sum(process_cpu_s(c.process.pid) for c in cluster.children)
    nodes = [c for c in cluster.children if c.name.startswith(("prefill", "decode"))]
    return cpu, sum(forward_seconds(c.metrics_url) for c in nodes)


def measure(cluster_config: ClusterConfig, bench: BenchmarkConfig, warmup: int) -> HostCost:
    """Start the cluster, send `warmup` requests, then measure one run of `bench`."""
    cluster = Cluster(cluster_config)
    try:
        url = cluster.start(threading.Event())
        bench = replace(bench, client=replace(bench.client, base_url=url, model=served_model(url)))
        warm(bench, warmup)
        cpu0, fwd0 = _snapshot(cluster)
        run = run_benchmark(bench, progress=True)
        cpu1, fwd1 = _snapshot(cluster)
    finally:
        cluster.stop()
    tokens = sum(t.output_tokens for t in run.load.traces)
    return HostCost(cpu1 - cpu0, fwd1 - fwd0, tokens, len(run.load.traces))
