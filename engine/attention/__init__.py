"""Attention backends, chosen by name from a registry with lazy imports."""

from __future__ import annotations

from engine.attention.base import AttentionBackend
from engine.registry import registered_class

ATTENTION_BACKENDS: dict[str, tuple[str, str]] = {
    # name: (module:class, the package a user must install for it)
    "torch_native": ("engine.attention.torch_native:TorchNativeBackend", "torch"),
    "triton": ("engine.attention.triton_backend:TritonBackend", "triton"),
    # imports flashinfer when constructed: the module itself loads without it (CPU machines)
    "flashinfer": ("engine.attention.flashinfer_backend:FlashInferBackend", "flashinfer-python"),
}


def attention_backend_class(name: str) -> type[AttentionBackend]:
    cls: type[AttentionBackend] = registered_class(ATTENTION_BACKENDS, "attention backend", name)
    return cls


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "attention_backend_class"]
