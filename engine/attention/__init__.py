"""Attention backends, chosen by name from a registry with lazy imports."""

from __future__ import annotations

import importlib

from engine.attention.base import AttentionBackend

ATTENTION_BACKENDS: dict[str, tuple[str, str]] = {
    # name: (module:class, the package a user must install for it)
    "torch_native": ("engine.attention.torch_native:TorchNativeBackend", "torch"),
    "triton": ("engine.attention.triton_backend:TritonBackend", "triton"),
    # imports flashinfer when constructed: the module itself loads without it (CPU machines)
    "flashinfer": ("engine.attention.flashinfer_backend:FlashInferBackend", "flashinfer-python"),
}


def attention_backend_class(name: str) -> type[AttentionBackend]:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {sorted(ATTENTION_BACKENDS)}"
        )
    target, package = ATTENTION_BACKENDS[name]
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"attention backend {name!r} needs the package {package!r}: {exc}"
        ) from exc
    cls: type[AttentionBackend] = getattr(module, cls_name)
    return cls


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "attention_backend_class"]
