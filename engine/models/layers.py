"""Building blocks shared by the decoder-only models: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype, as the HF reference does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if scaling.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.cos_table: torch.Tensor
        self.sin_table: torch.Tensor
        self.register_buffer("cos_table", freqs.cos(), persistent=False)
        self.register_buffer("sin_table", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [N, Hq, D], k: [N, Hkv, D], positions: [N]."""
        cos = self.cos_table[positions].unsqueeze(1)
        sin = self.sin_table[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class GatedMLP(nn.Module):
    """SwiGLU MLP with the gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
