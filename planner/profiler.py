"""Measures a `NodeProfile` on this machine: the engine in-process, one scheduler step at a time.

On a GPU (`device` cuda) the engine runs as a node does (CUDA graphs for decode, the given
dtype and attention backend, dummy weights of the model's shapes if asked) except for the
overlap scheduler, which is off so that each step's time is its own (a node's overlap hides
part of the host's batch building: the profile's decode steps are that much pessimistic); each
timed step ends with a device synchronize. `GPU_POINTS` are prompt and batch sizes of an
8B-class model on one GPU.

Prefill: K fresh requests of T tokens each (max_new_tokens=1) are one prefill step, for single
prompts (K=1) of every T and batches of shorter ones; the median step time of `repeats` runs
per point, after one unmeasured run (a new shape's first run is slow); `fit_prefill`
(profile.py) turns the points into the per-token and per-pair costs.
Decode: B requests of a C-token prompt are prefilled, then
`decode_steps` decode-only steps are timed (median); d0 + d1*B + d2*B*context is fitted by
least squares. The transfer and gateway terms are not measured here (flags of `profile`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class ProfilePlan:
    model: str | None
    threads: int
    device: str = "cpu"
    dtype: str = "float32"
    load_format: str = "safetensors"
    attention_backend: str = "torch_native"
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024, 2048)
    prefill_batches: tuple[tuple[int, int], ...] = (  # (requests, tokens each) in one step
        (16, 16), (8, 64), (4, 128), (8, 128), (2, 256), (4, 256), (2, 512), (4, 512)
    )  # fmt: skip
    decode_batches: tuple[int, ...] = (1, 4, 16)
    decode_contexts: tuple[int, ...] = (64, 320)
    repeats: int = 2
    decode_steps: int = 6
    max_total_tokens: int = 16384

    def for_gpu(self) -> ProfilePlan:
        """The GPU points: prompts up to 4k tokens, decode batches up to 96 at 1k-3k context."""
        return replace(self, **GPU_POINTS)  # type: ignore[arg-type]


GPU_POINTS = {
    "prefill_tokens": (128, 512, 1024, 2048, 4096),
    "prefill_batches": ((8, 128), (4, 512), (8, 512), (2, 2048)),
    "decode_batches": (1, 16, 48, 96),
    "decode_contexts": (1024, 3072),
    "decode_steps": 12,
    "max_total_tokens": 320_000,
}


@dataclass
class Measured:
    prefill: list[tuple[int, int, float]]  # (requests, tokens each, seconds)
    decode: list[tuple[int, float, float]]  # (batch, mean context, seconds)
    kv_bytes_per_token: int
    model: str


def measure(plan: ProfilePlan, log: bool = True) -> Measured:
    import torch

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    torch.set_num_threads(plan.threads)
    shapes = [(1, t) for t in plan.prefill_tokens] + list(plan.prefill_batches)
    # The largest decode point's KV whole (its prompts, the steps it times, a page each spare):
    # a pool the node's size need not hold (48 streams at 480 tokens is 23k tokens).
    decode_kv = max(plan.decode_batches) * (max(plan.decode_contexts) + plan.decode_steps + 64)
    llm = LLM(
        plan.model,
        chunked_prefill_size=max(count * tokens for count, tokens in shapes),
        max_total_tokens=max(plan.max_total_tokens, decode_kv),
        enable_prefix_cache=False,
        device=plan.device,
        dtype=plan.dtype,
        load_format=plan.load_format,
        attention_backend=plan.attention_backend,
        overlap_schedule=False,
        max_running_requests=max(256, *plan.decode_batches),
    )
    sync = torch.cuda.synchronize if plan.device.startswith("cuda") else lambda: None
    rng = np.random.default_rng(0)

    vocab = llm.model_config.vocab_size
    low, high = (1000, 10000) if vocab >= 10000 else (0, vocab)  # a test's tiny vocabulary

    def ids(n: int) -> list[int]:
        return [int(x) for x in np.asarray(rng.integers(low, high, size=n))]

    sched = llm.scheduler
    llm.generate([ids(32)], SamplingParams(max_new_tokens=2, temperature=0))  # warm-up

    prefill = []
    for count, tokens in shapes:
        times = []
        for _ in range(plan.repeats + 1):  # the first run of a shape is cold: not counted
            params = SamplingParams(max_new_tokens=1, temperature=0)
            reqs = [llm._make_req(ids(tokens), params) for _ in range(count)]
            for req in reqs:
                sched.add_request(req)
            sync()
            start = time.perf_counter()
            sched.step()  # all of them: the budget is at least count * tokens
            sync()
            times.append(time.perf_counter() - start)
            if not all(r.finished for r in reqs):
                raise RuntimeError(f"{count} x {tokens} tokens did not fit one prefill step")
        prefill.append((count, tokens, statistics.median(times[1:])))
        _say(log, f"prefill {count:2d} x {tokens:4d} tokens: {prefill[-1][2] * 1000:8.1f} ms")

    decode = []
    for context in plan.decode_contexts:
        for batch in plan.decode_batches:
            decode.append(_decode_point(llm, ids, batch, context, plan.decode_steps, sync))
            _say(
                log, f"decode batch {batch:3d} context {context:4d}: {decode[-1][2] * 1000:7.1f} ms"
            )
    mc = llm.model_config
    per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * llm.config.torch_dtype.itemsize
    return Measured(prefill, decode, per_token, llm.config.model_path)


def _decode_point(llm, ids, batch: int, context: int, steps: int, sync) -> tuple[int, float, float]:  # type: ignore[no-untyped-def]
    from engine.sampling import SamplingParams

    sched = llm.scheduler
    params = SamplingParams(max_new_tokens=10_000, temperature=0, ignore_eos=True)
    reqs = [llm._make_req(ids(context), params) for _ in range(batch)]
    for req in reqs:
        sched.add_request(req)
    while any(not r.output_ids for r in reqs):
        sched.step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        sched.step()
        sync()
        times.append(time.perf_counter() - start)
    mean_context = statistics.fmean(len(r.prompt_ids) + len(r.output_ids) for r in reqs)
    for req in reqs:
        sched.abort(req.rid)
    return batch, mean_context, statistics.median(times)


def fit_decode(points: Sequence[tuple[int, float, float]]) -> tuple[float, float, float]:
    """Least-squares d0, d1, d2 of seconds = d0 + d1 * batch + d2 * batch * context."""
    a = np.array([[1.0, b, b * c] for b, c, _ in points])
    y = np.array([s for _, _, s in points])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(coef[0]), float(coef[1]), float(coef[2])


def _say(log: bool, line: str) -> None:
    if log:
        print(line, flush=True)
