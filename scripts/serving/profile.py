"""A node's cost model, measured once (plan_capacity.py profile) and saved as JSON.

- prefill: step time of a prefill-only step vs the tokens it computes (points, interpolated
  linearly, extrapolated from the last two points);
- decode: step time of a decode-only step, fitted as d0 + d1 * batch + d2 * batch * context;
- handoff_s: one message through bootstrap (D's destination to P; P's DONE back to D);
- transfer: KV bytes / bandwidth, plus the DONE message (handoff_s);
- gateway_s: latency the gateway and HTTP add to the first token.
A colocated mixed step costs prefill(tokens) + decode(batch, context) - d0 (one fixed cost).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class ProfileError(ValueError):
    """A profile file that is missing, unreadable or incomplete."""


@dataclass(frozen=True)
class NodeProfile:
    prefill_points: tuple[tuple[int, float], ...]  # (tokens, seconds), tokens ascending
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
        if len(self.prefill_points) < 2:
            raise ProfileError("a profile needs at least two prefill points")
        if any(b[0] <= a[0] for a, b in itertools.pairwise(self.prefill_points)):
            raise ProfileError("prefill points must have strictly ascending token counts")

    def prefill_s(self, tokens: int) -> float:
        points = self.prefill_points
        if tokens <= 0:
            return 0.0
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            if tokens <= x1 or (x1, y1) == points[-1]:
                return max(0.0, y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))
        raise AssertionError("unreachable")

    def decode_s(self, batch: int, context: float) -> float:
        d0, d1, d2 = self.decode_coef
        return d0 + d1 * batch + d2 * batch * context if batch else 0.0

    def mixed_s(self, prefill_tokens: int, batch: int, context: float) -> float:
        if not prefill_tokens:
            return self.decode_s(batch, context)
        if not batch:
            return self.prefill_s(prefill_tokens)
        return self.prefill_s(prefill_tokens) + self.decode_s(batch, context) - self.decode_coef[0]

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.handoff_s + prompt_tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> NodeProfile:
        try:
            raw = json.loads(path.read_text())
            raw["prefill_points"] = tuple(tuple(p) for p in raw["prefill_points"])
            raw["decode_coef"] = tuple(raw["decode_coef"])
            return cls(**raw)
        except FileNotFoundError:
            raise ProfileError(f"--profile {path}: no such file (run `profile` first)") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise ProfileError(f"--profile {path} is not a node profile: {exc}") from None
