"""The wheel pruning that carries Mooncake's CUDA build to the GPU host
(scripts/gpu/mooncake_wheels.py), and the refusal of protocol "nvlink_intra" without that build.
The transfers themselves run on a GPU host only (benchmarks/gpu-2026-11-23-mooncake-h200.md)."""

from __future__ import annotations

import pytest

from kvtransfer import create_engine
from kvtransfer.base import TransferConfig, TransferError
from kvtransfer.mooncake import cuda_build
from scripts.gpu.mooncake_wheels import keep_mooncake, keep_nixl


def test_pruning_keeps_the_engine_and_drops_the_rest() -> None:
    assert keep_mooncake("mooncake/engine.so")
    assert keep_mooncake("mooncake/libetcd_wrapper.so")
    assert keep_mooncake("mooncake/__init__.py")
    assert keep_mooncake("mooncake_transfer_engine_cuda13.libs/libglog-6ed04f2c.so.0.0.0")
    assert keep_mooncake("mooncake_transfer_engine_cuda13-0.3.14.dist-info/METADATA")
    assert not keep_mooncake("mooncake_transfer_engine_cuda13-0.3.14.dist-info/RECORD")
    assert not keep_mooncake("mooncake/_store.cpython-312-x86_64-linux-gnu.so")
    assert not keep_mooncake("mooncake/mooncake_master")
    assert not keep_mooncake("mooncake_transfer_engine_cuda13.libs/libetcd_wrapper-ed49c416.so")
    assert keep_nixl("nixl_cu13/_bindings.cpython-312-x86_64-linux-gnu.so")
    assert keep_nixl("nixl_cu13.libs/ucx/libuct_cuda.so.0")
    assert not keep_nixl("nixl_ep_cu13/nixl_ep_cpp_torch214.cpython-312-x86_64-linux-gnu.so")


@pytest.mark.skipif(bool(cuda_build()), reason="Mooncake's CUDA build is installed here")
def test_nvlink_intra_without_the_cuda_build_is_refused() -> None:
    config = TransferConfig(backend="mooncake", node_name="gpu-probe", protocol="nvlink_intra")
    with pytest.raises(TransferError, match="mooncake-transfer-engine-cuda13"):
        create_engine(config)
