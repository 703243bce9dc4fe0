"""KV transfer backends (Mooncake Transfer Engine, NIXL, CUDA IPC) behind one small interface.

The interface is kvtransfer/base.py (`KVTransferEngine`, its config, regions, ranges and
handles): import its names from there. This module is the registry of backends by name and
`create_engine`, which loads the one a config names.
"""

from __future__ import annotations

import importlib

from kvtransfer.base import KVTransferEngine, TransferConfig

TRANSFER_BACKENDS: dict[str, tuple[str, str]] = {
    # name: (module:class, the package to install)
    "mooncake": ("kvtransfer.mooncake:MooncakeEngine", "mooncake-transfer-engine-non-cuda"),
    "nixl": ("kvtransfer.nixl:NixlEngine", "nixl"),
    # one host only: a kernel writes into the peer's pool mapped through CUDA IPC
    "cuda_ipc": ("kvtransfer.cuda_ipc:CudaIpcEngine", "triton"),
}


def create_engine(config: TransferConfig) -> KVTransferEngine:
    if config.backend not in TRANSFER_BACKENDS:
        raise ValueError(
            f"unknown transfer backend {config.backend!r}; "
            f"choose one of {sorted(TRANSFER_BACKENDS)}"
        )
    target, package = TRANSFER_BACKENDS[config.backend]
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"transfer backend {config.backend!r} needs the package {package!r} "
            f"(pip install {package}): {exc}"
        ) from exc
    cls: type[KVTransferEngine] = getattr(module, cls_name)
    engine = cls(config)
    if config.fail_rate > 0 or config.aux_corrupt_rate > 0:
        from kvtransfer.faults import FaultInjectingEngine

        return FaultInjectingEngine(
            engine, config.fail_rate, aux_corrupt_rate=config.aux_corrupt_rate
        )
    return engine
