"""Cache-aware PD on GPUs: the conversation workload on 2P2D (one GPU a node) through gateways
routing `round_robin`, `kv_aware` (the default) and `prefix_aware` + `least_load`.

    # here, once: the engines' wheels and the gateway's (as scripts/gpu/two_gpu.py carries them)
    python -m scripts.gpu.mooncake_wheels pack out/pdcarry
    python -m scripts.gpu.serve_vs_engine pack out/svecarry
    # on a host with four GPUs (`nvidia-h100-x4`), one call:
    PYTHONUNBUFFERED=1 python3 -m scripts.gpu.cache_aware --carry out/pdcarry \\
        --wheels out/svecarry/wheels --out "$OUT"

One `pd-cluster --prefill 2 --decode 2 --devices cuda:0,...,cuda:3` serves a Llama-3-8B shape
(dummy bf16 weights, Triton attention, CUDA graphs, the prefix cache on, KV events on); its own
gateway routes `kv_aware`, and two more `gateway-server`s on the same bootstrap route
`round_robin` and `prefix_aware` + `least_load`, so the three policies see the same nodes. Each
workload runs once through each gateway with its own seed (its own system prompt and turns, so
that no run reuses what another computed): `scripts.serving.bench_serving --dataset
conversation` (N sessions x T turns, a shared system prompt, a think time between turns,
`--ignore-eos`).

The dummy weights write random token ids, and a follow-up turn sends them back as text; its
prompt only extends the conversation's cached KV if that text tokenizes back to the same ids.
So the model gets a word-level tokenizer (one id per word, words split on spaces) holding the
workload's words and a chat template of plain words: decode then encode is the identity.

Writes `cache_aware.md` (versions, the command, per workload and policy: duration, output
tokens/s, TTFT p50 of every turn and of follow-up turns, the hit rate beside the workload's best,
local prefills, and the ratios against `round_robin`), each run's bench_serving JSON and the
logs to `--out`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from scripts.gpu.environment import REPO_ROOT, gpu_defaults
from scripts.gpu.two_gpu import install, versions
from scripts.serving.datasets import WORDS
from scripts.tiny_models import LLAMA3_8B, SMALL_LLAMA, write_llama_config

PY = sys.executable
NODE_KV_TOKENS = 200_000  # 24 GiB of bf16 KV of the 8B shape beside 15 GiB of weights
ROLE_WORDS = ("system", "user", "assistant", ":", ";")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} ; {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
# label -> (prefill policy, decode policy, more gateway flags); kv_aware is the cluster's gateway
VARIANTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "round_robin": ("round_robin", "round_robin", ()),
    "kv_aware": ("kv_aware", "kv_aware", ()),
    "kv_aware local<=1024": ("kv_aware", "kv_aware", ("--local-prefill-max-tokens", "1024")),
    "kv_aware decode load 1": ("kv_aware", "kv_aware", ("--decode-kv-load-weight", "1")),
    "kv_aware decode load 0.1": ("kv_aware", "kv_aware", ("--decode-kv-load-weight", "0.1")),
    "prefix_aware": ("prefix_aware", "least_load", ()),
}
SEGMENTS = ("gateway_queue", "prefill_bootstrap_wait", "prefill_queue", "prefill", "transfer",
            "decode_queue", "decode_first")  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """One conversation workload: `sessions` x `turns`, a system prompt of `system` words, user
    turns of `input_len` words, replies of `output_len` tokens, `think_s` between turns."""

    name: str
    sessions: int
    turns: int
    system: int
    input_len: int
    output_len: int
    think_s: float

    @classmethod
    def parse(cls, spec: str) -> Workload:
        """`name:sessions:turns:system:input:output:think`."""
        name, *numbers = spec.split(":")
        s, t, sys_len, i, o = (int(x) for x in numbers[:5])
        return cls(name, s, t, sys_len, i, o, float(numbers[5]))


def log(msg: str) -> None:
    print(f"[cache_aware {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def word_vocab(vocab_size: int) -> dict[str, int]:
    """The workload's words and the template's, then `t<i>` fillers up to `vocab_size`."""
    words = list(dict.fromkeys((*ROLE_WORDS, *WORDS)))
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"t{i}": i for i in range(len(words), vocab_size)})
    return vocab


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(word_vocab(vocab_size), unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {"model_max_length": 1 << 20, "chat_template": CHAT_TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def model_dir(work: Path, device: str) -> Path:
    """The 8B shape on GPUs; a small llama for a smoke run on the CPU (`--device cpu`)."""
    config = LLAMA3_8B if device == "cuda" else SMALL_LLAMA
    path = work / ("llama-8b" if device == "cuda" else "llama-small")
    write_llama_config(path, config)
    write_tokenizer(path, int(config["vocab_size"]))  # type: ignore[call-overload]
    return path


# -- the cluster ---------------------------------------------------------------------------------


@dataclass
class Cluster:
    process: subprocess.Popen[str]
    urls: dict[str, str]  # policy label -> gateway URL
    extra: list[subprocess.Popen[str]]

    def stop(self) -> None:
        for p in self.extra:
            p.terminate()
        self.process.send_signal(2)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        for p in self.extra:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def console_script(name: str) -> str:
    from gateway.process.launcher import console_script as installed  # after install(): grpcio

    return installed(name)


def free_port() -> int:
    from engine.ports import free_port as port

    return port()


def start_cluster(args: argparse.Namespace, model: Path, work: Path) -> Cluster:
    if args.device == "cuda":
        node_args = ["--device", "cuda", "--dtype", "bfloat16", "--load-format", "dummy",
                     "--attention-backend", "triton", "--max-running-requests", "128"]  # fmt: skip
        placement = ["--devices", "cuda:0,cuda:1,cuda:2,cuda:3"]
        kv_tokens = NODE_KV_TOKENS
    else:  # a smoke run of this script on the CPU
        node_args, placement, kv_tokens = ["--device", "cpu", "--load-format", "dummy"], [], 16384
    port = free_port()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    command = [console_script("pd-cluster"), "--prefill", "2", "--decode", "2", *placement,
               "--model", str(model),
               "--transfer-backend", args.backend, "--max-total-tokens", str(kv_tokens),
               "--node-args", shlex.join(node_args), "--port", str(port),
               "--log-dir", str(logs)]  # fmt: skip
    log(shlex.join(command))
    out = open(work / "cluster.out", "w")  # noqa: SIM115 - the cluster's whole life
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                               text=True)  # fmt: skip
    deadline = time.monotonic() + args.ready_timeout
    text = ""
    while time.monotonic() < deadline:
        text = (work / "cluster.out").read_text()
        if "ready:" in text or process.poll() is not None:
            break
        time.sleep(1.0)
    if "ready:" not in text:
        process.kill()
        raise RuntimeError("pd-cluster did not get ready:\n" + text[-3000:])
    bootstrap = next(
        line.split("--bootstrap ")[1].split()[0]
        for line in text.splitlines()
        if "starting gateway" in line and "--bootstrap " in line
    )
    urls = {"kv_aware": f"http://127.0.0.1:{port}"}
    extra = []
    for label in args.policies:
        prefill, decode, flags = VARIANTS[label]
        if label == "kv_aware":
            continue
        gport = free_port()
        gcommand = [console_script("gateway-server"), "--bootstrap", bootstrap,
                    "--model", str(model),
                    "--prefill-policy", prefill, "--decode-policy", decode,
                    "--host", "127.0.0.1", "--port", str(gport), *flags]  # fmt: skip
        log(shlex.join(gcommand))
        glog = open(logs / f"gateway-{label.split()[0]}-{gport}.log", "w")  # noqa: SIM115
        extra.append(subprocess.Popen(gcommand, cwd=REPO_ROOT, stdout=glog,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
        urls[label] = f"http://127.0.0.1:{gport}"
    for label, url in urls.items():
        wait_ready(url, args.ready_timeout, label)
    return Cluster(process, urls, extra)


def wait_ready(url: str, timeout_s: float, label: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the {label} gateway at {url} is not healthy after {timeout_s:.0f} s")


def metric_total(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


# -- the runs ------------------------------------------------------------------------------------


def run_one(url: str, w: Workload, seed: int, out: Path) -> dict[str, object]:
    local_before = metric_total(url, "pdserve_gateway_local_prefills_total")
    command = [PY, "-m", "scripts.serving.bench_serving", "--base-url", url,
               "--dataset", "conversation", "--num-prompts", str(w.sessions),
               "--multiturn-turns", str(w.turns), "--conversation-system-len", str(w.system),
               "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len),
               "--think-time", str(w.think_s), "--ignore-eos", "--seed", str(seed),
               "--no-progress", "--output-file", str(out)]  # fmt: skip
    log(shlex.join(command))
    done = subprocess.run(command, cwd=REPO_ROOT, text=True, capture_output=True, timeout=600)
    print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench_serving failed ({done.returncode}): {done.stderr[-2000:]}")
    doc = json.loads(out.read_text())
    row = summarize(doc)
    row["local_prefills"] = metric_total(url, "pdserve_gateway_local_prefills_total") - local_before
    row["turn_table"] = done.stdout[done.stdout.find("| turn |") :].split("\n\n")[0]
    return row


def summarize(doc: dict) -> dict[str, object]:  # type: ignore[type-arg]
    s = doc["summary"]
    ok = [r for r in doc["requests"] if r["chunks"] and not r["error"]]
    ttft = [(r["chunks"][0] - r["sent"]) * 1000 for r in ok]
    later = [(r["chunks"][0] - r["sent"]) * 1000 for r in ok if r["turn"] > 0]
    segments = {
        name: statistics.fmean(r["timing_ms"].get(name, 0.0) for r in ok if r["turn"] > 0)
        for name in SEGMENTS
        if any(r["turn"] > 0 and "timing_ms" in r for r in ok)
    }
    return {
        "segments_ms": segments,
        "duration_s": s["duration_s"],
        "completed": s["completed"],
        "failed": s["failed"],
        "output_tok_s": s["output_token_throughput"],
        "ttft_p50_ms": statistics.median(ttft) if ttft else float("nan"),
        "later_ttft_p50_ms": statistics.median(later) if later else float("nan"),
        "hit_rate": doc["cache"]["hit_rate"],
        "best_rate": doc["cache"]["best_rate"],
    }


def table(
    results: dict[str, dict[str, dict[str, object]]], workloads: list[Workload], policies: list[str]
) -> str:
    lines = []
    for w in workloads:
        rows = results.get(w.name, {})
        base = rows.get("round_robin")
        lines += [
            f"### {w.name}: {w.sessions} sessions x {w.turns} turns, system {w.system}, "
            f"user {w.input_len}, output {w.output_len}, think {w.think_s:g} s\n",
            "| policy | s | done / failed | output tok/s | TTFT p50 ms | follow-up TTFT p50 ms "
            "| hit / best | local prefills | TTFT p50 vs round_robin | tok/s vs round_robin |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label in policies:
            r = rows.get(label)
            if r is None:
                lines.append(f"| {label} | not run | | | | | | | | |")
                continue
            ratio_ttft = ratio_tps = ""
            if base is not None:
                ratio_ttft = f"{float(base['ttft_p50_ms']) / float(r['ttft_p50_ms']):.2f}x lower"  # type: ignore[arg-type]
                ratio_tps = f"{float(r['output_tok_s']) / float(base['output_tok_s']):.2f}x"  # type: ignore[arg-type]
            lines.append(
                f"| {label} | {r['duration_s']:.1f} | {r['completed']} / {r['failed']} "
                f"| {r['output_tok_s']:.0f} | {r['ttft_p50_ms']:.1f} "
                f"| {r['later_ttft_p50_ms']:.1f} "
                f"| {r['hit_rate']:.1%} / {r['best_rate']:.1%} | {r['local_prefills']:.0f} "
                f"| {ratio_ttft} | {ratio_tps} |"
            )
        lines += ["", "Follow-up turns, mean ms per segment (the server's Server-Timing):", "",
                  "| policy | " + " | ".join(SEGMENTS) + " |",
                  "|---|" + "---|" * len(SEGMENTS)]  # fmt: skip
        for label in policies:
            seg: dict[str, float] = rows.get(label, {}).get("segments_ms") or {}  # type: ignore[assignment]
            if seg:
                cells = " | ".join(f"{seg.get(n, 0.0):.1f}" for n in SEGMENTS)
                lines.append(f"| {label} | {cells} |")
        lines.append("")
        for label in policies:
            if label in rows:
                lines += [f"{label}, per turn:\n", str(rows[label]["turn_table"]), ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--carry", type=Path, help="scripts.gpu.mooncake_wheels pack folder")
    parser.add_argument("--wheels", type=Path, help="grpcio and the gateway's wheels")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", default="nixl", choices=["nixl", "mooncake"])
    parser.add_argument("--ready-timeout", type=float, default=240.0)
    parser.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run"
    )
    parser.add_argument(
        "--workloads",
        default="goal:16:6:1024:128:128:0.5,loaded:64:6:2048:256:128:0.5",
        help="name:sessions:turns:system:input:output:think, comma-separated",
    )
    parser.add_argument(
        "--policies",
        type=lambda text: text.split(","),
        default=["round_robin", "kv_aware", "kv_aware local<=1024", "prefix_aware"],
        help=f"comma-separated, round_robin and kv_aware always among them: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each workload a policy")
    args = parser.parse_args()
    unknown = set(args.policies) - set(VARIANTS)
    if unknown or not {"round_robin", "kv_aware"} <= set(args.policies):
        parser.error(f"--policies: unknown {sorted(unknown)} or round_robin/kv_aware missing")
    started = time.monotonic()
    if args.device == "cuda":
        gpu_defaults()
        install(args)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cache_aware-"))
    info = versions() if args.device == "cuda" else {"device": "cpu (smoke run)"}
    log(json.dumps(info))
    workloads = [Workload.parse(s) for s in args.workloads.split(",")]
    (work / "runs").mkdir()
    results: dict[str, dict[str, dict[str, object]]] = {}
    sections = ["# Cache-aware PD on GPUs: 2P2D, conversation workload\n",
                *(f"- {k}: {v}" for k, v in info.items()),
                f"- command: `{shlex.join(sys.argv)}`\n"]  # fmt: skip
    cluster = None
    try:
        cluster = start_cluster(args, model_dir(work, args.device), work)
        warm = Workload("warmup", 16, 3, 512, 256, 32, 0.0)
        for label in ("round_robin", "kv_aware"):  # Triton compiles its shapes
            run_one(cluster.urls[label], warm, 1000 + len(label), work / f"warmup-{label}.json")
        seed = 1
        runs = [w if args.repeats == 1 else replace(w, name=f"{w.name}#{r + 1}")
                for w in workloads for r in range(args.repeats)]  # fmt: skip
        for w in runs:
            for label in args.policies:
                seed += 1  # every run its own conversations: nothing cached from another
                path = work / "runs" / f"{w.name}-{label.split()[0]}-{seed}.json"
                row = run_one(cluster.urls[label], w, seed, path)
                results.setdefault(w.name, {})[label] = row
                figures = {k: v for k, v in row.items() if k != "turn_table"}
                log(f"{w.name} {label}: {json.dumps(figures)}")
        sections.append(table(results, runs, args.policies))
    except Exception as exc:  # the report says what failed
        sections.append(f"FAILED: {exc!r}\n")
        if results:
            sections.append(json.dumps(results, default=str, indent=1))
    finally:
        if cluster is not None:
            cluster.stop()
        sections.append(f"Whole call: {time.monotonic() - started:.0f} s\n")
        (args.out / "cache_aware.md").write_text("\n".join(sections))
        (args.out / "cache_aware.json").write_text(json.dumps(results, default=str, indent=1))
        with tarfile.open(args.out / "logs.tar.gz", "w:gz") as tar:
            for path in [*work.rglob("*.log"), *work.rglob("cluster.out"), *work.rglob("*.json")]:
                tar.add(path, arcname=str(path.relative_to(work)))
    print("\n".join(sections), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
