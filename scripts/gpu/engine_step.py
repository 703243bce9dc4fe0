"""Decode step time of the whole engine (scheduler, batch building, CUDA-graph replay, sampling)
for a Llama-3-8B-shaped model on one GPU, with and without overlap scheduling (engine/overlap.py),
and greedy equality of the two modes.

    python3 -m scripts.gpu step [--batches 16,64,256] [--context 1024] [--steps 64] \
        [--graph-step-prep] [--linear-kernel triton] [--out table.md] [--profile] \
        [--decode-blocks-per-sm N] [--tokens-out tokens.json]

One offline engine (Triton backend, bf16 dummy weights, prefix cache off, CUDA graphs) and two
schedulers over its one runner: the normal `Scheduler` and the `OverlapScheduler`, so both modes
run the same weights and graphs (`--graph-step-prep`: `EngineConfig.graph_step_prep`, one packed
copy per step, prep and greedy argmax inside the graph, engine/step_prep.py). For each batch
size B and each mode, B requests of `context - 1` random prompt tokens are prefilled (16k-token
chunks), 8 decode steps warm up (the bucket's graph capture), then `repeats` windows of `steps`
decode steps are timed: wall time from a device sync to a device sync after `steps` calls of
`step()` (in overlap mode one step is in flight at each end of the window, the same count as
launched), divided by `steps`; median of the windows. Contexts grow
from `context` by `repeats * steps` tokens over the windows. Every request then runs to its end.
After the overlap windows of B=64, 8 steps run under `torch.cuda.set_sync_debug_mode("warn")`:
the synchronising calls left in a step, by source line (none expected in the overlap mode but the
token read-back, which waits on an event and is not counted).

Greedy equality: 64 prompts of 255 tokens prefilled in one step, to 48 new tokens each, in both
modes (the batches are the same step for step, so the tokens must be equal); then the same with
max_new_tokens 8..56 and a stop token each, where a finished request rides one extra step in
overlap mode (other batch sizes, other graph buckets: bf16 near ties may flip; reported).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.attention import triton_backend
from engine.attention.triton_reference import DEFAULT_DECODE_TUNING, choose_num_splits
from engine.models.linear_backends import LINEAR_KERNELS
from engine.overlap import OverlapScheduler
from engine.scheduler import Scheduler
from scripts.tiny_models import LLAMA3_8B, write_llama_config

LLAMA3_8B_CONFIG = LLAMA3_8B


def timed_generate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    assert all(len(o.token_ids) == new_tokens for o in outputs)
    return time.perf_counter() - start


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--linear-kernel", default="auto", choices=LINEAR_KERNELS,
                        help="EngineConfig.linear_kernel (docs/decode-kernels.md)")  # fmt: skip
    parser.add_argument(
        "--graph-step-prep",
        action="store_true",
        help="EngineConfig.graph_step_prep: step prep and argmax inside the graph",
    )
    parser.add_argument(
        "--decode-blocks-per-sm",
        type=int,
        default=None,
        help="override DecodeTuning.blocks_per_sm, the split-KV rule (A/B runs)",
    )
    parser.add_argument(
        "--tokens-out",
        type=Path,
        default=None,
        help="write the greedy equality run's tokens (JSON) to compare trees",
    )
    parser.add_argument("--profile", action="store_true",
                        help="then profile one decode run of the last batch size on the host "
                        "(cProfile, top functions by own time)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.decode_blocks_per_sm is not None:
        tuning = replace(DEFAULT_DECODE_TUNING, blocks_per_sm=args.decode_blocks_per_sm)
        triton_backend.choose_num_splits = functools.partial(choose_num_splits, tuning=tuning)
    model_dir = Path(tempfile.mkdtemp()) / "llama3-8b-shaped"
    model_dir.mkdir()
    write_llama_config(model_dir, LLAMA3_8B_CONFIG)
    batches = [int(b) for b in args.batches.split(",")]
    longest = args.context + args.repeats * args.steps + 64
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda",
              attention_backend="triton", page_size=16,
              max_total_tokens=max(batches) * (longest + 32),
              max_running_requests=max(batches), chunked_prefill_size=16384,
              enable_prefix_cache=False, overlap_schedule=False,
              linear_kernel=args.linear_kernel,
              graph_step_prep=args.graph_step_prep)  # fmt: skip
    print(f"engine built in {time.perf_counter() - t0:.1f} s (linear kernel "
          f"{args.linear_kernel}, graph step prep {args.graph_step_prep})", flush=True)  # fmt: skip
    modes = {
        "off": llm.scheduler,
        "on": OverlapScheduler(llm.config, llm.runner, llm.scheduler.stop_checker),
    }
    lines = [
        f"linear kernel: {args.linear_kernel}",
        "",
        "| check | result | pass |",
        "|---|---|---|",
    ]
    lines += equality_rows(llm, modes, args.tokens_out)
    print("\n".join(lines), flush=True)
    lines += [
        "",
        "| engine decode step | overlap off | overlap on | on / off |",
        "|---|---|---|---|",
    ]
    for batch in batches:
        ms = {}
        for mode, scheduler in modes.items():
            llm.scheduler = scheduler
            ms[mode] = decode_step_ms(llm, batch, args, sync_report=mode == "on" and batch == 64)
        span = f"{args.context}..{args.context + args.repeats * args.steps}"
        lines.append(f"| B={batch}, ctx {span} | {ms['off']:.2f} ms | {ms['on']:.2f} ms "
                     f"| {ms['on'] / ms['off']:.3f} |")  # fmt: skip
        print(lines[-1], flush=True)
    llm.check_integrity()
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out is not None:
        args.out.write_text(table)
    if args.profile:
        llm.scheduler = modes["on"]
        profile_host(llm, batches[-1], args.context, args.steps)
    return 0


def equality_rows(llm: LLM, modes: dict[str, Scheduler], tokens_out: Path | None) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128256, (255,), generator=gen).tolist() for _ in range(64)]
    uniform = [SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)] * 64
    outs: dict[str, list[Any]] = {}
    for mode, scheduler in modes.items():
        llm.scheduler = scheduler
        outs[mode] = [o.token_ids for o in llm.generate(prompts, uniform)]
        llm.check_integrity()
    if tokens_out is not None:
        tokens_out.write_text(json.dumps(outs))
    same = sum(a == b for a, b in zip(outs["off"], outs["on"], strict=True))
    rows = [f"| greedy, 64 x 255-token prompts, 48 new tokens, overlap on == off "
            f"| {same}/64 requests identical | {'yes' if same == 64 else 'NO'} |"]  # fmt: skip
    mixed = [SamplingParams(max_new_tokens=8 + i % 49, temperature=0.0,
                            stop_token_ids=(outs["off"][i][5 + i % 40],))
             for i in range(64)]  # fmt: skip
    for mode, scheduler in modes.items():
        llm.scheduler = scheduler
        outs[mode] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, mixed)]
        llm.check_integrity()
    same = sum(a == b for a, b in zip(outs["off"], outs["on"], strict=True))
    firsts = [next((k for k, (x, y) in enumerate(zip(a[0], b[0], strict=False)) if x != y), None)
              for a, b in zip(outs["off"], outs["on"], strict=True) if a != b]  # fmt: skip
    # Control: the normal mode against itself with one more request in every batch (other
    # batch sizes, other graph buckets), to tell bf16 near ties from a bug in the overlap mode.
    llm.scheduler = modes["off"]
    extra = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    control = llm.generate([*prompts, prompts[0][::-1]], [*mixed, extra])[:64]
    llm.check_integrity()
    same_control = sum(
        (o.token_ids, o.finish_reason) == a for o, a in zip(control, outs["off"], strict=True)
    )
    rows.append(f"| control: overlap off with a 65th request in the batch == overlap off, same "
                f"64 requests | {same_control}/64 identical | info |")  # fmt: skip
    rows.append(f"| greedy, same prompts, max_new_tokens 8..56 and a stop token each, on == off "
                f"| {same}/64 identical (first differing positions: {firsts}) "
                f"| {'yes' if same == 64 else 'info'} |")  # fmt: skip
    return rows


def decode_step_ms(llm: LLM, batch: int, args: argparse.Namespace, sync_report: bool) -> float:
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 128256, (args.context - 1,), generator=gen).tolist()
               for _ in range(batch)]  # fmt: skip
    params = SamplingParams(max_new_tokens=args.repeats * args.steps + 64, temperature=0.0,
                            ignore_eos=True)  # fmt: skip
    scheduler = llm.scheduler
    reqs = [llm._make_req(p, params) for p in prompts]
    for req in reqs:
        scheduler.add_request(req)
    while any(not r.output_ids for r in reqs) or scheduler.waiting:  # prefill
        scheduler.step()
    for _ in range(8):  # warm-up: the bucket's graph capture
        scheduler.step()
    per_step = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            scheduler.step()
        torch.cuda.synchronize()
        per_step.append((time.perf_counter() - start) / args.steps * 1e3)
    if sync_report:
        report_syncs(scheduler)
    while scheduler.has_work:
        scheduler.step()
    assert all(len(r.output_ids) == params.max_new_tokens for r in reqs)
    median = statistics.median(per_step)
    name = type(scheduler).__name__
    print(f"{name}, batch {batch}: {', '.join(f'{t:.2f}' for t in per_step)} ms per decode step, "
          f"median {median:.2f}", flush=True)  # fmt: skip
    return median


def report_syncs(scheduler: Scheduler) -> None:
    import warnings
    from collections import Counter

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            scheduler.step()
    torch.cuda.set_sync_debug_mode("default")
    where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught)
    print(f"synchronising calls in 8 overlapped decode steps: {dict(where) or 'none'}", flush=True)


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
