"""Tensor parallelism on GPUs (NCCL): TP=2 greedy output equal to TP=1 and to HF transformers,
in one process and through prefill/decode nodes of different TP sizes.

    python3 -m scripts.gpu wheels mooncake pack out/pdcarry               # here, once
    # on a host with 2 GPUs (the device call carries both folders; grpcio at the stubs' version):
    PYTHONUNBUFFERED=1 python3 -m scripts.gpu tp --carry out/pdcarry --wheels out/pdwheels \\
        --out "$OUT"

Needs 2 GPUs, torch and transformers (the GPU image has both). The model is a random-weight
Llama saved to disk (real weights, not dummy) with SmolLM2-135M's head shape (9 query heads,
3 KV heads of 64 dims: TP=2 splits the KV heads 2 + 1) and 4 layers, fp32 with TF32 off, so the
comparison with HF transformers is token for token. Sections:

1. colocated: `LLM(tp_size=1|2, device="cuda")` with both attention backends (torch-native,
   Triton) against HF greedy on the same weights;
2. PD across TP sizes (with `--carry`): a real bootstrap, prefill and decode server
   (gateway/process/launcher.py's trio) for prefill TP=2 -> decode TP=1 and prefill TP=1 -> decode
   TP=2, through NIXL (UCX cuda_ipc) and Mooncake (its CUDA build over TCP, GPU memory staged):
   every prompt through the prefill node, output equal to HF, pages sent, and no page left on
   either node. A TP=2 node holds GPUs 0 and 1, the TP=1 node GPU 0. Rank 1 of the TP=2
   prefill node waits for its own GPU before it writes its KV shard (rank 0 waits for its own),
   so a missing wait shows here as wrong tokens, not on one GPU.

Writes check_tp.md (and the nodes' logs of a failed trio) to `--out`; exits 1 on any failure.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from scripts.gpu import check_pd
from scripts.gpu.environment import REPO_ROOT, console_wrappers, gpu_defaults
from scripts.tiny_models import hf_greedy, tiny_sizes

VOCAB = 2048
LENGTHS = (5, 37, 200, 300)  # chunked-prefill size 64: every prompt but the first is chunked
MAX_NEW = 8
PD_SPLITS = ((2, 1), (1, 2))  # (prefill TP, decode TP)


@dataclass
class Row:
    name: str
    ok: bool
    detail: str


def tiny_model(path: Path) -> Path:
    import torch
    import transformers as tf

    config = tf.LlamaConfig(
        **tiny_sizes(
            vocab_size=VOCAB,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
    )
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def colocated(
    model: Path, batch: list[list[int]], expected: list[list[int]], device: str
) -> list[Row]:
    from engine import LLM, SamplingParams

    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    rows = []
    for backend in ("torch_native", "triton") if device == "cuda" else ("torch_native",):
        for tp in (1, 2):
            started = time.perf_counter()
            llm = LLM(
                str(model),
                tp_size=tp,
                device=device,
                attention_backend=backend,
                page_size=16,
                chunked_prefill_size=64,
                max_total_tokens=4096,
            )
            try:
                got = [o.token_ids for o in llm.generate(batch, params)]
                llm.check_integrity()
            finally:
                llm.shutdown()
            same = sum(g == e for g, e in zip(got, expected, strict=True))
            rows.append(Row(f"colocated {backend} TP={tp} == HF", same == len(batch),
                            f"{same}/{len(batch)} prompts identical; "
                            f"{time.perf_counter() - started:.1f} s"))  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def pd_split(workdir: Path, model: Path, backend: str, p_tp: int, d_tp: int,
             batch: list[list[int]], expected: list[list[int]], device: str) -> Row:  # fmt: skip
    from gateway.process.launcher import pd_trio
    from proto import node_pb2

    name = f"PD {backend}: prefill TP={p_tp} -> decode TP={d_tp} == HF"
    env = {"UCX_NET_DEVICES": "lo", "MC_LOG_LEVEL": "ERROR", **check_pd.BACKENDS[backend]}
    attention = "triton" if device == "cuda" else "torch_native"
    node_args = ["--dtype", "float32", "--device", device, "--attention-backend", attention,
                 "--page-size", "16", "--max-total-tokens", "4096"]  # fmt: skip
    sampling = node_pb2.SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    logs = workdir / f"{backend}-p{p_tp}d{d_tp}"
    started = time.perf_counter()
    with pd_trio(
        logs,
        model,
        backend,
        node_args,
        prefill_args=["--tp-size", str(p_tp), "--chunked-prefill-size", "64"],
        # Without its prefix cache the decode node takes every page from the prefill node.
        decode_args=["--tp-size", str(d_tp), "--disable-prefix-cache"],
        env=env,
        ready_timeout=300,
        scripts=console_wrappers(workdir / "bin"),
    ) as trio:
        up = time.perf_counter() - started
        results = [trio.generate(p, sampling) for p in batch]  # one at a time
        results += trio.generate_many(batch, sampling)  # then all together
        trio.check_no_leaks()
    bad = []
    for i, r in enumerate(results):
        sent = r.prefill.sent_pages if r.prefill is not None else 0
        if r.finished is None or sent == 0 or r.token_ids != expected[i % len(batch)]:
            bad.append(f"#{i}: {r.prefill_error or 'differs'} ({sent} pages sent)")
    pages = [r.prefill.sent_pages for r in results if r.prefill is not None]
    detail = (f"{len(results) - len(bad)}/{len(results)} requests identical (each prompt alone, "
              f"then all together); pages sent {pages}; no page left on either node; "
              f"up in {up:.0f} s")  # fmt: skip
    return Row(name, not bad, detail + ("; " + "; ".join(bad) if bad else ""))


def markdown(info: dict[str, str], rows: list[Row]) -> str:
    lines = [f"- {k}: {v}" for k, v in info.items()]
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {r.name} | {'PASS' if r.ok else 'FAIL'} | {r.detail.replace('|', '/')} |"
              for r in rows]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = check_pd.carry_parser(prog, __doc__)
    parser.add_argument("--skip-colocated", action="store_true")
    args = parser.parse_args(argv)
    gpu_defaults()  # before the ranks and nodes start: they inherit it
    check_pd.install(args.carry, args.wheels, args.site)
    os.chdir(REPO_ROOT)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    info = {"date (UTC)": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
            **check_pd.versions(), "GPUs": str(torch.cuda.device_count()),
            "NCCL": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda"
            else "-"}  # fmt: skip
    print(info, flush=True)
    batch = prompts()
    rows: list[Row] = []
    workdir = Path(tempfile.mkdtemp(prefix="check_tp-"))
    model = tiny_model(workdir / "model")
    expected = hf_greedy(model, batch, MAX_NEW, device=args.device)
    if not args.skip_colocated:
        rows += colocated(model, batch, expected, args.device)
    backends, missing = check_pd.available(check_pd.DEFAULT_BACKENDS)
    rows += [Row(f"PD {m.split(':')[0]}", False, m.split(": ", 1)[1]) for m in missing]
    for backend in backends:
        for p_tp, d_tp in PD_SPLITS:
            try:
                rows.append(
                    pd_split(workdir, model, backend, p_tp, d_tp, batch, expected, args.device)
                )
            except Exception as exc:  # the row records it; the next split still runs
                traceback.print_exc()
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                rows.append(Row(f"PD {backend}: prefill TP={p_tp} -> decode TP={d_tp}", False, why))
                _keep_logs(workdir / f"{backend}-p{p_tp}d{d_tp}", args.out)
            print(rows[-1], flush=True)
    text = markdown(info, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check_tp.md").write_text(text)
    print(text, flush=True)
    return 0 if rows and all(r.ok for r in rows) else 1


def _keep_logs(logs: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for log in logs.glob("*.log"):
        (out / f"{logs.name}-{log.name}").write_bytes(log.read_bytes()[-1_000_000:])
