"""How a model's linear layers compute, chosen by `EngineConfig.linear_kernel` from a registry.

Each backend is a module (imported only when chosen) with two functions:
`unusable_reason(device, dtype) -> str | None` (None: it can run here) and
`replace_linears(model) -> int` (swaps the model's nn.Linear layers after the weights are
loaded; returns how many). "aten" is torch's F.linear: nothing is replaced.

- "onednn" (engine/models/cpu_linear.py): oneDNN over weights packed once at load (CPU).
- "triton" (engine/models/gpu_linear.py): decode-sized GEMMs through a skinny split-K Triton
  kernel, larger ones on cuBLAS (CUDA).
- "auto": the first of AUTO_ORDER that runs here and wants to (a backend's optional
  `auto_reason(device, dtype)`: Triton only on a GPU model with measured decode tiles).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

LINEAR_BACKENDS: dict[str, str] = {
    # name: module with unusable_reason() and replace_linears()
    "aten": "engine.models.linear_backends",
    "onednn": "engine.models.cpu_linear",
    "triton": "engine.models.gpu_linear",
}
AUTO_ORDER = ("onednn", "triton", "aten")
LINEAR_KERNELS = ("auto", *LINEAR_BACKENDS)


def check_linear_kernel(kernel: str) -> None:
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {kernel!r}")


def unusable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """aten: F.linear runs on every device and dtype."""
    return None


def replace_linears(model: nn.Module) -> int:
    """aten: the model keeps its nn.Linear layers."""
    return 0


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every nn.Linear of `model` by `make(linear)`; returns how many were replaced.
    The backends' `replace_linears` are this with their own layer."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        setattr(parent, name, make(child))
    return len(targets)


def _backend(name: str) -> ModuleType:
    return importlib.import_module(LINEAR_BACKENDS[name])


def _auto_reason(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    backend = _backend(name)
    reason: str | None = getattr(backend, "auto_reason", backend.unusable_reason)(device, dtype)
    return reason


def resolve_linear_kernel(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend `kernel` runs as on `device`/`dtype`: "auto" picks, an explicit name that
    cannot run here raises a ValueError that says why and what to choose instead."""
    check_linear_kernel(kernel)
    if kernel == "auto":
        return next(n for n in AUTO_ORDER if _auto_reason(n, device, dtype) is None)
    reason = _backend(kernel).unusable_reason(device, dtype)
    if reason is not None:
        raise ValueError(
            f"linear_kernel {kernel!r} cannot run on device {device} with dtype {dtype}: "
            f"{reason}; use 'auto' or 'aten'"
        )
    return kernel


def linear_rewriter(
    kernel: str, device: torch.device, dtype: torch.dtype
) -> Callable[[nn.Module], int]:
    """Checks `kernel` now (before any weight is loaded) and returns what to apply to the loaded
    model: its backend's `replace_linears`."""
    rewrite: Callable[[nn.Module], int] = _backend(
        resolve_linear_kernel(kernel, device, dtype)
    ).replace_linears
    return rewrite
