"""Launch settings of the Triton attention kernels, timed one layer at a time on Llama-3-8B shapes.

    python3 -m scripts.gpu.tune_attention [--extend-only]

Decode: batch 1/16/64/256 at context 1k; GB/s = K+V bytes read / kernel time, against the copy
bandwidth measured here. Extend: one fresh 4k-token prompt; TFLOP/s of causal attention, against
torch's SDPA on contiguous tensors. Prints one line per variant, best first per shape.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton  # type: ignore[import-untyped]

from engine.attention import triton_kernels
from engine.attention.triton_backend import TritonBackend
from engine.attention.triton_reference import DecodePlan
from scripts.gpu.run_all import copy_ms, kv_layout, paged_setup

LAYER = 5


def bench(fn) -> float:
    ms: float = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return ms


def tune_decode(copy_bw: float) -> None:
    for bs in (1, 16, 64, 256):
        _tune_decode_batch(bs, copy_bw)
        torch.cuda.empty_cache()


def _tune_decode_batch(bs: int, copy_bw: float) -> None:
    setup = paged_setup(kv_layout(), [1023] * bs, [1] * bs, slack_pages=1)
    backend = TritonBackend(setup.cache, setup.pool)
    k_view, v_view = setup.cache.k_view(LAYER), setup.cache.v_view(LAYER)
    table = setup.pool.table
    q = torch.randn(bs, 32, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    base = backend.decode_plan(setup.batch.req_slots, setup.batch.seq_lens)
    kv_bytes = bs * 1024 * 8 * 128 * 2 * 2
    results = []
    for mult, block_n, warps, stages in itertools.product((1, 2), (64, 128), (4, 8), (2, 3, 4)):
        splits = min(64, base.num_splits * mult)
        if mult > 1 and splits == base.num_splits:
            continue
        plan = DecodePlan(base.slots, base.seq_lens, splits)
        plan.ensure_workspace(32, 128)
        cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}

        def run(plan: DecodePlan = plan, cfg: dict[str, int] = cfg) -> None:
            triton_kernels.paged_decode(q, k_view, v_view, table, plan, out, cfg)

        try:
            ms = bench(run)
        except Exception as exc:
            print(f"decode B={bs} {cfg} splits {splits}: {type(exc).__name__}")
            continue
        results.append((ms, splits, cfg))
    results.sort(key=lambda r: r[0])
    for ms, splits, cfg in results[:6]:
        gbs = kv_bytes / ms / 1e6
        print(f"decode B={bs:3d} splits {splits:2d} {cfg}: {ms * 1e3:7.1f} us "
              f"{gbs:6.0f} GB/s = {100 * gbs * 1e9 / copy_bw:.0f}% of copy")  # fmt: skip
    default = [
        r for r in results if r[2] == triton_kernels.DECODE_CONFIG and r[1] == base.num_splits
    ]
    if default:
        print(f"decode B={bs:3d} current default: {default[0][0] * 1e3:.1f} us")


def tune_extend() -> None:
    n = 4096
    setup = paged_setup(kv_layout(), [0], [n], slack_pages=1)
    backend = TritonBackend(setup.cache, setup.pool)
    backend.init_metadata(setup.batch)
    plan = setup.batch.attn_metadata.extend
    k_view, v_view = setup.cache.k_view(LAYER), setup.cache.v_view(LAYER)
    q = torch.randn(n, 32, 128, dtype=torch.bfloat16, device="cuda")
    new_kv = (k_view[1 : 1 + n // 16].flatten(0, 1), v_view[1 : 1 + n // 16].flatten(0, 1))
    out = torch.empty_like(q)
    flops = 4 * n * (n + 1) / 2 * 32 * 128
    results = []
    for block_m, block_n, warps, stages in itertools.product(
        (64, 128), (32, 64, 128), (4, 8), (1, 2, 3)
    ):
        cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        try:
            ms = bench(
                lambda cfg=cfg: triton_kernels.paged_extend(
                    q, k_view, v_view, setup.pool.table, plan, out, new_kv, cfg
                )
            )
        except Exception as exc:
            print(f"extend {cfg}: {type(exc).__name__}")
            continue
        results.append((ms, cfg))
    results.sort(key=lambda r: r[0])
    for ms, cfg in results[:8]:
        print(f"extend {n} {cfg}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
    qc = q.transpose(0, 1).unsqueeze(0)
    kc = torch.randn(1, 8, n, 128, dtype=torch.bfloat16, device="cuda")
    ms = bench(lambda: F.scaled_dot_product_attention(qc, kc, kc, is_causal=True, enable_gqa=True))
    print(f"extend {n} torch SDPA (contiguous, GQA): {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
    kr = kc.repeat_interleave(4, dim=1)
    ms = bench(lambda: F.scaled_dot_product_attention(qc, kr, kr, is_causal=True))
    print(f"extend {n} torch SDPA (contiguous, heads repeated): {ms:.3f} ms "
          f"{flops / ms / 1e9:.0f} TFLOP/s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--extend-only", action="store_true", help="skip the decode variants")
    args = parser.parse_args()
    ms, moved = copy_ms()
    copy_bw = moved / (ms * 1e-3)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    tune_extend()
    if not args.extend_only:
        tune_decode(copy_bw)


if __name__ == "__main__":
    main()
