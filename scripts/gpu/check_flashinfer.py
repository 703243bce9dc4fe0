"""The FlashInfer attention backend on one GPU: correctness against torch-native, then its figures
beside the Triton backend's and torch-native's, as a markdown table.

    python3 -m scripts.gpu wheels flashinfer install .flashinfer --site DIR
    export PYTHONPATH=DIR
    PYTHONUNBUFFERED=1 python3 -m scripts.gpu flashinfer --out "$OUT"

(`flashinfer_wheels.py pack .flashinfer` here first: the GPU host has no package index.)
run_all.py calls `flashinfer_checks` and `flashinfer_figures` when flashinfer imports. Steps:
1. kernels: one layer's K/V store and attention, flashinfer vs torch-native, on random bf16
   inputs (decodes of equal and mixed lengths, fresh extends, extends with a prefix mixed with
   one-token requests) at page sizes 1, 16 and 64; the pages written must be equal too;
2. logits of a 2-layer Llama-3-8B-shaped model (bf16, dummy weights) through 2 prefill chunks
   and 8 decode steps, flashinfer vs torch-native;
3. the whole engine, greedy, bf16, CUDA graphs on: flashinfer vs torch-native; a request may
   differ only from a near tie on (the other pick within `TIE_NATS` of the reference's best
   logprob, by the reference's own top-5), since two correct bf16 kernels round differently;
4. figures (only if 1-3 pass): one layer's attention (decode B=64/256 at context 1k against the
   K/V bytes over the copy bandwidth, a fresh 4k prefill and a 512-token extend on a 3.5k prefix
   against the matmul rate), then the Llama-3-8B-shaped model's decode steps (eager, CUDA graph,
   graph replay alone) and prefill chunks, each backend on the same inputs.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.attention import attention_backend_class
from engine.attention.torch_native import TorchNativeBackend
from engine.cuda_graph import DecodeGraphRunner
from engine.memory.kv_cache import KVLayout, PagedKVCache
from scripts.gpu import run_all
from scripts.gpu.run_all import (
    BF16_REL_TOL,
    LLAMA3_8B,
    Report,
    cuda_time_ms,
    kv_layout,
    log,
    mixed_prompts,
    paged_setup,
    rel_err,
    write_small_llama,
)

ALL_BACKENDS = ("flashinfer", "triton", "torch_native")
# The logits are bf16: near the top of this model's range (2..4) one rounding step is 2^-6 =
# 0.0156 nats, so gaps of 0 (exact ties, of two tokens or more) or one step between the best
# tokens are common and either pick is right; 3 steps is what a bf16 attention difference may
# plausibly flip.
TIE_NATS = 0.05
KERNEL_CASES = {
    "decode B=1 ctx 1024": ([1023], [1]),
    "decode B=64 ctx 1..3000": (None, [1] * 64),  # None: random prefixes
    "decode B=3 ctx 5/17/2049": ([4, 16, 2048], [1, 1, 1]),
    "extend fresh 1000+7": ([0, 0], [1000, 7]),
    "extend prefix 300+200, 17+1, 0+64, 1500+513": ([300, 17, 0, 1500], [200, 1, 64, 513]),
}


# ---- 1. kernels -------------------------------------------------------------------------------
def run_layer(cls: type, setup, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1's output and the cache after its writes, on a private copy of the cache."""
    cache = PagedKVCache(setup.cache.layout, setup.cache.num_pages, torch.device("cuda"))
    cache.buffer.copy_(setup.cache.buffer)
    backend = cls(cache, setup.pool)
    batch = replace(setup.batch, attn_backend=backend)
    backend.init_metadata(batch)
    return backend.forward(q, k, v, 1, batch), cache.buffer


def check_kernels(rep: Report, page_sizes: tuple[int, ...] = (1, 16, 64)) -> None:
    flashinfer = attention_backend_class("flashinfer")
    rand_ctx = torch.randint(0, 3000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    for ps in page_sizes:
        layout = KVLayout(2, 8, 128, ps, torch.bfloat16)
        for name, (prefix, ext) in KERNEL_CASES.items():
            setup = paged_setup(layout, prefix or rand_ctx, ext)
            n = sum(ext)
            q, k, v = (torch.randn(n, h, 128, dtype=torch.bfloat16, device="cuda")
                       for h in (32, 8, 8))  # fmt: skip
            ref, ref_cache = run_layer(TorchNativeBackend, setup, q, k, v)
            t0 = time.perf_counter()
            out, cache = run_layer(flashinfer, setup, q, k, v)
            first = time.perf_counter() - t0
            if first > 5:  # the first call of a kind compiles FlashInfer's kernels
                rep.row(f"info: first flashinfer call of '{name}' (JIT compile + load)",
                        f"{first:.0f} s")  # fmt: skip
            err = rel_err(out, ref)
            ok = bool(torch.isfinite(out).all()) and err < BF16_REL_TOL and bool(ref.abs().sum())
            ok = ok and torch.equal(cache, ref_cache)
            what = f"flashinfer vs torch_native, page size {ps}, {name}"
            rep.checks.append((what, err, ok))
            log(f"check {what}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")


# ---- 2. model logits --------------------------------------------------------------------------
def check_model_logits(rep: Report) -> None:
    model = run_all.build_dummy_model(2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompts = [torch.randint(0, LLAMA3_8B.vocab_size, (n,), device="cuda", generator=gen)
               for n in (700, 300)]  # fmt: skip
    decode_ids: list[torch.Tensor] = []
    ref = run_all.model_logits(model, TorchNativeBackend, prompts, decode_ids, unfused=False)
    out = run_all.model_logits(
        model, attention_backend_class("flashinfer"), prompts, decode_ids, unfused=False
    )
    errs = [rel_err(o, r) for r, o in zip(ref, out, strict=True)]
    finite = all(bool(torch.isfinite(t).all()) for t in out)
    what = "2-layer Llama-3-8B-shaped logits, 2 chunks + 8 decode steps, flashinfer vs torch_native"
    rep.checks.append((what, max(errs), max(errs) < BF16_REL_TOL and finite))
    log(f"check {what}: rel errs {[f'{e:.1e}' for e in errs]}")
    del model
    torch.cuda.empty_cache()


# ---- 3. the engine ----------------------------------------------------------------------------
def check_engine(rep: Report, workdir: Path) -> None:
    """Scheduler, chunked prefill with a prefix cache, decode through CUDA graphs with changing
    batch sizes: greedy output, bf16, head_dim 128 and 4 query heads per KV head."""
    from engine import LLM, SamplingParams

    model_dir = write_small_llama(
        workdir / "llama-hd128", hidden_size=1024, intermediate_size=2048
    )  # head_dim 128
    prompts = mixed_prompts()
    params = [
        SamplingParams(max_new_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True, top_logprobs=5)
        for i in range(len(prompts))
    ]
    outputs, buckets = {}, []
    for backend in ("torch_native", "flashinfer", "triton"):  # triton: the bf16 control
        llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda",
                  page_size=16, chunked_prefill_size=128, attention_backend=backend)  # fmt: skip
        outputs[backend] = llm.generate(prompts, params)
        if backend == "flashinfer" and llm.runner.graph_runner is not None:
            buckets = sorted(llm.runner.graph_runner.graphs)
        llm.check_integrity()
        del llm
    same, ties, bad = compare_greedy(outputs["torch_native"], outputs["flashinfer"])
    what = (f"engine greedy, flashinfer + CUDA graphs (buckets {buckets}) vs torch_native, bf16, "
            f"12 requests: {same} identical, {len(ties)} differ after a near tie {ties}, "
            f"{len(bad)} differ otherwise {bad}")  # fmt: skip
    rep.checks.append((what, len(bad) / len(prompts), not bad and bool(buckets)))
    log(f"check {what}")
    same, ties, bad = compare_greedy(outputs["torch_native"], outputs["triton"])
    rep.row(
        "info: the same engine check, triton + CUDA graphs vs torch_native, bf16 (control)",
        f"{same} identical, {len(ties)} after a near tie, {len(bad)} otherwise {bad}",
    )


def compare_greedy(ref_outs, outs) -> tuple[int, list[str], list[str]]:
    """(identical requests, near-tie divergences, other divergences): a divergence at step t is
    a near tie when the other run's pick is among the reference's top-5 there, within TIE_NATS
    of its best logprob (exact ties of two or more tokens are common in bf16 logits)."""
    same, ties, bad = 0, list[str](), list[str]()
    for i, (ref, out) in enumerate(zip(ref_outs, outs, strict=True)):
        if ref.token_ids == out.token_ids:
            same += 1
            continue
        pairs = zip(ref.token_ids, out.token_ids, strict=True)  # same max_new_tokens, no EOS
        t = next(j for j, (a, b) in enumerate(pairs) if a != b)
        top = dict(ref.top_logprobs[t] or [])
        gap = max(top.values()) - top.get(out.token_ids[t], -float("inf"))
        (ties if gap < TIE_NATS else bad).append(f"req {i} step {t} gap {gap:.3f}")
    return same, ties, bad


# ---- 4. figures -------------------------------------------------------------------------------
def backend_variants(names: tuple[str, ...], decode: bool) -> dict[str, Callable[..., Any]]:
    """Label -> backend factory; flashinfer's decode also with its CUDA-core kernel (the backend
    picks tensor cores from TENSOR_CORE_DECODE_MIN_GROUP query heads per KV head)."""
    variants: dict[str, Callable[..., Any]] = {n: attention_backend_class(n) for n in names}
    if decode and "flashinfer" in names:

        def cuda_core(*args: Any) -> Any:
            backend: Any = attention_backend_class("flashinfer")(*args)
            backend.tensor_core_min_group = 1 << 30
            return backend

        variants["flashinfer CUDA-core decode"] = cuda_core
    return variants


def graph_time_ms(fn: Callable[[], object], reps: int = 10) -> tuple[float, str]:
    """GPU time of one call: `reps` calls captured in one CUDA graph and replayed, so host
    launch gaps stay out; eager per-call time if the capture fails."""
    fn()  # plans, compiles
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except RuntimeError as exc:
        return cuda_time_ms(fn, 3, 20), f" (eager: capture failed, {str(exc)[:60]})"
    return cuda_time_ms(graph.replay, 3, 10) / reps, ""


def bench_attention(rep: Report, copy_bw: float, matmul: float, names: tuple[str, ...]) -> None:
    """One layer (Llama-3-8B heads) of K/V store + attention per backend, metadata built once,
    timed inside a CUDA graph (kernel time without host launch gaps)."""
    c = LLAMA3_8B
    layout = KVLayout(1, c.num_kv_heads, c.head_dim, 16, torch.bfloat16)
    kv_token_bytes = 2 * c.num_kv_heads * c.head_dim * 2
    cases = {
        "decode B=64, ctx 1024": ([1023] * 64, [1] * 64),
        "decode B=256, ctx 1024": ([1023] * 256, [1] * 256),
        "prefill 4096 fresh": ([0], [4096]),
        "extend 512 on a 3584 prefix": ([3584], [512]),
    }
    for name, (prefix, ext) in cases.items():
        setup = paged_setup(layout, prefix, ext, slack_pages=1)
        n = sum(ext)
        q, k, v = (torch.randn(n, h, c.head_dim, dtype=torch.bfloat16, device="cuda")
                   for h in (c.num_heads, c.num_kv_heads, c.num_kv_heads))  # fmt: skip
        if name.startswith("decode"):
            floor_ms = sum(p + 1 for p in prefix) * kv_token_bytes / copy_bw * 1e3
            ceiling = f"K/V read floor {floor_ms * 1e3:.0f} us"
        else:
            visible = sum(e * p + e * (e + 1) / 2 for p, e in zip(prefix, ext, strict=True))
            flops = 4 * visible * c.num_heads * c.head_dim
            floor_ms = flops / matmul * 1e3
            ceiling = f"matmul-rate floor {floor_ms * 1e3:.0f} us ({flops / 1e12:.2f} TFLOP)"
        for label, factory in backend_variants(names, name.startswith("decode")).items():
            backend = factory(setup.cache, setup.pool)
            batch = replace(setup.batch, attn_backend=backend)
            backend.init_metadata(batch)
            ms, note = graph_time_ms(partial(backend.forward, q, k, v, 0, batch))
            rep.row(f"attention layer {label}, {name}{note}", f"{ms * 1e3:.0f} us", ceiling,
                    floor_ms / ms)  # fmt: skip
            rep.raw[f"attn_{label}_{name}"] = ms
        del setup
        torch.cuda.empty_cache()


def bench_decode(rep: Report, model, copy_bw, batches, context, names: tuple[str, ...]) -> None:
    """Eager steps, CUDA-graph steps (batch built on the host each step) and graph replays."""
    c = LLAMA3_8B
    kv_token_bytes = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
    for bs in batches:
        setup = paged_setup(kv_layout(), [context - 1] * bs, [1] * bs, slack_pages=1)
        ids = torch.randint(0, c.vocab_size, (bs,), device="cuda")
        floor_bytes = run_all.weight_bytes(model, bs) + bs * context * kv_token_bytes
        floor_ms = floor_bytes / copy_bw * 1e3
        ceiling = f"roofline {floor_ms:.2f} ms ({floor_bytes / 1e9:.1f} GB)"
        graphable = tuple(n for n in names if n != "torch_native")  # run_all times it eager
        for name, cls in backend_variants(graphable, decode=True).items():
            eager = run_all.step_fn(model, cls(setup.cache, setup.pool), setup.pool, ids, bs,
                                     context)  # fmt: skip
            graphs = DecodeGraphRunner(model, c.max_position_embeddings, pad_slot=0, buckets=(bs,))
            graphed = run_all.step_fn(model, cls(setup.cache, setup.pool), setup.pool, ids, bs,
                                       context, graphs)  # fmt: skip
            graphed()  # captures
            variants = {"eager": eager, "CUDA graph": graphed,
                        "CUDA graph replay only": graphs.graphs[bs].graph.replay}  # fmt: skip
            for label, fn in variants.items():
                ms = cuda_time_ms(fn)
                rep.row(f"decode {name} {label}, batch {bs}, ctx {context}", f"{ms:.2f} ms/step",
                        ceiling, floor_ms / ms)  # fmt: skip
                rep.raw[f"decode_{name}_{label.replace(' ', '_')}_{bs}"] = ms
            del graphs
        del setup
        torch.cuda.empty_cache()


def bench_prefill(rep: Report, model, matmul: float, chunks, names: tuple[str, ...]) -> None:
    for n in chunks:
        flops = run_all.model_matmul_flops(n)
        floor_ms = flops / matmul * 1e3
        for name in names:
            setup = paged_setup(kv_layout(), [0], [n], slack_pages=1, random_kv=False)
            ids = torch.randint(0, LLAMA3_8B.vocab_size, (n,), device="cuda")
            backend = attention_backend_class(name)(setup.cache, setup.pool)
            step = partial(run_all.forward, model, backend, setup.pool, ids, [0], [n])
            ms = cuda_time_ms(step, warmup=2, repeats=5)
            rep.row(f"prefill {name}, one {n}-token chunk",
                    f"{ms:.1f} ms, {n / ms * 1e3:,.0f} tok/s, {flops / ms / 1e9:.0f} TFLOP/s",
                    f"MFU floor {floor_ms:.1f} ms", floor_ms / ms)  # fmt: skip
            rep.raw[f"prefill_{name}_{n}"] = ms
            del setup, backend
        torch.cuda.empty_cache()


# ---- entry points -----------------------------------------------------------------------------
def flashinfer_checks(rep: Report, workdir: Path, section) -> None:
    section("flashinfer kernel checks", lambda: check_kernels(rep))
    section("flashinfer model check", lambda: check_model_logits(rep))
    section("flashinfer engine check", lambda: check_engine(rep, workdir))


def flashinfer_figures(
    rep: Report, model, ceilings, batches, chunks, context, section, names=ALL_BACKENDS
) -> None:
    copy_bw, matmul = ceilings
    section("attention layer", lambda: bench_attention(rep, copy_bw, matmul, ALL_BACKENDS))
    section("flashinfer decode", lambda: bench_decode(rep, model, copy_bw, batches, context, names))
    section("flashinfer prefill", lambda: bench_prefill(rep, model, matmul, chunks, names))


def environment() -> dict[str, str]:
    import flashinfer
    import tvm_ffi

    env = run_all.environment()
    env["flashinfer"] = f"{flashinfer.__version__} (JIT-compiled on this host, nvcc of the image)"
    env["apache-tvm-ffi"] = tvm_ffi.__version__
    return env


def save_jit_modules(out: Path, limit: int) -> None:
    """Copy the compiled FlashInfer modules (<= 16 MB each, at most `limit`) to `out` for the
    next call to carry as prebuilt ones (flashinfer_wheels.py install)."""
    from flashinfer.jit import env as jit_env

    libs = sorted(jit_env.FLASHINFER_JIT_DIR.glob("*/*.so"), key=lambda p: p.stat().st_size)
    for so in libs:
        log(f"JIT module {so.name}: {so.stat().st_size / 1e6:.1f} MB")
    for so in [p for p in libs if p.stat().st_size <= 16_000_000][:limit]:
        (out / so.name).write_bytes(so.read_bytes())


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = run_all.figures_parser(prog, __doc__)
    parser.add_argument("--save-jit", type=int, default=0, help="compiled modules to keep")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    log(f"environment: {env}")
    rep = Report()
    ceilings = run_all.measure_ceilings(rep)
    section = rep.section
    flashinfer_checks(rep, Path(tempfile.mkdtemp()), section)
    if args.save_jit:  # before the figures, which may outlast the call
        section("save JIT modules", lambda: save_jit_modules(args.out, args.save_jit))
    if all(ok for _, _, ok in rep.checks) and rep.checks and not rep.errors:
        model = run_all.build_dummy_model()
        batches = [int(b) for b in args.batches.split(",")]
        chunks = [int(c) for c in args.chunks.split(",")]
        flashinfer_figures(rep, model, ceilings, batches, chunks, args.context, section)
    else:
        rep.errors.append("correctness checks failed or did not run: no figures measured")
    text = run_all.markdown(env, rep).replace(
        "# GPU figures:", "# GPU figures, FlashInfer backend beside Triton and torch-native:"
    )
    run_all.write_report(args.out, "flashinfer", text, env, rep)
    return 0 if rep.checks and all(ok for _, _, ok in rep.checks) and not rep.errors else 1
