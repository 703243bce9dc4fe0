"""The Triton backend's logic on CPU: address math, split boundaries, the log-sum-exp merge and
the plans, run through `triton_reference` (the plain-torch twin of the kernels) and compared with
the torch-native backend on random inputs. The kernels themselves run in scripts/gpu/run_all.py
and in tests/test_triton_gpu.py on a GPU."""

from __future__ import annotations

import importlib.util
import random
from dataclasses import replace

import pytest
import torch

from engine.attention import attention_backend_class
from engine.attention.torch_native import TorchNativeBackend
from engine.attention.triton_backend import TritonBackend
from engine.attention.triton_reference import (
    KVStrides,
    choose_num_splits,
    gather_tokens,
    split_bounds,
    token_offsets,
)
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.kv_cache import KVLayout, PagedKVCache, ReqToTokenPool


def make_case(
    page_size: int,
    prefix_lens: list[int],
    extend_lens: list[int],
    *,
    num_kv_heads: int = 2,
    group: int = 3,
    head_dim: int = 16,
    num_layers: int = 2,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[PagedKVCache, ReqToTokenPool, ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random cache whose requests own shuffled pages, and a batch adding `extend_lens` tokens
    to `prefix_lens` cached ones. Slots are used in reverse order, pages out of order."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pages_per_req = [-(-s // page_size) for s in seq_lens]
    num_pages = 1 + sum(pages_per_req) + 3
    layout = KVLayout(num_layers, num_kv_heads, head_dim, page_size, dtype)
    cache = PagedKVCache(layout, num_pages, dev)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=gen))
    max_ctx = max(seq_lens) + page_size
    pool = ReqToTokenPool(len(seq_lens) + 2, max_ctx, dev)
    free_pages = list(range(1, num_pages))
    rng.shuffle(free_pages)
    slots = list(range(len(seq_lens) + 1, 0, -1))[: len(seq_lens)]
    new_locs, positions = [], []
    for slot, seq, prefix, n_pages in zip(slots, seq_lens, prefix_lens, pages_per_req, strict=True):
        pages = [free_pages.pop() for _ in range(n_pages)]
        locs = torch.tensor([p * page_size + o for p in pages for o in range(page_size)])[:seq]
        pool.table[slot, :seq] = locs
        new_locs.append(locs[prefix:])
        positions.append(torch.arange(prefix, seq))
    num_new = sum(extend_lens)
    mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.EXTEND
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(num_new, dtype=torch.int64, device=dev),
        positions=torch.cat(positions).to(dev),
        out_cache_loc=torch.cat(new_locs).to(dev),
        req_slots=slots,
        seq_lens=seq_lens,
        extend_lens=list(extend_lens),
        attn_backend=None,  # type: ignore[arg-type]
    )
    num_heads = num_kv_heads * group
    q = torch.randn(num_new, num_heads, head_dim, generator=gen).to(dev, dtype)
    k = torch.randn(num_new, num_kv_heads, head_dim, generator=gen).to(dev, dtype)
    v = torch.randn(num_new, num_kv_heads, head_dim, generator=gen).to(dev, dtype)
    return cache, pool, batch, q, k, v


def run_backend(
    cls: type, cache: PagedKVCache, pool: ReqToTokenPool, batch: ForwardBatch, q, k, v, **attrs
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Outputs of every layer and the cache after the writes, on a private copy of the cache."""
    own = PagedKVCache(cache.layout, cache.num_pages, cache.buffer.device)
    own.buffer.copy_(cache.buffer)
    backend = cls(own, pool)
    for name, value in attrs.items():
        setattr(backend, name, value)
    own_batch = replace(batch, attn_backend=backend)
    backend.init_metadata(own_batch)
    outs = [
        backend.forward(q + layer, k - layer, v * (layer + 1), layer, own_batch)
        for layer in range(cache.layout.num_layers)
    ]
    return outs, own.buffer


def assert_matches_torch_native(case, **attrs) -> None:
    cache, pool, batch, q, k, v = case
    ref_outs, ref_cache = run_backend(TorchNativeBackend, cache, pool, batch, q, k, v)
    outs, new_cache = run_backend(TritonBackend, cache, pool, batch, q, k, v, **attrs)
    assert torch.equal(new_cache, ref_cache)
    for out, ref in zip(outs, ref_outs, strict=True):
        assert out.abs().sum() > 0
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_gather_tokens_reads_what_the_cache_views_hold(page_size: int) -> None:
    cache, pool, batch, *_ = make_case(page_size, [9, 40, 3], [1, 1, 1])
    for layer in range(cache.layout.num_layers):
        for view in (cache.k_view(layer), cache.v_view(layer)):
            locs = pool.table[batch.req_slots[1], :40]
            expected = view[locs // page_size, locs % page_size]
            assert torch.equal(gather_tokens(view, locs), expected)


def test_token_offsets_follow_the_buffer_layout() -> None:
    layout = KVLayout(3, 2, 8, 4, torch.float32)
    cache = PagedKVCache(layout, 5, torch.device("cpu"))
    strides = KVStrides.of(cache.k_view(1))
    # [pages, heads, layers, 2, page_size, dim]: a page spans every layer's K and V, and one
    # KV head's part of a page is contiguous (a head slice of a page is one range).
    assert strides.page == 2 * 3 * 2 * 4 * 8
    assert (strides.token, strides.head) == (8, 3 * 2 * 4 * 8)
    locs = torch.tensor([0, 5, 19])
    assert token_offsets(locs, 4, strides).tolist() == [0, strides.page + 8, 4 * strides.page + 24]
    assert cache.v_view(1).storage_offset() - cache.k_view(1).storage_offset() == 4 * 8


@pytest.mark.parametrize("seq_len", [1, 2, 5, 63, 64, 65, 1000])
@pytest.mark.parametrize("num_splits", [1, 3, 8, 64])
def test_splits_cover_the_context_once(seq_len: int, num_splits: int) -> None:
    covered: list[int] = []
    for s in range(num_splits):
        start, end = split_bounds(seq_len, num_splits, s)
        covered.extend(range(start, end))
    assert covered == list(range(seq_len))


def test_num_splits_fill_the_chip_with_at_least_one_key_block_each() -> None:
    assert choose_num_splits(1, 8, 1024, 132) == 16  # 64-token splits: 128 programs
    assert choose_num_splits(64, 8, 1024, 132) == 1
    assert choose_num_splits(16, 8, 1024, 132) == 2
    assert choose_num_splits(256, 8, 1024, 132) == 1
    assert choose_num_splits(1, 8, 10, 132) == 1
    assert choose_num_splits(1, 1, 100_000, 132) == 64


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_matches_torch_native(page_size: int) -> None:
    assert_matches_torch_native(make_case(page_size, [5, 150, 0, 63, 64], [1, 1, 1, 1, 1]))


@pytest.mark.parametrize("num_sms", [1, 16, 64])
def test_decode_splits_and_empty_splits_merge_exactly(num_sms: int) -> None:
    # A short and a long context: with many splits the short one leaves some splits empty.
    case = make_case(4, [2, 700], [1, 1], num_kv_heads=1, group=4)
    assert_matches_torch_native(case, num_sms=num_sms)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extend_with_prefix_matches_torch_native(page_size: int) -> None:
    # Fresh prompts, prefixes not page-aligned, and a single-token request in the same batch.
    case = make_case(page_size, [0, 0, 13, 40, 77], [7, 7, 20, 1, 130])
    assert_matches_torch_native(case)


def test_registry_imports_the_backend_without_a_gpu() -> None:
    assert attention_backend_class("triton") is TritonBackend
    cache, pool, *_ = make_case(4, [3], [1])
    assert TritonBackend(cache, pool).ops.__name__ == "engine.attention.triton_reference"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_module_imports_without_cuda() -> None:
    import engine.attention.triton_kernels as kernels

    assert callable(kernels.paged_decode) and callable(kernels.paged_extend)


def test_greedy_generation_equals_torch_native(tiny_model_dir) -> None:
    from engine import LLM, SamplingParams

    model = str(tiny_model_dir("llama"))
    shared = list(range(3, 40))
    prompts = [[*shared, 7, 8, 9], [*shared, 11], list(range(100, 117))]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch_native", "triton"):
        llm = LLM(
            model, load_format="safetensors", page_size=4, chunked_prefill_size=16,
            attention_backend=backend,
        )  # fmt: skip
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch_native"]
