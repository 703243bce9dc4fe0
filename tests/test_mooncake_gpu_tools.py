"""CPU-side logic of the Mooncake GPU benchmark (scripts/gpu/bench_mooncake_gpu.py) and of the
wheel pruning that carries Mooncake's CUDA build to the GPU host (scripts/gpu/mooncake_wheels.py),
plus the refusal of protocol "nvlink_intra" without that build. The transfers themselves run on
a GPU host only (benchmarks/gpu-2026-11-23-mooncake-h200.md)."""

from __future__ import annotations

import random

import pytest

from kvtransfer import TransferConfig, TransferError, coalesce_pages, create_engine
from kvtransfer.mooncake import cuda_build
from scripts.gpu.bench_mooncake_gpu import MAX_RUN, scattered_runs, shapes
from scripts.gpu.mooncake_wheels import keep_mooncake, keep_nixl


def _runs(pages: list[int]) -> list[list[int]]:
    runs = [[pages[0]]]
    for page in pages[1:]:
        if page == runs[-1][-1] + 1:
            runs[-1].append(page)
        else:
            runs.append([page])
    return runs


@pytest.mark.parametrize("seed", range(20))
def test_scattered_runs_are_distinct_separated_runs(seed: int) -> None:
    rng = random.Random(seed)
    n, pool = rng.choice([(64, 1024), (256, 1024), (30, 40), (1, 1)])
    pages = scattered_runs(n, pool, MAX_RUN, rng)
    assert len(pages) == n == len(set(pages))
    assert all(0 <= p < pool for p in pages)
    ordered = sorted(pages)
    assert all(len(run) <= MAX_RUN for run in _runs(ordered))  # a gap between any two runs


def test_scattered_runs_refuses_a_pool_too_small() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        scattered_runs(64, 64, 1, random.Random(0))


def test_shapes_cover_each_layout_and_coalesce_as_labelled() -> None:
    got = shapes((1024, 4096))
    assert [(s.tokens, s.layout) for s in got] == [
        (t, layout) for t in (1024, 4096) for layout in ("contiguous", "runs", "pages")
    ]
    for shape in got:
        assert len(shape.src_pages) == len(shape.dst_pages) == shape.tokens // 16
        descriptors = len(coalesce_pages(shape.src_pages, shape.dst_pages, 1, 0, 0))
        if shape.layout == "contiguous":
            assert descriptors == 1
        elif shape.layout == "runs":
            assert len(shape.src_pages) // MAX_RUN <= descriptors < len(shape.src_pages)


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
