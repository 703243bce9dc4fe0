"""The FlashInfer backend where flashinfer is not installed (CPU machines, CI): the module
imports, the registry names it, selecting it says what to install, and its page-table logic (the
CSR form FlashInfer reads, built on any device) is right. The kernels run on a GPU in
tests/test_flashinfer_gpu.py and scripts/gpu/check_flashinfer.py."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from engine.attention import ATTENTION_BACKENDS, attention_backend_class
from engine.attention.flashinfer_backend import FlashInferBackend, pad_page_table, page_table
from engine.memory.kv_cache import KVLayout, PagedKVCache, ReqToTokenPool

no_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed here"
)


def test_registry_names_the_backend_and_loads_it_without_flashinfer() -> None:
    assert "flashinfer" in ATTENTION_BACKENDS
    assert attention_backend_class("flashinfer") is FlashInferBackend


def small_cache(dtype: torch.dtype = torch.bfloat16) -> tuple[PagedKVCache, ReqToTokenPool]:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, dtype=dtype)
    return PagedKVCache(layout, 8, torch.device("cpu")), ReqToTokenPool(3, 32, torch.device("cpu"))


@no_flashinfer
def test_selecting_it_without_flashinfer_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails even if a copy appears
    with pytest.raises(ImportError, match=r"pip install pdserve\[gpu\]"):
        FlashInferBackend(*small_cache())


def test_refuses_cpu_and_fp32_caches_with_what_to_do(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", object())  # stands in for the package
    with pytest.raises(ValueError, match=r"bfloat16 or float16 KV cache.*--dtype bfloat16"):
        FlashInferBackend(*small_cache(torch.float32))
    with pytest.raises(ValueError, match=r"CUDA devices only.*'triton'"):
        FlashInferBackend(*small_cache())


def test_page_table_lists_each_requests_pages_in_order() -> None:
    ps = 4
    table = torch.zeros(4, 16, dtype=torch.int64)
    pages = {1: [7, 2, 5], 3: [4]}  # slot -> its pages, out of order
    for slot, ids in pages.items():
        locs = torch.tensor([p * ps + o for p in ids for o in range(ps)])
        table[slot, : len(locs)] = locs
    pt = page_table(table, ps, slots=[1, 3, 1], seq_lens=[9, 3, 12])
    assert pt.indptr.tolist() == [0, 3, 4, 7]
    assert pt.indices.tolist() == [7, 2, 5, 4, 7, 2, 5]
    assert pt.last_page_len.tolist() == [1, 3, 4]
    assert pt.indices.dtype == pt.indptr.dtype == pt.last_page_len.dtype == torch.int32


def test_graph_padding_rows_read_one_key_of_the_scratch_page() -> None:
    table = torch.arange(64, dtype=torch.int64).view(2, 32)
    pt = pad_page_table(page_table(table, 16, slots=[1], seq_lens=[20]), pad=2)
    assert pt.indptr.tolist() == [0, 2, 3, 4]
    assert pt.indices.tolist() == [2, 3, 0, 0]
    assert pt.last_page_len.tolist() == [4, 1, 1]
