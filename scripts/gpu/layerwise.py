"""Layer-wise KV streaming on one GPU: TTFT and the exposed KV transfer of a 1P1D pd-cluster (two
processes on one GPU) with `--kv-stream-layers 0` (the per-chunk push) against G layer groups.

    # on the GPU host, one call (the folder of `serve_vs_engine pack`: wheels/, mooncake/):
    PYTHONUNBUFFERED=1 python3 -m scripts.gpu.layerwise --carry out/final3 --out "$OUT"
    # a smoke run of this script on the CPU, with a tiny llama and a word tokenizer:
    python -m scripts.gpu.layerwise --make-tiny-model /tmp/lw-model
    python -m scripts.gpu.layerwise --device cpu --model /tmp/lw-model --lengths 128,512 \\
        --groups 0,2,4 --requests 3 --warmup 1 --chunk 512 --out /tmp/lw

Per transfer backend (`cuda_ipc` always; `nixl` as well when its package imports after the
install): one `pd-cluster --prefill 1 --decode 1` (gateway/process/cluster.py) with both nodes on
cuda:0, the Llama-3-8B shape with dummy bf16 weights (scripts/tiny_models.py, the word
tokenizer of scripts/gpu/serve_vs_engine.py), Triton attention, prefix caches off, every prompt
prefilled by the prefill node (`--local-prefill-max-tokens 0` on the gateway), chunks of
`--chunk` tokens (default 8192: each prompt is one chunk, the per-chunk push's worst case).
It starts with the first of `--groups`; for each other G only the prefill node is stopped and
started again with `--kv-stream-layers G` (bootstrap, decode node and gateway stay).

Per (backend, G, prompt length): `--warmup` requests, then `--requests` sequential streamed
`/generate` requests of distinct random prompts, `--output-len` greedy tokens each. Figures:
- TTFT: the client's time from sending the request to the first token event;
- exposed transfer: the timeline's `transfer_kv` (gateway/dispatch/timeline.py): on the prefill
  node, from the first token sampled (the end of the prompt's last forward) to every KV write
  confirmed; `transfer` beside it is what the decode node waited beyond P's spans (the DONE hop
  through bootstrap included);
- hidden = 1 - exposed(G) / exposed(0), on the medians.
Correctness gate in the same call: every request's greedy tokens under G equal the same prompt's
under G=0 (the dummy weights are seeded, so each prefill start has the same weights, and the
decode node reads the streamed KV for every token after the first); a row that differs says
FAIL and the script exits 1.

Writes `layerwise.md` (versions, the command, the table) and `samples.json` (every request's
figures) to `--out`, and the cluster's logs under `--out/logs-<backend>`.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.gpu.environment import add_site_arg
from scripts.gpu.serve_vs_engine import prepare_host, word_tokenizer

START = time.monotonic()


def log(msg: str) -> None:
    print(f"[layerwise {time.monotonic() - START:6.1f}s] {msg}", flush=True)


@dataclass
class Sample:
    ttft_s: float
    tokens: list[int]
    timing: dict[str, float]


@dataclass
class Run:
    """One (backend, G, prompt length): its measured requests."""

    backend: str
    groups: int
    length: int
    samples: list[Sample] = field(default_factory=list)
    error: str = ""

    def p50(self, key: str) -> float | None:
        values = [s.ttft_s if key == "ttft" else s.timing.get(key) for s in self.samples]
        found = [v for v in values if v is not None]
        return statistics.median(found) if found else None

    def best(self, key: str) -> float | None:
        values = [s.ttft_s if key == "ttft" else s.timing.get(key, 0.0) for s in self.samples]
        return min(values) if values else None


# -- the model and the prompts -------------------------------------------------------------------


def make_tiny_model(path: Path) -> Path:
    """A 6-layer llama of SMALL_LLAMA's widths (dummy weights) with a word tokenizer: the
    `--device cpu` smoke run's model."""
    from scripts.tiny_models import llama_config, write_llama_config

    config = llama_config(num_hidden_layers=6, vocab_size=4096, max_position_embeddings=4096)
    write_llama_config(path, config)
    word_tokenizer(path, 4096)
    return path


def eight_b_model() -> Path:
    """The Llama-3-8B shape with 16k positions (an 8,192-token prompt plus its output needs
    more than LLAMA3_8B's 8,192) and a word tokenizer of its vocabulary."""
    from scripts.tiny_models import LLAMA3_8B, write_llama_config

    path = Path(tempfile.mkdtemp(prefix="layerwise-model-")) / "llama-8b"
    write_llama_config(path, {**LLAMA3_8B, "max_position_embeddings": 16384})
    word_tokenizer(path, int(LLAMA3_8B["vocab_size"]))  # type: ignore[call-overload]
    return path


def prompts(vocab: int, length: int, count: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed * 100_003 + length)
    return [[rng.randrange(100, vocab - 1) for _ in range(length)] for _ in range(count)]


# -- one request -----------------------------------------------------------------------------


def generate(address: str, ids: list[int], output_len: int, timeout_s: float) -> Sample:
    """A streamed native `/generate`: TTFT at the first token event, the timeline at the end."""
    host, port = address.removeprefix("http://").rsplit(":", 1)
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
    }
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    sent = time.perf_counter()
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"/generate answered {response.status}: {response.read()[:500]!r}")
    ttft, tokens, timing = None, [], {}
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if "error" in event:
            raise RuntimeError(f"stream error: {event}")
        if event.get("output_ids"):
            ttft = ttft if ttft is not None else time.perf_counter() - sent
            tokens += event["output_ids"]
        timing = event.get("meta_info", {}).get("timing") or timing
    conn.close()
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    return Sample(ttft, tokens, timing)


# -- the cluster ------------------------------------------------------------------------------


def node_args(args: argparse.Namespace) -> list[str]:
    flags = ["--load-format", "dummy", "--disable-prefix-cache", "--max-running-requests", "8"]
    flags += ["--chunked-prefill-size", str(args.chunk)]
    if args.device == "cuda":
        flags += ["--dtype", "bfloat16", "--attention-backend", "triton"]
    else:
        flags += ["--device", "cpu"]
    return flags


def health(url: str) -> dict[str, object]:
    """The gateway's /health body (its node counts), also when it answers 503."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        try:
            return dict(json.loads(exc.read()))
        except ValueError:
            return {}
    except (OSError, ValueError):
        return {}


def wait_prefill_nodes(url: str, count: int, timeout_s: float, child: object = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if health(url).get("prefill") == count:
            return
        if child is not None and not getattr(child, "alive", True):
            raise RuntimeError("the prefill node exited while starting (see its log)")
        time.sleep(0.5)
    raise RuntimeError(f"the gateway did not see {count} prefill node(s) in {timeout_s:.0f} s")


def measure(args: argparse.Namespace, url: str, run: Run, vocab: int) -> None:
    warm = prompts(vocab, run.length, args.warmup, seed=1)
    timed = prompts(vocab, run.length, args.requests, seed=2)
    for ids in warm:
        generate(url, ids, args.output_len, args.request_timeout)
    for ids in timed:
        run.samples.append(generate(url, ids, args.output_len, args.request_timeout))
    ttft, kv = run.p50("ttft"), run.p50("transfer_kv")
    log(f"{run.backend} G={run.groups} {run.length} tokens: TTFT p50 {ttft * 1e3:.1f} ms, "
        f"exposed transfer p50 {(kv or 0) * 1e3:.2f} ms")  # fmt: skip


def backend_runs(args: argparse.Namespace, backend: str, model: Path, vocab: int) -> list[Run]:
    from gateway.process.cluster import Cluster, build_config, build_parser

    first = args.groups[0]
    argv = ["--prefill", "1", "--decode", "1", "--model", str(model)]
    argv += ["--transfer-backend", backend, "--max-total-tokens", str(args.kv_tokens)]
    argv += ["--node-args", shlex.join(node_args(args)), "--kv-stream-layers", str(first)]
    argv += ["--ready-timeout", str(args.ready_timeout)]
    argv += ["--gateway-args", "--local-prefill-max-tokens 0"]  # every prompt through P
    logs = args.out / f"logs-{backend}"
    logs.mkdir(parents=True, exist_ok=True)
    argv += ["--log-dir", str(logs)]
    if args.device == "cuda":
        argv += ["--devices", "cuda:0,cuda:0"]  # both nodes on one GPU
    log(f"pd-cluster {shlex.join(argv)}")
    runs: list[Run] = []
    with (args.out / f"cluster-{backend}.log").open("w") as out:
        cluster = Cluster(build_config(build_parser().parse_args(argv)), out=out)
        try:
            url = cluster.start(threading.Event())
            log(f"{backend}: cluster ready at {url}")
            for index, groups in enumerate(args.groups):
                if index:
                    left = args.time_budget - (time.monotonic() - START)
                    if left < args.restart_reserve:
                        note = f"skipped: {left:.0f} s of --time-budget left"
                        runs += [Run(backend, groups, n, error=note) for n in args.lengths]
                        continue
                    cluster.remove_node("prefill")
                    wait_prefill_nodes(url, 0, 60)
                    child = cluster.add_node("prefill", ["--kv-stream-layers", str(groups)])
                    wait_prefill_nodes(url, 1, args.ready_timeout, child)
                    log(f"{backend}: prefill node restarted with --kv-stream-layers {groups}")
                for length in args.lengths:
                    run = Run(backend, groups, length)
                    runs.append(run)
                    try:
                        measure(args, url, run, vocab)
                    except (OSError, RuntimeError) as exc:
                        run.error = f"{type(exc).__name__}: {exc}"
                        log(f"{backend} G={groups} {length}: {run.error}")
        except Exception as exc:  # the table still shows what was measured
            note = f"cluster: {type(exc).__name__}: {exc}"
            log(note)
            runs.append(Run(backend, -1, 0, error=note))
        finally:
            cluster.stop()
    return runs


# -- the report ------------------------------------------------------------------------------


def _ms(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value * 1e3, fmt)


def gate(runs: list[Run]) -> dict[int, str]:
    """id(run) -> PASS / FAIL / `-`: its tokens against the G=0 run of the same backend and
    length (same prompts in the same order)."""
    verdicts: dict[int, str] = {}
    for run in runs:
        base = next(
            (r for r in runs if (r.backend, r.length, r.groups) == (run.backend, run.length, 0)),
            None,
        )
        if base is None or not run.samples or len(base.samples) != len(run.samples):
            verdicts[id(run)] = "-"
            continue
        same = all(a.tokens == b.tokens for a, b in zip(base.samples, run.samples, strict=True))
        verdicts[id(run)] = "PASS" if same else "FAIL"
    return verdicts


def table(runs: list[Run]) -> list[str]:
    verdicts = gate(runs)
    lines = [
        "| backend | prompt | G | TTFT p50 ms | TTFT best ms | exposed transfer p50 ms "
        "| hidden | D's transfer wait p50 ms | prefill p50 ms | n | tokens == G=0 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        if run.error and not run.samples:
            lines.append(f"| {run.backend} | {run.length} | {run.groups} | {run.error} |")
            continue
        base = next(
            (r for r in runs if (r.backend, r.length, r.groups) == (run.backend, run.length, 0)),
            None,
        )
        exposed, exposed0 = run.p50("transfer_kv"), base.p50("transfer_kv") if base else None
        hidden = "-"
        if run.groups and exposed is not None and exposed0:
            hidden = f"{1 - exposed / exposed0:.0%}"
        lines.append(
            f"| {run.backend} | {run.length} | {run.groups} | {_ms(run.p50('ttft'))} "
            f"| {_ms(run.best('ttft'))} | {_ms(exposed, '.2f')} | {hidden} "
            f"| {_ms(run.p50('transfer'), '.2f')} | {_ms(run.p50('prefill'))} "
            f"| {len(run.samples)} | {verdicts[id(run)]} |"
        )
    return lines


def versions(device: str) -> list[str]:
    import importlib.metadata as md

    import torch

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    found = [f"date (UTC) {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}", f"device {gpu}"]
    found.append(f"torch {torch.__version__}")
    for name in ("triton", "nixl", "nixl-cu13", "grpcio"):
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            continue
    return found


def report(args: argparse.Namespace, runs: list[Run], model: Path) -> str:
    lines = [
        "# Layer-wise KV streaming, 1P1D on one device",
        "",
        ", ".join(versions(args.device)) + ".",
        "",
        f"Model {model.name} (dummy weights), prompts {args.lengths}, output {args.output_len} "
        f"greedy tokens, {args.requests} sequential requests per row after {args.warmup} "
        f"warm-up, chunks of {args.chunk} tokens, prefix caches off.",
        "",
        "    python -m scripts.gpu.layerwise " + shlex.join(sys.argv[1:]),
        "",
        *table(runs),
        "",
        "Exposed transfer: the prefill node's first token sampled -> every KV write confirmed "
        "(timeline `transfer_kv`); hidden = 1 - exposed(G) / exposed(0) on the medians.",
    ]
    return "\n".join(lines) + "\n"


# -- command line ----------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--carry", type=Path, default=None, help="serve_vs_engine pack's folder")
    add_site_arg(parser)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", type=Path, default=None, help="default: the 8B shape")
    parser.add_argument(
        "--make-tiny-model", type=Path, default=None, metavar="DIR", help="write it and exit"
    )
    parser.add_argument("--backends", default="cuda_ipc,nixl", help="nixl only if it imports")
    parser.add_argument("--lengths", type=_ints, default=[2048, 8192])
    parser.add_argument("--groups", type=_ints, default=[0, 4, 8], help="the first must be 0")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=8192, help="--chunked-prefill-size")
    parser.add_argument("--kv-tokens", type=int, default=32768, help="KV tokens per node")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument(
        "--time-budget",
        type=float,
        default=420.0,
        help="seconds for the whole call: a prefill restart or a backend that would start "
        "with less than --restart-reserve left is skipped (said in the table)",
    )
    parser.add_argument("--restart-reserve", type=float, default=90.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.make_tiny_model is not None:
        print(make_tiny_model(args.make_tiny_model))
        return 0
    if args.out is None or args.groups[:1] != [0]:
        print("--out is required and --groups must start with 0 (the baseline)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    prepare_host(args.carry, args.site)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # NIXL over UCX between local processes
    model = args.model if args.model is not None else eight_b_model()
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    wanted = [b for b in args.backends.split(",") if b]
    runs: list[Run] = []
    for i, backend in enumerate(wanted):
        if backend == "nixl" and importlib.util.find_spec("nixl") is None:
            log("nixl does not import here (no wheels carried): skipped")
            continue
        left = args.time_budget - (time.monotonic() - START)
        if i and left < 2 * args.restart_reserve:
            runs.append(Run(backend, -1, 0, error=f"skipped: {left:.0f} s of budget left"))
            continue
        runs += backend_runs(args, backend, model, vocab)
    text = report(args, runs, model)
    print(text, flush=True)
    (args.out / "layerwise.md").write_text(text)
    samples = [{**asdict(r), "p50_ttft_s": r.p50("ttft")} for r in runs]
    (args.out / "samples.json").write_text(json.dumps(samples, indent=1))
    failed = any(v == "FAIL" for v in gate(runs).values()) or any(r.error for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
