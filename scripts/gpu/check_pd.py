"""Prefill/decode disaggregation on one GPU: greedy output through P->D equals a colocated
decode node, token for token, and neither node keeps a page afterwards.

    python3 -m scripts.gpu wheels mooncake pack .mooncake/carry         # here, once
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform any \
        -d .mooncake/pdwheels grpcio==1.85.1 protobuf==7.36.2              # here, once
    # on the GPU host (the device call carries both folders):
    python3 -m scripts.gpu pd --carry .mooncake/carry --wheels .mooncake/pdwheels \
        --out "$OUT"

A bootstrap-server, a prefill-server and a decode-server run as real processes on 127.0.0.1
(gateway/process/launcher.py starts them exactly as an operator would), both nodes on the same GPU
(`--device cuda`, KV pool in GPU memory, Triton attention, the default overlap scheduling) with
a small fp32 dummy-weight Llama, so a difference is a bug and not rounding. Each transfer
backend gets its own trio: NIXL (UCX: cuda_ipc between the two processes) and Mooncake (its CUDA
build over TCP, `MC_FORCE_TCP`, which stages GPU memory through host buffers; "nvlink_intra"
cannot register the nodes' CPU aux slots); `--backends cuda_ipc` runs one more, both nodes on
the CUDA IPC backend (kvtransfer/cuda_ipc.py, not in the default set). Prompts of 5..900
tokens (some longer than the 256-token chunked-prefill size of both nodes) go greedily
through P->D with a room each, over gRPC without a gateway (gateway/dispatch/pd_client.py), once one
at a time and once all together; the reference is the same decode node prefilling itself
(requests without a room), one at a time. Afterwards both nodes must be idle with no page
in use (CheckIntegrity).

The GPU image has grpcio and protobuf, but older than the committed stubs need, so the run
carries grpcio 1.85.1 and protobuf 7.36.2 wheels beside the NIXL / Mooncake ones
(scripts/gpu/mooncake_wheels.py); `--carry`/`--wheels` unpack them into `--site DIR`
(scripts/gpu/environment.py), which the node processes get first on their PYTHONPATH. Also
callable from run_all.py (`pd_checks`).
`--device cpu` runs the same flow on the CPU (torch-native attention), for a dry run here.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.gpu import mooncake_wheels
from scripts.gpu.environment import (
    REPO_ROOT,
    add_site_arg,
    console_wrappers,
    site_dir,
    unpack_wheels,
    use_site,
)
from scripts.tiny_models import SMALL_LLAMA, write_llama_config

LENGTHS = (5, 37, 128, 255, 256, 300, 513, 900)  # chunked-prefill size 256: the last 3 chunk
MAX_NEW = 24
CHUNK = 256
MODEL = SMALL_LLAMA
# The decode node reuses its prefix cache for P->D requests (P then sends only the rest) and
# would cache what P sent: without it every P->D request moves its whole prompt and the
# colocated reference is computed by the decode node itself. The prefill node keeps its cache
# (the second P->D pass hits it).
DECODE_ARGS = ["--disable-prefix-cache"]
# Backend -> environment of its trio (children inherit the rest of this process's environment).
BACKENDS: dict[str, dict[str, str]] = {
    "nixl": {},
    "mooncake": {"MC_FORCE_TCP": "1"},
    "cuda_ipc": {},  # GPU only; run on request (`--backends cuda_ipc`)
}
DEFAULT_BACKENDS = ["nixl", "mooncake"]  # this script's and run_all.py's PD trios


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    error: float = 0.0  # fraction of requests that differ (run_all's error column)


@dataclass
class Result:
    checks: list[Check] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def install(carry: Path | None, wheels: Path | None, site: Path | None) -> None:
    """Unpack the carried wheels into `site` and put it first on this process's and the nodes'
    import path (before anything imports grpc or the stubs)."""
    if carry is None and wheels is None:
        use_site(None)
        return
    site = site_dir(site)
    env = mooncake_wheels.install(carry, site) if carry is not None else {}
    if wheels is not None:
        unpack_wheels(wheels, site)
    use_site(site, env)


def versions() -> dict[str, str]:
    import importlib.metadata as md

    import torch

    found = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "CUDA (torch)": str(torch.version.cuda),
        "GPU": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }
    for name in ("grpcio", "protobuf", "nixl", "nixl-cu13", "mooncake-transfer-engine-cuda13",
                 "mooncake-transfer-engine-non-cuda", "triton"):  # fmt: skip
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = "not installed"
    return found


def prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, MODEL["vocab_size"], (n,), generator=gen).tolist() for n in LENGTHS]


@contextmanager
def trio(workdir: Path, backend: str, device: str, extra: Sequence[str] = ()) -> Iterator[Any]:
    """gateway/process/launcher.py's PD trio on this host (`extra`: more flags for both nodes)."""
    from gateway.process.launcher import pd_trio

    bins = console_wrappers(workdir / "bin")
    env = {"UCX_NET_DEVICES": "lo", "MC_LOG_LEVEL": "ERROR", **BACKENDS[backend]}
    model = workdir / "model"
    model.mkdir(parents=True, exist_ok=True)
    write_llama_config(model, MODEL)
    backend_args = ["--attention-backend", "triton"] if device.startswith("cuda") else []
    node_args = ["--load-format", "dummy", "--dtype", "float32",
                 "--device", device, "--page-size", "16", "--max-total-tokens", "16384",
                 "--chunked-prefill-size", str(CHUNK), "--max-running-requests", "16",
                 *backend_args, *extra]  # fmt: skip
    with pd_trio(workdir / backend, model, backend, node_args, decode_args=DECODE_ARGS, env=env,
                 ready_timeout=300, scripts=bins) as t:  # fmt: skip
        yield t


async def _generate(t: Any, batch: list[list[int]], pd: bool, together: bool) -> list[Any]:
    from proto import node_pb2

    sampling = node_pb2.SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    if together:
        return list(await asyncio.gather(*(t.generate_async(p, sampling, through_prefill=pd)
                                           for p in batch)))  # fmt: skip
    return [await t.generate_async(p, sampling, through_prefill=pd) for p in batch]


def _compare(name: str, got: list[Any], ref: list[list[int]], pd: bool) -> Check:
    bad = []
    for i, (r, want) in enumerate(zip(got, ref, strict=True)):
        finished = r.finished is not None and r.finished.finish_reason == "length"
        sent = not pd or (r.prefill is not None and r.prefill.sent_pages > 0)
        if not (finished and sent and r.token_ids == want):
            first = next(
                (k for k, (a, b) in enumerate(zip(r.token_ids, want, strict=False)) if a != b), None
            )
            why = r.prefill_error or (r.finished.detail if r.finished else "no Finished")
            bad.append(f"#{i} ({LENGTHS[i]} tokens): first difference at {first}, "
                       f"{len(r.token_ids)} tokens; {why or 'finished'}")  # fmt: skip
    detail = f"requests identical: {len(ref) - len(bad)}/{len(ref)}"
    if pd:
        descs = [f"{r.prefill.sent_pages}/{r.prefill.descriptors}" for r in got if r.prefill]
        detail += f"; pages/descriptors sent: {' '.join(descs)}; {page_id_use(got)}"
    if bad:
        detail += "; " + "; ".join(bad)
    return Check(name, not bad, detail, len(bad) / len(ref))


def page_id_use(got: list[Any]) -> str:
    """Whether the prefill node wrote KV by page ids (the engine's `write_pages`, which
    cuda_ipc plans without a range per page) or by ranges: per request, from its reply."""
    replies = [r.prefill for r in got if r.prefill is not None]
    by_ids = sum(p.page_id_writes > 0 for p in replies)
    writes = sum(p.page_id_writes for p in replies)
    used = "yes" if by_ids == len(replies) and replies else "NO" if not by_ids else "partly"
    return (f"write_pages used: {used} ({by_ids}/{len(replies)} requests, {writes} "
            "page-id writes)")  # fmt: skip


def check_backend(
    workdir: Path, backend: str, device: str, extra: Sequence[str] = (), label: str = ""
) -> list[Check]:
    """`extra` flags for both nodes; `label` follows the backend in every check's name."""
    batch = prompts()
    checks = []
    t0 = time.perf_counter()
    with trio(workdir, backend, device, extra) as t:
        started = time.perf_counter() - t0
        log(f"{backend}: trio ready in {started:.1f} s")
        tag = backend + label  # in every check name
        ref = [r.token_ids for r in asyncio.run(_generate(t, batch, pd=False, together=False))]
        colo_ok = all(len(r) == MAX_NEW for r in ref)
        checks.append(Check(f"{tag}: colocated decode node answers every prompt", colo_ok,
                            f"{sum(len(r) == MAX_NEW for r in ref)}/{len(ref)} with "
                            f"{MAX_NEW} tokens"))  # fmt: skip
        desc = f"{len(batch)} prompts of {min(LENGTHS)}..{max(LENGTHS)} tokens, {MAX_NEW} new"
        for together in (False, True):
            t1 = time.perf_counter()
            got = asyncio.run(_generate(t, batch, pd=True, together=together))
            how = "all together" if together else "one at a time"
            check = _compare(f"{tag}: PD greedy == colocated, {desc}, {how}", got, ref, True)
            check.detail += f"; {time.perf_counter() - t1:.2f} s"
            checks.append(check)
            log(f"{check.name}: {'PASS' if check.ok else 'FAIL'} ({check.detail})")
        for node in ("prefill", "decode"):
            try:
                report = getattr(t, node).wait_idle(timeout=60)
                ok = bool(report.ok) and report.used_pages == 0
                detail = f"used pages {report.used_pages}; {report.error or 'integrity ok'}"
            except AssertionError as exc:
                ok, detail = False, str(exc).splitlines()[0]
            checks.append(Check(f"{tag}: no page leaked on the {node} node", ok, detail))
    return checks


def run(
    device: str, backends: list[str], workdir: Path, extra: Sequence[str] = (), label: str = ""
) -> Result:
    res = Result(info={"date (UTC)": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
                       **versions()})  # fmt: skip
    log(f"versions: {res.info}")
    for backend in backends:
        try:
            res.checks += check_backend(workdir, backend, device, extra, label)
        except Exception as exc:  # a backend that fails is reported, the next one runs
            traceback.print_exc()
            res.errors.append(f"{backend}: {type(exc).__name__}: {exc}")
            res.checks.append(
                Check(
                    f"{backend}: PD trio ran",
                    False,
                    f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                )
            )
    return res


def available(backends: list[str]) -> tuple[list[str], list[str]]:
    """The backends whose engine imports here, and a line for each that does not."""
    import importlib.util

    mods = {"nixl": "nixl", "mooncake": "mooncake", "cuda_ipc": "triton"}
    ok = [b for b in backends if importlib.util.find_spec(mods[b]) is not None]
    return ok, [f"{b}: not run, `{mods[b]}` not installed" for b in backends if b not in ok]


def pd_checks(rep: Any, section: Callable[[str, Callable[[], object]], None],
              carry: Path | None, wheels: Path | None, site: Path | None) -> None:  # fmt: skip
    """run_all.py's hook: PASS/FAIL rows of this check into its correctness table."""

    def body() -> None:
        install(carry, wheels, site)
        backends, missing = available(DEFAULT_BACKENDS)
        for line in missing:
            rep.row(f"PD greedy on one GPU, {line.split(':')[0]}", line.split(": ", 1)[1])
        res = run("cuda", backends, Path(tempfile.mkdtemp()))
        for c in res.checks:
            rep.checks.append((f"{c.name} ({c.detail})", c.error, c.ok))
        rep.errors += [f"PD check {e}" for e in res.errors]

    section("PD check", body)


def markdown(res: Result, missing: list[str]) -> str:
    lines = [f"- {k}: {v}" for k, v in res.info.items()]
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {'PASS' if c.ok else 'FAIL'} | {c.detail.replace('|', '/')} |"
              for c in res.checks]  # fmt: skip
    lines += [f"| {m.split(':')[0]} | not run | {m.split(': ', 1)[1]} |" for m in missing]
    if res.errors:
        lines += ["", "Errors:", ""] + [f"- {e}" for e in res.errors]
    return "\n".join(lines) + "\n"


def carry_parser(prog: str | None, description: str) -> argparse.ArgumentParser:
    """The flags of this check and check_tp: carried wheels, the report folder, the device."""
    parser = argparse.ArgumentParser(prog=prog, description=description.split("\n")[0])
    parser.add_argument("--carry", type=Path, help="folder from scripts.gpu wheels mooncake pack")
    parser.add_argument("--wheels", type=Path, help="folder of grpcio / protobuf wheels")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the flow")
    add_site_arg(parser)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = carry_parser(prog, __doc__)
    parser.add_argument("--backends", nargs="+", default=DEFAULT_BACKENDS, choices=list(BACKENDS))
    args = parser.parse_args(argv)
    install(args.carry, args.wheels, args.site)
    os.chdir(REPO_ROOT)
    backends, missing = available(args.backends)
    workdir = Path(tempfile.mkdtemp(prefix="check_pd-"))
    res = run(args.device, backends, workdir)
    text = markdown(res, missing)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check_pd.md").write_text(text)
    for backend in args.backends:  # the nodes' logs, for a failure's cause
        for name in ("bootstrap", "prefill", "decode"):
            src = workdir / backend / f"{name}.log"
            if src.exists():
                (args.out / f"{backend}-{name}.log").write_bytes(src.read_bytes()[-2_000_000:])
    print(text, flush=True)
    return 0 if res.checks and all(c.ok for c in res.checks) and not res.errors else 1
