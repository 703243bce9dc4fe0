"""The engine alone, the decode node over gRPC, and the whole served path, on one GPU, one model
shape: where the tokens per second go between the engine and the client.

    python -m scripts.gpu pack out/gpucarry        # here, once: wheels (~30 MiB)
    # on the GPU host (the device call carries the folder):
    python3 -m scripts.gpu serve --carry out/gpucarry --out "$OUT" \\
        [--workers 4] [--cluster-args "--gateway-workers 2"]
    # a dry run on the CPU with a small shape:
    python -m scripts.gpu serve --device cpu --shape small --skip-engine \\
        --output-len 32 --concurrency 16 --num-requests 32 --out /tmp/sve

`serve` does, in one call:

1. install (with `--carry`): the carried wheels (grpcio at the stubs' version, starlette, uvicorn,
   httptools, pydantic; what the GPU image lacks) and the project itself (`pip install --no-deps
   --no-build-isolation`, so `pd-cluster` and the servers are console scripts there), then
   Mooncake's pruned CUDA build (scripts/gpu/mooncake_wheels.py) into a site folder;
2. engine: `scripts.gpu step --batches C --context 272` in a process of its own (decode
   step time with and without overlap; engine tok/s = C / step time with overlap);
3. one `pd-cluster --prefill 0 --decode 1` (gateway/process/cluster.py's own parser, so
   `--cluster-args` takes any of its flags), the decode node with the engine's settings: dummy
   bf16 weights, Triton attention, CUDA graphs (always on for CUDA), overlap, prefix cache off;
4. node direct: `scripts.bench.node --target <the decode node>`: C gRPC streams back to back,
   `--num-requests` requests of `--input-len` random tokens and `--output-len` new tokens;
5. served: `scripts.serving.bench_serving --workers W` through the gateway, the same requests
   (random dataset, ignore-eos, max concurrency C), watching the gateway's and the node's CPU
   and the node's step metrics.

`--offline` adds the offline engine (`LLM.generate` in this process, in waves of C) over the
same requests, for hosts where engine_step cannot run (it is CUDA-only): `--device cpu
--skip-engine --offline`.

Both sides use the same shape: `--shape 8b` is scripts/tiny_models.py's LLAMA3_8B (vocab
128,256), and the served model directory gets a generated word-level tokenizer of exactly that
vocabulary (`t0` ... `t128255`, one word per id): the gateway detokenises every id, but a real
Llama-3 BPE tokenizer's decode costs differ (reported as a caveat). The figures differ in what
they include: engine tok/s is decode steps only at a full batch (contexts 272..464), node and
served tok/s are whole runs (prefill, ramp-up and drain of `--num-requests / C` waves).

Writes to `--out`: serve_vs_engine.md (the table), engine_step.md, node_direct.json,
served.json (summary and CPU; per-request traces dropped), cluster.log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from scripts.gpu.environment import REPO_ROOT, add_site_arg, gpu_defaults, site_dir, use_site
from scripts.tiny_models import LLAMA3_8B, SMALL_LLAMA, write_llama_config

# "small": SMALL_LLAMA's layers with a vocabulary that holds scripts.bench.node's prompt ids
# (100..20000) and bench_serving's (1000..10000).
SHAPES = {"8b": LLAMA3_8B, "small": {**SMALL_LLAMA, "vocab_size": 32768}}
ENGINE_CONTEXT = 272  # the served requests' mean context: 16 prompt + 256 of the 512 outputs
_MEDIAN = re.compile(r"^(\w+), batch (\d+): .* median ([\d.]+)$", re.M)


@dataclass
class Figures:
    """What each phase measured; None where a phase was skipped or failed."""

    engine_ms: dict[str, float] = field(default_factory=dict)  # mode -> decode step ms
    offline_tok_s: float | None = None  # LLM.generate over the same requests (--offline)
    node: dict[str, object] | None = None
    node_client_cpu_s: float = 0.0
    node_cpu: list[dict[str, object]] = field(default_factory=list)
    served: dict[str, object] | None = None
    errors: list[str] = field(default_factory=list)


def log(msg: str) -> None:
    print(f"[serve_vs_engine {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- pack and install ----------------------------------------------------------------------------

WHEELS = (
    "grpcio==1.85.1", "starlette==1.10.0", "uvicorn==0.54.0", "httptools==0.9.0",
    "protobuf==7.36.2", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
    "typing-inspection==0.4.5", "orjson==3.13.0", "pyzmq==27.3.0", "msgpack==1.2.4",
)  # fmt: skip


def pack(out: Path, nixl: bool = False) -> None:
    from scripts.gpu import mooncake_wheels

    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
    pip += [*mooncake_wheels.PLATFORM_ARGS, "--platform", "manylinux2014_x86_64"]
    subprocess.run([*pip, "-d", str(out / "wheels"), *WHEELS], check=True)
    mooncake_wheels.pack(out / "mooncake")
    for pruned in [] if nixl else (out / "mooncake").glob("nixl*"):  # 29 MiB less to carry
        pruned.unlink()


def install(carry: Path, site: Path) -> None:
    """Carried wheels and the project into this interpreter's environment (a GPU host's image is
    thrown away after the call); Mooncake into `site`, first on every import path."""
    from scripts.gpu import mooncake_wheels

    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    wheels = sorted(str(p) for p in (carry / "wheels").glob("*.whl"))
    subprocess.run([*pip, *wheels], check=True)
    subprocess.run([*pip, "--no-build-isolation", str(REPO_ROOT)], check=True)
    use_site(site, mooncake_wheels.install(carry / "mooncake", site))


def prepare_host(carry: Path | None, site: Path | None) -> None:
    """Before a GPU run: the carried wheels and the project installed (`install`), or without
    `carry` the site in use; the GPU defaults in the environment."""
    if carry is not None:
        install(carry, site_dir(site))
    else:
        use_site(None)
    gpu_defaults()


# -- the model -----------------------------------------------------------------------------------


def word_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """tokenizer.json of `vocab_size` words t0..tN-1, one per id (decoded joined by spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1 << 20}))


def model_dir(shape: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="sve-model-")) / f"llama-{shape}"
    config = SHAPES[shape]
    write_llama_config(path, config)
    word_tokenizer(path, int(config["vocab_size"]))  # type: ignore[call-overload]
    return path


# -- the phases ----------------------------------------------------------------------------------


def engine_phase(args: argparse.Namespace, figures: Figures) -> None:
    command = [sys.executable, "-m", "scripts.gpu", "step", "--batches", str(args.concurrency)]
    command += ["--context", str(ENGINE_CONTEXT), "--out", str(args.out / "engine_step.md")]
    log(f"engine: {shlex.join(command)}")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=args.engine_timeout
        )
    except subprocess.TimeoutExpired:
        figures.errors.append(f"engine_step ran past --engine-timeout {args.engine_timeout:g} s")
        return
    print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
    for name, _batch, ms in _MEDIAN.findall(done.stdout):
        mode = "on" if name == "OverlapScheduler" else "off"
        figures.engine_ms[mode] = float(ms)
    if done.returncode != 0 or "on" not in figures.engine_ms:
        figures.errors.append(f"engine_step exited {done.returncode}: {done.stderr[-300:]}")


def offline_phase(args: argparse.Namespace, model: Path, figures: Figures) -> None:
    """The offline engine (engine/llm.py) over the same requests, whole run: prefill, waves and
    drain included, as the node and served figures are (engine_step times decode steps only)."""
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(str(model), load_format="dummy", device=args.device,
              dtype="bfloat16" if args.device == "cuda" else "float32",
              max_total_tokens=args.concurrency * (args.input_len + args.output_len + 64),
              max_running_requests=args.concurrency, chunked_prefill_size=16384,
              enable_prefix_cache=False)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 10000, (args.input_len,), generator=gen).tolist()
               for _ in range(args.num_requests)]  # fmt: skip
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    # Waves of `concurrency`, as the load runs go (equal requests start and end together): one
    # generate() of every request would admit more than the KV pool holds and retract.
    start, tokens = time.perf_counter(), 0
    for first in range(0, len(prompts), args.concurrency):
        outputs = llm.generate(prompts[first : first + args.concurrency], params)
        tokens += sum(len(o.token_ids) for o in outputs)
    seconds = time.perf_counter() - start
    figures.offline_tok_s = tokens / seconds
    log(f"offline engine: {figures.offline_tok_s:.1f} tok/s over {seconds:.1f} s")


def node_args(args: argparse.Namespace) -> list[str]:
    flags = ["--load-format", "dummy", "--device", args.device, "--disable-prefix-cache"]
    flags += ["--max-running-requests", str(args.concurrency), "--chunked-prefill-size", "16384"]
    if args.device == "cuda":
        flags += ["--dtype", "bfloat16", "--attention-backend", "triton", "--overlap-schedule"]
    return flags


def cluster_config(args: argparse.Namespace, model: Path) -> object:
    from gateway.process.cluster import build_config, build_parser

    tokens = args.concurrency * (args.input_len + args.output_len + 64)
    argv = ["--prefill", "0", "--decode", "1", "--model", str(model)]
    argv += ["--max-total-tokens", str(tokens), "--node-args", shlex.join(node_args(args))]
    argv += shlex.split(args.cluster_args)
    log(f"pd-cluster {shlex.join(argv)}")
    return build_config(build_parser().parse_args(argv))


def node_phase(args: argparse.Namespace, address: str, pid: int, metrics_url: str,
               figures: Figures) -> None:  # fmt: skip
    from scripts.serving.node_metrics import MetricsWatch
    from scripts.serving.procstat import CpuWatch, WatchSpec

    out = args.out / "node_direct.json"
    command = [sys.executable, "-m", "scripts.bench.node", "--target", address, "--skip-overhead"]
    command += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    command += ["--concurrency", str(args.concurrency), "--num-requests", str(args.num_requests)]
    command += ["--output-json", str(out)]
    log(f"node direct: {shlex.join(command)}")
    cpu, steps = (
        CpuWatch([WatchSpec("decode-0", pid=pid)]),
        MetricsWatch([("decode-0", metrics_url)]),
    )
    before = os.times()
    cpu.start(time.perf_counter())
    steps.start(time.perf_counter())
    done = subprocess.run(command, cwd=REPO_ROOT, timeout=args.phase_timeout)
    now = time.perf_counter()
    usage, split = cpu.stop(now), steps.stop(now)
    figures.node_client_cpu_s = os.times().children_user - before.children_user
    figures.node_client_cpu_s += os.times().children_system - before.children_system
    figures.node_cpu = [{"name": u.name, "cpu_s": u.cpu_s, "core": u.core_fraction} for u in usage]
    forward = split[0]
    figures.node_cpu.append({"name": "decode-0 forward time (/metrics, not CPU)",
                             "cpu_s": forward.delta.forward_s, "core": forward.forward_share,
                             "ms_per_step": forward.forward_ms_per_step})  # fmt: skip
    if done.returncode != 0 or not out.exists():
        figures.errors.append(f"scripts.bench.node exited {done.returncode}")
        return
    figures.node = json.loads(out.read_text())["levels"][0]


def served_phase(args: argparse.Namespace, url: str, watch: list[str], figures: Figures) -> None:
    base = [sys.executable, "-m", "scripts.serving.bench_serving", "--base-url", url]
    base += ["--no-progress", "--ignore-eos", "--random-input-len", str(args.input_len)]
    warm = [*base, "--random-output-len", "8", "--num-prompts", "8", "--seed", "1"]
    subprocess.run(warm, cwd=REPO_ROOT, capture_output=True, timeout=args.phase_timeout)
    out = args.out / "served.json"
    command = [*base, "--random-output-len", str(args.output_len), "--workers", str(args.workers)]
    command += ["--num-prompts", str(args.num_requests), "--max-concurrency", str(args.concurrency)]
    command += [*watch, "--output-file", str(out), "--timeout", str(args.phase_timeout)]
    log(f"served: {shlex.join(command)}")
    done = subprocess.run(command, cwd=REPO_ROOT, timeout=args.phase_timeout)
    if done.returncode != 0 or not out.exists():
        figures.errors.append(f"bench_serving exited {done.returncode}")
        return
    doc = json.loads(out.read_text())
    doc.pop("requests", None)  # megabytes of timestamps; the summary keeps the figures
    out.write_text(json.dumps(doc, indent=1))
    figures.served = doc


def cluster_phases(args: argparse.Namespace, model: Path, figures: Figures) -> None:
    from gateway.process.cluster import Cluster

    config = cluster_config(args, model)
    with (args.out / "cluster.log").open("w") as log_file:
        cluster = Cluster(config, out=log_file)  # type: ignore[arg-type]
        try:
            url = cluster.start(threading.Event())
            log(f"cluster ready at {url}")
            by_name = {c.name: c for c in cluster.children}
            decode, gateway = by_name["decode-0"], by_name["gateway"]
            node_phase(args, decode.address, decode.pid, decode.metrics_url, figures)
            # The gateway by its port: every process listening there (workers too) and their
            # children; the node by its pid.
            port = gateway.address.rsplit(":", 1)[1]
            watch = [f"--watch-port=gateway={port}", f"--watch-pid=decode-0={decode.pid}"]
            watch += [f"--watch-metrics=decode-0={decode.metrics_url}"]
            served_phase(args, url, watch, figures)
        except Exception as exc:  # the table still shows what was measured
            figures.errors.append(f"cluster: {type(exc).__name__}: {exc}")
        finally:
            cluster.stop()


# -- the table -----------------------------------------------------------------------------------


def _f(value: object, fmt: str = ".1f") -> str:
    return "-" if value is None else format(float(value), fmt)  # type: ignore[arg-type]


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


def throughput_rows(args: argparse.Namespace, figures: Figures) -> list[str]:
    on, off = figures.engine_ms.get("on"), figures.engine_ms.get("off")
    engine = args.concurrency / on * 1e3 if on else None
    node = figures.node
    served = figures.served["summary"] if figures.served else None  # type: ignore[index]
    node_tps = float(node["output_throughput"]) if node else None  # type: ignore[arg-type]
    served_tps = float(served["output_token_throughput"]) if served else None  # type: ignore[index]
    pct = lambda d, k: d[k] if d else None  # noqa: E731
    offline = figures.offline_tok_s
    rows = []
    if offline is not None:
        rows = [
            f"| offline engine (LLM.generate, whole run) tok/s | {_f(offline)} "
            f"| {_ratio(node_tps, offline)} of it | {_ratio(served_tps, offline)} of it |"
        ]
    return [
        "| figure | engine (engine_step) | node direct (gRPC) | served (gateway, HTTP) |",
        "|---|---|---|---|",
        *rows,
        f"| output tok/s | {_f(engine)} | {_f(node_tps)} | {_f(served_tps)} |",
        f"| / engine | 1 | {_ratio(node_tps, engine)} | {_ratio(served_tps, engine)} |",
        f"| / node direct | | 1 | {_ratio(served_tps, node_tps)} |",
        f"| TPOT p50 ms (engine: decode step, overlap on; off {_f(off, '.2f')}) | {_f(on, '.2f')} "
        f"| {_f(pct(node, 'tpot_p50_ms'), '.2f')} "
        f"| {_f(served['tpot_ms']['median'] if served else None, '.2f')} |",  # type: ignore[index]
        f"| ITL p50 ms | | {_f(node['itl_ms']['p50'] if node else None, '.2f')} "  # type: ignore[index]
        f"| {_f(served['itl_ms']['median'] if served else None, '.2f')} |",  # type: ignore[index]
        f"| TTFT p50 ms | | {_f(node['ttft_ms']['p50'] if node else None, '.0f')} "  # type: ignore[index]
        f"| {_f(served['ttft_ms']['median'] if served else None, '.0f')} |",  # type: ignore[index]
        f"| failed requests | | {node['failed'] if node else '-'} "  # type: ignore[index]
        f"| {served['failed'] if served else '-'} |",  # type: ignore[index]
    ]


def cpu_rows(figures: Figures) -> list[str]:
    rows = [
        "| run | process | CPU s | % of a core | CPU-us / streamed token |",
        "|---|---|---|---|---|",
    ]
    node = figures.node
    if node:
        tokens = float(node["output_throughput"]) * float(node["duration_s"])  # type: ignore[arg-type]
        wall = float(node["duration_s"])  # type: ignore[arg-type]
        client = figures.node_client_cpu_s
        rows.append(f"| node direct | client (scripts.bench.node, with its start-up) "
                    f"| {client:.1f} | {client / wall:.0%} "
                    f"| {client * 1e6 / tokens:.1f} |")  # fmt: skip
        for u in figures.node_cpu:
            cpu = float(u["cpu_s"])  # type: ignore[arg-type]
            rows.append(f"| node direct | {u['name']} | {cpu:.1f} | {float(u['core']):.0%} "  # type: ignore[arg-type]
                        f"| {cpu * 1e6 / tokens:.1f} |")  # fmt: skip
    if figures.served:
        tokens = float(figures.served["summary"]["output_tokens"])  # type: ignore[index]
        for u in figures.served["cpu"]:  # type: ignore[attr-defined]
            lag = u.get("loop_lag_p99_ms")
            late = "" if lag is None else f", event loop {lag:.0f} ms late (p99)"
            rows.append(f"| served | {u['name']} | {u['cpu_s']:.1f} | {u['core_fraction']:.0%}"
                        f"{late} | {u['cpu_s'] * 1e6 / tokens:.1f} |")  # fmt: skip
        for s in figures.served.get("node_steps", []):  # type: ignore[attr-defined]
            d = s["delta"]
            per_step = d["forward_s"] * 1e3 / d["steps"] if d["steps"] else 0.0
            rows.append(f"| served | {s['name']} forward time (/metrics, not CPU) "
                        f"| {d['forward_s']:.1f} "
                        f"| {d['forward_s'] / s['wall_s']:.0%} of wall, {per_step:.2f} ms/step, "
                        f"{d['decode_tokens'] / max(d['steps'], 1):.0f} tok/step "
                        f"| {d['forward_s'] * 1e6 / tokens:.1f} |")  # fmt: skip
    return rows


def report(args: argparse.Namespace, figures: Figures, shape: str) -> str:
    gpu = _gpu_name()
    lines = [
        f"# serve vs engine, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {gpu}",
        "",
        f"Shape {shape} (dummy weights), input {args.input_len}, output {args.output_len}, "
        f"concurrency {args.concurrency}, {args.num_requests} requests, client workers "
        f"{args.workers}, cluster args {args.cluster_args!r}.",
        "",
        *throughput_rows(args, figures),
        "",
        *cpu_rows(figures),
    ]
    if figures.errors:
        lines += ["", "Errors:", *(f"- {e}" for e in figures.errors)]
    return "\n".join(lines) + "\n"


def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    except ImportError:
        return "unknown device"


# -- command line --------------------------------------------------------------------------------


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    r = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    r.add_argument("--carry", type=Path, default=None, help="the folder `pack` filled")
    add_site_arg(r)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    r.add_argument("--input-len", type=int, default=16)
    r.add_argument("--output-len", type=int, default=512)
    r.add_argument("--concurrency", type=int, default=256)
    r.add_argument("--num-requests", type=int, default=768)
    r.add_argument("--workers", type=int, default=4, help="bench_serving client processes")
    r.add_argument("--cluster-args", default="", help="extra pd-cluster flags (quoted)")
    r.add_argument("--skip-engine", action="store_true", help="no engine_step (CPU dry run)")
    r.add_argument(
        "--offline",
        action="store_true",
        help="also LLM.generate over the same requests in this process (any device)",
    )
    r.add_argument("--phase-timeout", type=float, default=300.0, help="seconds per load run")
    r.add_argument("--engine-timeout", type=float, default=600.0, help="seconds for engine_step")
    return r


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prepare_host(args.carry, args.site)
    os.environ.setdefault("MC_FORCE_TCP", "1")  # Mooncake's CUDA build over TCP (check_pd.py)
    figures = Figures()
    if not args.skip_engine:
        engine_phase(args, figures)
    model = model_dir(args.shape)
    if args.offline:
        offline_phase(args, model, figures)
    cluster_phases(args, model, figures)
    table = report(args, figures, args.shape)
    print(table, flush=True)
    (args.out / "serve_vs_engine.md").write_text(table)
    (args.out / "figures.json").write_text(json.dumps(figures.__dict__, indent=1, default=str))
    return 1 if figures.errors else 0
