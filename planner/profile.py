"""A node's cost model, measured once (plan_capacity.py profile) and saved as JSON.

- prefill: step time of a prefill-only step, fitted as p0 + p1 * tokens + p2 * pairs, where
  pairs = sum over the step's chunks of n * (n + 2 * prefix) (a chunk of n new tokens after
  `prefix` cached ones attends over that many token pairs, x2): the attention term is per
  request, so four 256-token prompts in one step cost less than one 1,024-token prompt
  (measured: 1.67 s vs 2.10 s on one core); fitted to single prompts and batches of prompts;
- decode: step time of a decode-only step, fitted as d0 + d1 * batch + d2 * batch * context;
- handoff_s: one message through bootstrap (D's destination to P; P's DONE back to D);
- transfer: KV bytes / bandwidth, plus the DONE message (handoff_s);
- gateway_s: latency the gateway and HTTP add to the first token.
A colocated mixed step costs prefill(chunks) + decode(batch, context) - d0 (one fixed cost).

A CPU profile holds for the processor it was measured on: `meta["host"]` records it, and
loading the profile on another processor warns (`HostMismatch`): a 2-core Zen 4 host runs the
default model's prefill about 2x slower than the Zen 5 host of the 2026-11-24 profile, and
every prediction made with the wrong one is off by as much.
"""

from __future__ import annotations

import json
import os
import platform
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

Chunk = tuple[int, int]  # (new tokens, tokens of the same request already in the KV)


class ProfileError(ValueError):
    """A profile file that is missing, unreadable or incomplete."""


class HostMismatch(UserWarning):
    """A CPU profile measured on another processor than this one."""


def this_host(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """What a CPU profile's step times depend on: the processor and its core count."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return {
        "cpu": fields.get("model name") or platform.processor(),
        "family": fields.get("cpu family", ""),
        "model": fields.get("model", ""),
        "cores": os.cpu_count() or 0,
    }


@dataclass(frozen=True)
class NodeProfile:
    prefill_coef: tuple[float, float, float]  # p0, p1 (per token), p2 (per token pair)
    decode_coef: tuple[float, float, float]  # d0, d1 (per request), d2 (per request-token)
    kv_bytes_per_token: int
    transfer_bytes_per_s: float = 0.9e9
    handoff_s: float = 0.01
    gateway_s: float = 0.005
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    max_total_tokens: int = 16384
    decode_headroom: int = 32
    page_size: int = 16
    meta: dict[str, Any] = field(default_factory=dict)  # model, threads, device, raw points

    def __post_init__(self) -> None:
        if self.prefill_coef[1] <= 0 or min(self.prefill_coef[0], self.prefill_coef[2]) < 0:
            raise ProfileError(
                f"prefill_coef {self.prefill_coef}: the per-token cost must be > 0 and the "
                "fixed and per-pair costs >= 0 (profile again)"
            )

    def prefill_s(self, chunks: Sequence[Chunk]) -> float:
        """One prefill step computing `chunks`."""
        if not chunks:
            return 0.0
        p0, p1, p2 = self.prefill_coef
        tokens = sum(n for n, _ in chunks)
        return p0 + p1 * tokens + p2 * sum(n * (n + 2 * prefix) for n, prefix in chunks)

    def decode_s(self, batch: int, context: float) -> float:
        d0, d1, d2 = self.decode_coef
        return d0 + d1 * batch + d2 * batch * context if batch else 0.0

    def mixed_s(self, chunks: Sequence[Chunk], batch: int, context: float) -> float:
        if not chunks:
            return self.decode_s(batch, context)
        if not batch:
            return self.prefill_s(chunks)
        return self.prefill_s(chunks) + self.decode_s(batch, context) - self.decode_coef[0]

    def host_mismatch(self, host: dict[str, Any] | None = None) -> str | None:
        """Why this CPU profile may not hold on `host` (default: this one); None if it does,
        if it is a GPU profile, or if it does not record its host (before 2026-11-26)."""
        recorded = self.meta.get("host")
        if self.meta.get("device", "cpu") != "cpu" or not recorded:
            return None
        host = host or this_host()
        if all(recorded.get(key) == host[key] for key in ("cpu", "family", "model", "cores")):
            return None
        return (
            f"measured on {_host_name(recorded)}, but this host is {_host_name(host)}: step "
            "times differ between processors (2x between two 2-core AMD EPYC hosts here), "
            "so profile this host (`python -m scripts.planning.plan_capacity profile --output "
            "FILE`) and pass --profile FILE"
        )

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.handoff_s + prompt_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> NodeProfile:
        try:
            raw = json.loads(path.read_text())
            if "prefill_points" in raw:  # a profile from before the fit (2026-11-23): refit
                points = raw.pop("prefill_points")
                raw["prefill_coef"] = fit_prefill([(1, n, s) for n, s in points])
                raw.setdefault("meta", {})["prefill_points"] = points
            raw["prefill_coef"] = tuple(raw["prefill_coef"])
            raw["decode_coef"] = tuple(raw["decode_coef"])
            profile = cls(**raw)
        except FileNotFoundError:
            raise ProfileError(f"--profile {path}: no such file (run `profile` first)") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise ProfileError(f"--profile {path} is not a node profile: {exc}") from None
        mismatch = profile.host_mismatch()
        if mismatch:
            warnings.warn(f"--profile {path}: {mismatch}", HostMismatch, stacklevel=2)
        return profile


def _host_name(host: dict[str, Any]) -> str:
    return (
        f"{host.get('cpu')} (family {host.get('family')}, model {host.get('model')}), "
        f"{host.get('cores')} cores"
    )


def fit_prefill(points: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """p0, p1, p2 of `prefill_s` from (requests, tokens each, seconds) points.

    Least squares on the relative error (the points span 16 to 2,048 tokens); a negative
    fixed or pair cost is clamped to 0 and the rest refitted.
    """
    rows = np.array([[1.0, k * n, k * n * n] for k, n, _ in points])
    seconds = np.array([s for _, _, s in points])
    keep = [0, 1, 2]
    while True:
        coef = np.zeros(3)
        weighted = rows[:, keep] / seconds[:, None]
        coef[keep], *_ = np.linalg.lstsq(weighted, np.ones(len(points)), rcond=None)
        negative = [i for i in keep if i != 1 and coef[i] < 0]
        if not negative:
            return float(coef[0]), float(coef[1]), float(coef[2])
        keep.remove(negative[0])
