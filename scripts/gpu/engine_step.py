"""Decode step time of the whole engine (scheduler, batch building, CUDA-graph replay, sampling)
for a Llama-3-8B-shaped model on one GPU, to set against run_all.py's model-only rows.

    python3 scripts/gpu/engine_step.py [--batches 1,16,64] [--context 1024] [--steps 64]

For each batch size B, B requests of `context - 1` random prompt tokens run through the offline
engine (Triton backend, bf16 dummy weights, prefix cache off, a prefill budget that takes every
prompt in one step) twice: to 1 new token (prefill only) and to `steps + 1` (the same prefill,
then `steps` decode steps of the whole batch). Per decode step: (second wall time - first) /
steps. A first run to 3 tokens warms up (kernel compilation, the batch's graph capture) and is
not counted; the graph buckets used are printed. run_all.py's "CUDA graph" row times the model step
with the batch built on the host, "graph replay only" the GPU's part alone: the gap from this
figure to those is the scheduler's and sampler's host time per step, what overlapping the host's
work with the GPU's (overlap scheduling) would hide.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import LLM, SamplingParams

LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False,
}  # fmt: skip


def timed_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    assert all(len(o.token_ids) == new_tokens for o in outputs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="then profile one decode run of the last batch size on the host "
                        "(cProfile, top functions by own time)")  # fmt: skip
    args = parser.parse_args()
    model_dir = Path(tempfile.mkdtemp()) / "llama3-8b-shaped"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda",
              attention_backend="triton", page_size=16,
              max_total_tokens=max(batches) * (args.context + args.steps + 32),
              max_running_requests=max(batches),
              chunked_prefill_size=max(batches) * args.context,
              enable_prefix_cache=False)  # fmt: skip
    print(f"engine built in {time.perf_counter() - t0:.1f} s", flush=True)
    for batch in batches:
        decode_step_ms(llm, batch, args.context, args.steps, args.repeats)
    if args.profile:
        profile_host(llm, batches[-1], args.context, args.steps)
    llm.check_integrity()


def profile_host(llm: LLM, batch: int, context: int, steps: int) -> None:
    """Where the host's time goes in a run of `steps` decode steps (after its prefill)."""
    import cProfile
    import pstats

    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 128256, (context - 1,), generator=gen).tolist()
               for _ in range(batch)]  # fmt: skip
    profiler = cProfile.Profile()
    profiler.enable()
    timed_generate(llm, prompts, steps + 1)
    profiler.disable()
    print(f"host profile, batch {batch}, 1 prefill + {steps} decode steps (own time):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def decode_step_ms(llm: LLM, batch: int, context: int, steps: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 128256, (context - 1,), generator=gen).tolist()
               for _ in range(batch)]  # fmt: skip
    timed_generate(llm, prompts, 3)
    graphs = llm.runner.graph_runner
    print(f"batch {batch}: graph buckets captured so far {sorted(graphs.graphs) if graphs else []}")
    per_step = []
    for _ in range(repeats):
        prefill = timed_generate(llm, prompts, 1)
        full = timed_generate(llm, prompts, steps + 1)
        per_step.append((full - prefill) / steps * 1e3)
        print(f"  prefill only {prefill:.3f} s, with {steps} decode steps {full:.3f} s: "
              f"{per_step[-1]:.2f} ms per decode step", flush=True)  # fmt: skip
    median = statistics.median(per_step)
    print(f"engine decode step, batch {batch}, ctx {context}: median {median:.2f} ms "
          f"over {repeats} runs", flush=True)  # fmt: skip
    return median


if __name__ == "__main__":
    main()
