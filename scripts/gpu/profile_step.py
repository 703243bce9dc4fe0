"""Where a decode or prefill step of the Llama-3-8B-shaped model spends GPU time, by kernel.

    python3 -m scripts.gpu.profile_step --decode 1,64 --prefill 4096

Runs eager steps (kernel times do not depend on launch gaps) under torch.profiler and prints the
kernels sorted by their total GPU time, per step.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from scripts.gpu.run_all import (
    LLAMA3_8B,
    TritonBackend,
    build_dummy_model,
    forward,
    kv_layout,
    paged_setup,
)

STEPS = 3


def profile_step(model, prefix_lens: list[int], extend_lens: list[int], label: str) -> None:
    setup = paged_setup(kv_layout(), prefix_lens, extend_lens, slack_pages=1)
    backend = TritonBackend(setup.cache, setup.pool)
    ids = torch.randint(0, LLAMA3_8B.vocab_size, (sum(extend_lens),), device="cuda")
    for _ in range(2):
        forward(model, backend, setup.pool, ids, prefix_lens, extend_lens)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            forward(model, backend, setup.pool, ids, prefix_lens, extend_lens)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / STEPS / 1e3
    print(f"\n== {label}: GPU kernel time {total:.2f} ms per step")
    for e in events[:18]:
        per_step = e.device_time_total / STEPS / 1e3
        print(f"{per_step:8.3f} ms {e.count // STEPS:5d}x  {e.key[:110]}")
    del setup
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill", default="4096")
    args = parser.parse_args()
    model = build_dummy_model()
    for bs in (int(b) for b in args.decode.split(",") if b):
        profile_step(model, [args.context - 1] * bs, [1] * bs, f"decode batch {bs}")
    for n in (int(c) for c in args.prefill.split(",") if c):
        profile_step(model, [0], [n], f"prefill {n}")


if __name__ == "__main__":
    main()
