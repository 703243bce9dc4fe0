"""One GPU run: correctness of the GPU attention backends, then the engine's figures against the
ceilings measured in the same run on the same GPU, as a markdown table.

    PYTHONUNBUFFERED=1 python3 -m scripts.gpu engine --out "$OUT"

Needs torch with CUDA and Triton, nothing else (the GPU image has both). Steps:
1. ceilings: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate
   (8192^3, random data);
2. correctness, before any number counts: the Triton backend against torch-native on random bf16
   inputs (paged decode with split-KV, extends with prefixes, a Llama-3-8B-shaped model's logits
   through chunked prefill and decode); the fused elementwise kernels (engine/models/elementwise)
   against their plain-torch references, alone and through the model; relative error
   ||out - ref|| / ||ref||;
3. decode step time of a Llama-3-8B-shaped model (dummy bf16 weights, bf16 KV, page size 16) at
   batch 1/16/64/256 and context 1k, eager and with CUDA graphs, against the HBM roofline
   (weight bytes + KV bytes read) / copy bandwidth; with graphs also the unfused elementwise
   path (A/B) and the graph replay alone (what overlapping the host's batch building would leave);
4. prefill throughput of one 1k/4k/8k-token chunk against the matmul rate (MFU: the model's
   matmul FLOPs, causal attention counted once), fused and unfused elementwise.
5. when flashinfer imports (wheels carried: scripts/gpu/flashinfer_wheels.py), the FlashInfer
   backend's checks and rows from scripts/gpu/check_flashinfer.py: its checks gate the figures
   with the others, and it adds one layer's attention of every backend and flashinfer's decode
   and prefill rows beside the ones above; without flashinfer a row says it was not run.
6. with `--pd-carry` (scripts/gpu/check_pd.py: NIXL / Mooncake and grpcio / protobuf wheels),
   prefill/decode disaggregation on the GPU: greedy output through real prefill and decode
   servers equals the colocated decode node, and no page leaks; its rows join the correctness
   checks (without the flag a row says it was not run).
A section that fails records its error in the table; the run goes on with the next one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.attention.torch_native import TorchNativeBackend
from engine.attention.triton_backend import TritonBackend
from engine.cuda_graph import DecodeGraphRunner
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory.kv_cache import KVLayout, PagedKVCache, ReqToTokenPool
from engine.model_config import ModelConfig
from engine.models import build_model
from engine.models import elementwise as ew
from scripts import tiny_models
from scripts.gpu.environment import add_site_arg
from scripts.tiny_models import llama_config, write_llama_config

LLAMA3_8B = ModelConfig.from_dict(tiny_models.LLAMA3_8B)  # the one Llama-3-8B config.json
PAGE_SIZE = 16
MODEL_LINE = (
    "Model: Llama-3-8B shapes (32 layers, hidden 4096, 32 q / 8 kv heads, head dim 128, "
    "MLP 14336, vocab 128256), dummy bf16 weights, bf16 KV, page size 16."
)
BF16_REL_TOL = 2e-2  # bf16 operands: errors of 1e-3..1e-2 are rounding; NaN never passes


@dataclass
class Report:
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # what, value, ceiling, %
    checks: list[tuple[str, float, bool]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    def row(self, what: str, value: str, ceiling: str = "", ratio: float | None = None) -> None:
        pct = f"{100 * ratio:.1f}%" if ratio is not None else ""
        self.rows.append((what, value, ceiling, pct))
        print(f"  {what}: {value} {ceiling} {pct}", flush=True)

    def section(self, name: str, fn: Callable[[], object]) -> None:
        """Runs `fn`; a failure is recorded as an error and the run goes on."""
        log(f"== {name}")
        try:
            fn()
        except Exception as exc:  # a failed section is reported, the run goes on
            traceback.print_exc()
            self.errors.append(f"{name}: {type(exc).__name__}: {exc}")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cuda_time_ms(fn: Callable[[], object], warmup: int = 3, repeats: int = 10) -> float:
    """Median of `repeats` timed calls, each between two CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


# ---- ceilings ---------------------------------------------------------------------------------
def copy_ms() -> tuple[float, int]:
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    return cuda_time_ms(lambda: dst.copy_(src), warmup=3, repeats=20), 2 * src.nbytes


def _matmul_ms(n: int) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return cuda_time_ms(lambda: a @ b, warmup=3, repeats=20)


def measure_ceilings(rep: Report) -> tuple[float, float]:
    ms, moved = copy_ms()
    copy_bw = moved / (ms * 1e-3)
    n = 8192
    matmul = 2 * n**3 / (_matmul_ms(n) * 1e-3)
    torch.cuda.empty_cache()
    rep.row("HBM copy bandwidth (2 GiB, read + write)", f"{copy_bw / 1e9:.0f} GB/s")
    rep.row("bf16 matmul rate (8192^3, random)", f"{matmul / 1e12:.0f} TFLOP/s")
    rep.raw["copy_bw"], rep.raw["matmul_flops"] = copy_bw, matmul
    return copy_bw, matmul


# ---- random paged batches ---------------------------------------------------------------------
@dataclass
class PagedSetup:
    cache: PagedKVCache
    pool: ReqToTokenPool
    batch: ForwardBatch


def paged_setup(
    layout: KVLayout,
    prefix_lens: list[int],
    extend_lens: list[int],
    *,
    slack_pages: int = 4,
    random_kv: bool = True,
    shuffle: bool = True,
) -> PagedSetup:
    """Requests owning (shuffled) pages of a random cache, and a batch adding `extend_lens`
    tokens to `prefix_lens` cached ones."""
    ps = layout.page_size
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pages_per_req = [-(-s // ps) for s in seq_lens]
    num_pages = 1 + sum(pages_per_req) + slack_pages
    cache = PagedKVCache(layout, num_pages, torch.device("cuda"))
    if random_kv:
        for chunk in cache.buffer.split(1024):
            chunk.normal_()
    pool = ReqToTokenPool(len(seq_lens) + 1, max(seq_lens) + ps, torch.device("cuda"))
    order = torch.randperm(num_pages - 1) + 1 if shuffle else torch.arange(1, num_pages)
    within = torch.arange(ps)
    used = 0
    new_locs, positions = [], []
    for i, (seq, prefix, n) in enumerate(zip(seq_lens, prefix_lens, pages_per_req, strict=True)):
        pages = order[used : used + n]
        used += n
        locs = (pages[:, None] * ps + within[None, :]).reshape(-1)[:seq].cuda()
        pool.table[i + 1, :seq] = locs
        new_locs.append(locs[prefix:])
        positions.append(torch.arange(prefix, seq, device="cuda"))
    mode = ForwardMode.DECODE if all(e == 1 for e in extend_lens) else ForwardMode.EXTEND
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.randint(0, 1000, (sum(extend_lens),), device="cuda"),
        positions=torch.cat(positions),
        out_cache_loc=torch.cat(new_locs),
        req_slots=list(range(1, len(seq_lens) + 1)),
        seq_lens=seq_lens,
        extend_lens=list(extend_lens),
        attn_backend=None,  # type: ignore[arg-type]
    )
    return PagedSetup(cache, pool, batch)


def run_layer(backend_cls: type, setup: PagedSetup, q, k, v) -> torch.Tensor:
    cache = PagedKVCache(setup.cache.layout, setup.cache.num_pages, torch.device("cuda"))
    cache.buffer.copy_(setup.cache.buffer)
    backend = backend_cls(cache, setup.pool)
    batch = replace(setup.batch, attn_backend=backend)
    backend.init_metadata(batch)
    out: torch.Tensor = backend.forward(q, k, v, 1, batch)
    return out


def check_backend_kernels(rep: Report) -> None:
    layout = KVLayout(2, 8, 128, PAGE_SIZE, torch.bfloat16)
    rand_ctx = torch.randint(0, 3000, (64,), generator=torch.Generator().manual_seed(0))
    cases = {
        "decode B=1 ctx 1024": ([1023], [1]),
        "decode B=64 ctx 1..3000": (rand_ctx.tolist(), [1] * 64),
        "decode B=3 ctx 5/17/2049": ([4, 16, 2048], [1, 1, 1]),
        "extend fresh 1000+7": ([0, 0], [1000, 7]),
        "extend prefix 300+200, 17+1, 0+64, 1500+513": ([300, 17, 0, 1500], [200, 1, 64, 513]),
    }
    for name, (prefix, ext) in cases.items():
        setup = paged_setup(layout, prefix, ext)
        n = sum(ext)
        q = torch.randn(n, 32, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(n, 8, 128, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(n, 8, 128, dtype=torch.bfloat16, device="cuda")
        ref = run_layer(TorchNativeBackend, setup, q, k, v)
        out = run_layer(TritonBackend, setup, q, k, v)
        err = rel_err(out, ref)
        ok = bool(torch.isfinite(out).all()) and err < BF16_REL_TOL and bool(ref.abs().sum() > 0)
        rep.checks.append((f"triton vs torch_native, {name}", err, ok))
        log(f"check {name}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")


def check_elementwise(rep: Report) -> None:
    """Each fused kernel against its plain-torch reference on random inputs: Llama-3-8B shapes
    and odd ones (hidden 576, 9 q / 3 kv heads of 64: masked tails), q/k as strided views of a
    QKV output; bf16 and fp32. The kernels round where the references do, so the tolerance is
    rounding-level."""
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    shapes = {"8B": (4096, 14336, 32, 8, 128), "odd": (576, 1536, 9, 3, 64)}
    for dtype in (torch.bfloat16, torch.float32):
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        for label, (hidden, inter, hq, hk, hd) in shapes.items():
            n = 77
            x, r = rand(n, hidden, dtype=dtype), rand(n, hidden, dtype=dtype)
            w = 1 + 0.1 * rand(hidden, dtype=dtype)
            gate_up = rand(n, 2 * inter, dtype=dtype)
            qkv = rand(n, (hq + 2 * hk) * hd, dtype=dtype)
            q = qkv[:, : hq * hd].view(n, hq, hd)
            k = qkv[:, hq * hd : (hq + hk) * hd].view(n, hk, hd)
            positions = torch.randint(0, 8000, (n,), device="cuda", generator=gen)
            angles = torch.rand(8192, hd // 2, device="cuda", generator=gen) * 6.3
            cos, sin = angles.cos(), angles.sin()
            pairs = {
                "rms_norm": ((ew.rms_norm(x, w, 1e-5),), (ew.rms_norm_reference(x, w, 1e-5),)),
                "add_rms_norm": (ew.add_rms_norm(x, r, w, 1e-5),
                                 ew.add_rms_norm_reference(x, r, w, 1e-5)),
                "silu_and_mul": ((ew.silu_and_mul(gate_up),),
                                 (ew.silu_and_mul_reference(gate_up),)),
                "rotary q,k": (ew.rotary(q, k, positions, cos, sin),
                               ew.rotary_reference(q, k, positions, cos, sin)),
            }  # fmt: skip
            for op, (outs, refs) in pairs.items():
                err = max(rel_err(o, f) for o, f in zip(outs, refs, strict=True))
                ok = err < tol and all(bool(torch.isfinite(o).all()) for o in outs)
                ok = ok and all(o.shape == f.shape for o, f in zip(outs, refs, strict=True))
                name = f"fused {op} vs torch, {label} shapes, {str(dtype).split('.')[1]}"
                rep.checks.append((name, err, ok))
                log(f"check {name}: rel err {err:.2e} {'ok' if ok else 'FAIL'}")


def write_small_llama(model_dir: Path, **sizes: int) -> Path:
    """SMALL_LLAMA's config.json (with `sizes` overriding its sizes) for load_format="dummy"."""
    return write_llama_config(model_dir, llama_config(**sizes))


def mixed_prompts() -> list[list[int]]:
    """The engine checks' 12 prompts of 1-340 tokens; every third starts with the same 40 tokens
    (prefix-cache hits), several are split by a 128-token prefill chunk."""
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 2048, (40,), generator=gen).tolist()
    return [
        (shared if i % 3 == 0 else []) + torch.randint(0, 2048, (n,), generator=gen).tolist()
        for i, n in enumerate((5, 17, 64, 130, 300, 9, 33, 250, 77, 1, 190, 41))
    ]


def check_engine(rep: Report, workdir: Path) -> None:
    """The whole engine on the GPU (scheduler, chunked prefill, prefix cache, decode through CUDA
    graphs with changing batch sizes): greedy output with the Triton backend equals torch-native,
    token for token, on a small fp32 dummy-weight Llama (the kernels use exact fp32 products)."""
    from engine import LLM, SamplingParams

    model_dir = write_small_llama(workdir / "small-llama")
    prompts = mixed_prompts()
    params = [
        SamplingParams(max_new_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]  # requests finish at different steps: the decode batch shrinks through several buckets
    outputs = {}
    for backend in ("torch_native", "triton"):
        llm = LLM(str(model_dir), load_format="dummy", dtype="float32", device="cuda",
                  page_size=16, chunked_prefill_size=128, attention_backend=backend)  # fmt: skip
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        if backend == "triton":
            graphs = llm.runner.graph_runner
            rep.raw["engine_graph_buckets"] = sorted(graphs.graphs) if graphs else []
        llm.check_integrity()
        del llm
    same = sum(a == b for a, b in zip(outputs["triton"], outputs["torch_native"], strict=True))
    name = (f"engine greedy, triton + CUDA graphs (buckets {rep.raw['engine_graph_buckets']}) "
            f"== torch_native, 12 requests, fp32 (requests identical: {same}/12)")  # fmt: skip
    rep.checks.append((name, 1 - same / len(prompts), same == len(prompts)))
    log(f"check {name}")


# ---- the Llama-3-8B-shaped model --------------------------------------------------------------
def build_dummy_model(num_layers: int = LLAMA3_8B.num_layers) -> torch.nn.Module:
    """Random bf16 weights of Llama-3-8B's shapes, made on the GPU (uniform like the loader's)."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = build_model(replace(LLAMA3_8B, num_layers=num_layers))
    finally:
        torch.set_default_dtype(torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(1.0)
            else:
                param.uniform_(-0.05, 0.05, generator=gen)
    return model.eval()


def weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Bytes a decode step must read: every weight once, of the embedding only the batch's rows."""
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens"):
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def kv_layout() -> KVLayout:
    c = LLAMA3_8B
    return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, PAGE_SIZE, torch.bfloat16)


def check_model(rep: Report, model: torch.nn.Module, gate: bool) -> None:
    """Logits of chunked prefill (fresh, then with a prefix) and decode steps, both backends.
    `gate`: a pass criterion (a model of few layers); otherwise reported only, since bf16
    differences between two correct kernels compound through 32 layers of random weights."""
    num_layers = len(model.layers)  # type: ignore[arg-type]
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompts = [torch.randint(0, LLAMA3_8B.vocab_size, (n,), device="cuda", generator=gen)
               for n in (700, 300)]  # fmt: skip
    decode_ids: list[torch.Tensor] = []  # the reference's greedy picks, fed to every variant
    ref = model_logits(model, TorchNativeBackend, prompts, decode_ids, unfused=True)
    variants = {
        "triton backend + fused elementwise vs torch_native + torch elementwise": (
            TritonBackend, False),
        "fused elementwise vs torch elementwise (torch_native backend)": (
            TorchNativeBackend, False),
    }  # fmt: skip
    for what, (cls, unfused) in variants.items():
        out = model_logits(model, cls, prompts, decode_ids, unfused=unfused)
        errs = [rel_err(o, r) for r, o in zip(ref, out, strict=True)]
        picks = [bool((o.argmax(-1) == r.argmax(-1)).all()) for r, o in zip(ref, out, strict=True)]
        finite = all(bool(torch.isfinite(t).all()) for t in out)
        name = f"{num_layers}-layer Llama-3-8B-shaped logits, 2 chunks + 8 decode steps, {what}"
        log(f"check {name}: rel errs {[f'{e:.1e}' for e in errs]}, argmax agree {picks}")
        if gate:
            rep.checks.append((name, max(errs), max(errs) < BF16_REL_TOL and finite))
        else:
            rep.row(f"info: {name}", f"worst rel. error {max(errs):.2e}",
                    f"same greedy pick in {sum(picks)}/{len(picks)} steps")  # fmt: skip


def model_logits(model, cls, prompts, decode_ids: list[torch.Tensor], unfused: bool):
    """Logits of 2 chunked-prefill steps and 8 decode steps; the decode inputs are appended to
    `decode_ids` (greedy picks) on the first call and reused by later ones."""
    layout = replace(kv_layout(), num_layers=len(model.layers))
    setup = paged_setup(layout, [0, 0], [716, 316], random_kv=False)
    backend = cls(setup.cache, setup.pool)
    steps: list[torch.Tensor] = []
    chunks = [([0, 0], [400, 100]), ([400, 100], [300, 200])]  # (prefix, extend) per request
    with ew.torch_elementwise() if unfused else contextlib.nullcontext():
        for prefix, ext in chunks:
            ids = torch.cat([p[s : s + n] for p, s, n in zip(prompts, prefix, ext, strict=True)])
            steps.append(forward(model, backend, setup.pool, ids, prefix, ext))
        seq = [700, 300]
        for i in range(8):
            if len(decode_ids) <= i:
                decode_ids.append(steps[-1].argmax(-1))
            steps.append(forward(model, backend, setup.pool, decode_ids[i], seq, [1, 1]))
            seq = [s + 1 for s in seq]
    return steps


def forward(model, backend, pool, ids, prefix_lens, extend_lens, graphs=None) -> torch.Tensor:
    batch = make_batch(backend, pool, ids, prefix_lens, extend_lens)
    with torch.inference_mode():
        if graphs is not None:
            return graphs.replay(batch)
        out: torch.Tensor = model(batch)
        return out


def make_batch(backend, pool, ids, prefix_lens, extend_lens) -> ForwardBatch:
    """What ModelRunner.build_batch makes, from the slots 1..R of `pool`."""
    slots = list(range(1, len(prefix_lens) + 1))
    positions = torch.cat(
        [torch.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens, strict=True)]
    ).cuda()
    slot_per_token = torch.repeat_interleave(torch.tensor(slots), torch.tensor(extend_lens))
    mode = ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND
    batch = ForwardBatch(
        mode=mode,
        input_ids=ids,
        positions=positions,
        out_cache_loc=pool.table[slot_per_token.cuda(), positions],
        req_slots=slots,
        seq_lens=[p + n for p, n in zip(prefix_lens, extend_lens, strict=True)],
        extend_lens=list(extend_lens),
        attn_backend=backend,
    )
    backend.init_metadata(batch)
    return batch


# ---- decode and prefill figures ---------------------------------------------------------------
def bench_decode(rep: Report, model, copy_bw: float, batches: list[int], context: int) -> None:
    c = LLAMA3_8B
    kv_token_bytes = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
    for bs in batches:
        setup = paged_setup(kv_layout(), [context - 1] * bs, [1] * bs, slack_pages=1)
        ids = torch.randint(0, c.vocab_size, (bs,), device="cuda")
        floor_bytes = weight_bytes(model, bs) + bs * context * kv_token_bytes
        floor_ms = floor_bytes / copy_bw * 1e3
        ceiling = f"roofline {floor_ms:.2f} ms ({floor_bytes / 1e9:.1f} GB)"
        for name in ("triton", "torch_native"):
            if name == "torch_native" and bs > 64:
                continue  # its padded gather copies the whole context per layer: minutes here
            cls = TritonBackend if name == "triton" else TorchNativeBackend
            backend = cls(setup.cache, setup.pool)
            step = step_fn(model, backend, setup.pool, ids, bs, context)
            ms = cuda_time_ms(step)
            rep.row(f"decode {name} eager, batch {bs}, ctx {context}", f"{ms:.2f} ms/step",
                    ceiling, floor_ms / ms)  # fmt: skip
            rep.raw[f"decode_{name}_eager_{bs}"] = ms
        for unfused in (True, False):  # the fused one last: its graph is timed alone below
            backend = TritonBackend(setup.cache, setup.pool)
            graphs = DecodeGraphRunner(model, c.max_position_embeddings, pad_slot=0, buckets=(bs,))
            step = step_fn(model, backend, setup.pool, ids, bs, context, graphs)
            with ew.torch_elementwise() if unfused else contextlib.nullcontext():
                step()  # captures the graph with this elementwise path
            ms = cuda_time_ms(step)
            label = " (torch elementwise)" if unfused else ""
            rep.row(f"decode triton CUDA graph{label}, batch {bs}, ctx {context}",
                    f"{ms:.2f} ms/step", ceiling, floor_ms / ms)  # fmt: skip
            rep.raw[f"decode_triton_graph{'_unfused' if unfused else ''}_{bs}"] = ms
        replay = graphs.graphs[bs].graph.replay  # same inputs: the GPU's part of a step alone
        ms = cuda_time_ms(replay)
        rep.row(f"decode triton CUDA graph replay only (no host batch building), batch {bs}",
                f"{ms:.2f} ms/step", ceiling, floor_ms / ms)  # fmt: skip
        rep.raw[f"decode_triton_replay_{bs}"] = ms
        rep.raw[f"decode_floor_ms_{bs}"] = floor_ms
        del setup, graphs, backend
        torch.cuda.empty_cache()


def step_fn(model, backend, pool, ids, bs, context, graphs=None) -> Callable[[], object]:
    """One decode step (metadata built on the host each time, as the engine does)."""

    def step() -> object:
        return forward(model, backend, pool, ids, [context - 1] * bs, [1] * bs, graphs)

    return step


def model_matmul_flops(tokens: int) -> float:
    """Matmul FLOPs of one fresh prefill chunk: projections and MLP of every token, causal
    attention (QK^T and PV over each token's visible keys), the LM head of the last token."""
    c = LLAMA3_8B
    per_token_linear = c.hidden_size * (c.q_size + 2 * c.kv_size + c.q_size)
    per_token_linear += 3 * c.hidden_size * c.intermediate_size
    linear = 2 * tokens * per_token_linear * c.num_layers
    visible = tokens * (tokens + 1) / 2
    attention = 2 * 2 * visible * c.num_heads * c.head_dim * c.num_layers
    return linear + attention + 2 * c.hidden_size * c.vocab_size


def bench_prefill(rep: Report, model, matmul: float, chunks: list[int]) -> None:
    for n in chunks:
        flops = model_matmul_flops(n)
        floor_ms = flops / matmul * 1e3
        for name in ("triton", "torch_native"):
            for unfused in (True, False):
                with ew.torch_elementwise() if unfused else contextlib.nullcontext():
                    ms = _prefill_ms(model, name, n)
                label = " (torch elementwise)" if unfused else ""
                rep.row(f"prefill {name}{label}, one {n}-token chunk",
                        f"{ms:.1f} ms, {n / ms * 1e3:,.0f} tok/s, {flops / ms / 1e9:.0f} TFLOP/s",
                        f"MFU floor {floor_ms:.1f} ms", floor_ms / ms)  # fmt: skip
                rep.raw[f"prefill_{name}{'_unfused' if unfused else ''}_{n}"] = ms
        torch.cuda.empty_cache()


def _prefill_ms(model, name: str, n: int) -> float:
    setup = paged_setup(kv_layout(), [0], [n], slack_pages=1, random_kv=False)
    ids = torch.randint(0, LLAMA3_8B.vocab_size, (n,), device="cuda")
    cls = TritonBackend if name == "triton" else TorchNativeBackend
    backend = cls(setup.cache, setup.pool)
    return cuda_time_ms(
        lambda: forward(model, backend, setup.pool, ids, [0], [n]), warmup=2, repeats=5
    )


# ---- the table --------------------------------------------------------------------------------
def environment() -> dict[str, str]:
    import triton  # type: ignore[import-untyped]

    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
         "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return {
        "date (UTC)": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "GPU": torch.cuda.get_device_name(0),
        "nvidia-smi": smi.stdout.strip(),
        "SMs": str(torch.cuda.get_device_properties(0).multi_processor_count),
        "torch": torch.__version__,
        "CUDA (torch)": str(torch.version.cuda),
        "triton": triton.__version__,
        "python": sys.version.split()[0],
    }  # fmt: skip


def markdown(env: dict[str, str], rep: Report) -> str:
    lines = ["# GPU figures: attention, decode and prefill of a Llama-3-8B-shaped model", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", MODEL_LINE, ""]
    lines += ["## Correctness (must pass before any number counts)", "",
              "| check | rel. error | pass |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {name} | {err:.2e} | {'yes' if ok else 'NO'} |" for name, err, ok in rep.checks]
    lines += ["", "(for the engine check the error column is the fraction of requests that differ)"]
    lines += ["", "## Figures", "", "| what | measured | ceiling | % of ceiling |",
              "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rep.rows]
    if rep.errors:
        lines += ["", "## Sections that failed", ""] + [f"- {e}" for e in rep.errors]
    return "\n".join(lines) + "\n"


def write_report(out: Path, tag: str, text: str, env: dict[str, str], rep: Report) -> None:
    """gpu-<date>[-<tag>]-<gpu>.md and .json into `out`, the table onto stdout."""
    name = "-".join(
        p for p in ("gpu", env["date (UTC)"][:10], tag, env["GPU"].split()[1].lower()) if p
    )
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps({"env": env, **rep.raw}, indent=1))
    print(text, flush=True)


def flashinfer_module(rep: Report) -> Any:
    """check_flashinfer when flashinfer imports (the `gpu` extra, carried as wheels: see
    scripts/gpu/flashinfer_wheels.py); otherwise a row saying why its backend was not run."""
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        rep.row("flashinfer backend", "not run: flashinfer-python not installed "
                "(scripts/gpu/flashinfer_wheels.py)")  # fmt: skip
        return None
    from scripts.gpu import check_flashinfer

    return check_flashinfer


def figures_parser(prog: str | None, description: str) -> argparse.ArgumentParser:
    """The flags of this suite and check_flashinfer: the report folder and the shapes timed."""
    parser = argparse.ArgumentParser(prog=prog, description=description.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--chunks", default="1024,4096,8192")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = figures_parser(prog, __doc__)
    parser.add_argument("--pd-carry", type=Path, help="check_pd.py's --carry folder")
    parser.add_argument("--pd-wheels", type=Path, help="check_pd.py's --wheels folder")
    add_site_arg(parser)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    log(f"environment: {env}")
    rep = Report()
    copy_bw, matmul = measure_ceilings(rep)
    section = rep.section
    section("kernel checks", lambda: check_backend_kernels(rep))
    section("elementwise checks", lambda: check_elementwise(rep))
    section("engine check", lambda: check_engine(rep, Path(tempfile.mkdtemp())))
    section("model check", lambda: check_model(rep, build_dummy_model(2), gate=True))
    if args.pd_carry is not None:
        from scripts.gpu import check_pd

        check_pd.pd_checks(rep, section, args.pd_carry, args.pd_wheels, args.site)
    else:
        rep.row("PD greedy on one GPU (check_pd.py)", "not run: no --pd-carry")
    flashinfer = flashinfer_module(rep)
    if flashinfer is not None:
        flashinfer.flashinfer_checks(rep, Path(tempfile.mkdtemp()), section)
    t0 = time.perf_counter()
    model = build_dummy_model()
    log(f"model built in {time.perf_counter() - t0:.1f} s")
    section("model check", lambda: check_model(rep, model, gate=False))
    if all(ok for _, _, ok in rep.checks) and rep.checks and not rep.errors:
        batches = [int(b) for b in args.batches.split(",")]
        section("decode", lambda: bench_decode(rep, model, copy_bw, batches, args.context))
        chunks = [int(c) for c in args.chunks.split(",")]
        section("prefill", lambda: bench_prefill(rep, model, matmul, chunks))
        if flashinfer is not None:  # its rows beside the ones above (scripts/gpu/check_flashinfer)
            flashinfer.flashinfer_figures(rep, model, (copy_bw, matmul), batches, chunks,
                                          args.context, section, names=("flashinfer",))  # fmt: skip
        del model
        torch.cuda.empty_cache()
    else:
        rep.errors.append("correctness checks failed or did not run: no figures measured")
    write_report(args.out, "", markdown(env, rep), env, rep)
    return 0 if rep.checks and all(ok for _, _, ok in rep.checks) and not rep.errors else 1
