"""What a role switch costs: how long a node takes to switch (drain, swap, registration), idle
and under streamed load, and whether any request was lost.

    python -m scripts.bench.role_switch [--model DIR] [--switches 4] [--rate 2] [--max-tokens 32]

Starts a local 1P2D cluster (gateway/process/cluster.py: Mooncake over TCP on 127.0.0.1, the default
model unless --model), then switches decode-1 to prefill and back `--switches` times with no
load, then as many times under `--rate` requests per second of streamed random-token prompts
(scripts/serving/client.py), each switch through bootstrap/admin.py (what `pdserve-admin
switch-role` runs). Prints one line per switch (the node's own seconds, drain included; the
seconds until the bootstrap lists it in the new role, from the admin client; requests the drain
aborted) and per phase the best and median, then the load's requests: sent, completed, failed.
A failed request is one the switch lost: the gateway should have retried or moved it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bootstrap.admin import SwitchOutcome, list_nodes, switch_role
from gateway.process.cluster import Cluster, build_config
from gateway.process.cluster import build_parser as cluster_parser
from gateway.process.launcher import loopback_transports
from scripts.serving.client import ClientConfig, send, served_model
from scripts.serving.datasets import RequestSpec

# Every prompt through the prefill node; the two decode nodes in turn.
GATEWAY_ARGS = "--local-prefill-max-tokens 0 --decode-policy round_robin"


@dataclass
class Load:
    """Streamed requests at a steady rate from a thread of its own, until `stop`."""

    url: str
    model: str
    rate: float
    max_tokens: int
    prompt_len: int
    errors: list[str] = field(default_factory=list)
    sent: int = 0
    ok: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(300)

    async def _run(self) -> None:
        client = ClientConfig(self.url, self.model, ignore_eos=True, timeout_s=120)
        zero = time.perf_counter()
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
            tasks = []
            while not self._stop.is_set():
                ids = tuple(
                    1000 + (self.sent * 7919 + i * 31) % 9000 for i in range(self.prompt_len)
                )
                spec = RequestSpec(ids, len(ids), self.max_tokens)
                tasks.append(asyncio.create_task(self._one(http, client, spec, zero)))
                self.sent += 1
                await asyncio.sleep(max(0.0, self.sent / self.rate - (time.perf_counter() - zero)))
            await asyncio.gather(*tasks)

    async def _one(self, http: httpx.AsyncClient, client: ClientConfig, spec: RequestSpec,
                   zero: float) -> None:  # fmt: skip
        trace, _ = await send(http, client, spec, [], zero)
        if trace.ok:
            self.ok += 1
        else:
            self.errors.append(f"{trace.error}: {trace.error_detail}")


async def switches(
    bootstrap: str, node_id: str, count: int, settle_s: float
) -> list[SwitchOutcome]:
    """decode -> prefill -> decode ... `count` times, `settle_s` apart."""
    outcomes = []
    for i in range(count):
        role = "prefill" if i % 2 == 0 else "decode"
        outcomes.append(await switch_role(bootstrap, node_id, role))
        await asyncio.sleep(settle_s)
    return outcomes


def report(phase: str, outcomes: list[SwitchOutcome]) -> dict[str, object]:
    for o in outcomes:
        print(f"  {phase}: {o.from_role:>7} -> {o.role:<7} node {o.seconds:6.3f} s, registered "
              f"after {o.registered_s:6.3f} s, {o.aborted} aborted")  # fmt: skip
    node = [o.seconds for o in outcomes]
    registered = [o.registered_s for o in outcomes]
    med_node, med_registered = statistics.median(node), statistics.median(registered)
    print(f"  {phase}: node seconds best {min(node):.3f} median {med_node:.3f}; registered "
          f"best {min(registered):.3f} median {med_registered:.3f}")  # fmt: skip
    return {"switches": [asdict(o) for o in outcomes]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory (default model)")
    parser.add_argument("--switches", type=int, default=4, help="per phase (idle, loaded)")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--drain-timeout", type=float, default=0.5, help="the nodes' flag")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds between switches")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    loopback_transports()
    cluster_argv = ["--prefill", "1", "--decode", "2", "--max-total-tokens", "8192",
                    "--node-args", f"--drain-timeout {args.drain_timeout}",
                    "--gateway-args", GATEWAY_ARGS]  # fmt: skip
    if args.model:
        cluster_argv += ["--model", args.model]
    cluster = Cluster(build_config(cluster_parser().parse_args(cluster_argv)), out=sys.stderr)
    load: Load | None = None
    try:
        url = cluster.start(threading.Event())
        bootstrap = cluster.children[0].address
        decode = sorted(n.node_id for n in asyncio.run(list_nodes(bootstrap)) if n.role == "decode")
        node_id = decode[-1]
        print(f"cluster 1P2D at {url}; switching node {node_id}")
        idle = asyncio.run(switches(bootstrap, node_id, args.switches, args.settle))
        doc: dict[str, object] = {"idle": report("idle", idle)}
        load = Load(url, served_model(url), args.rate, args.max_tokens, args.prompt_len)
        load.start()
        time.sleep(args.settle)
        loaded = asyncio.run(switches(bootstrap, node_id, args.switches, args.settle))
        load.stop()
        doc["loaded"] = report("loaded", loaded)
        doc["load"] = {"rate": args.rate, "sent": load.sent, "ok": load.ok,
                       "failed": len(load.errors), "errors": load.errors[:10]}  # fmt: skip
        print(
            f"  load: {load.sent} requests at {args.rate} req/s, {load.ok} completed, "
            f"{len(load.errors)} failed {load.errors[:3]}"
        )
        if args.json is not None:
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        cluster.stop()
    return 0 if load is not None and not load.errors else 1


if __name__ == "__main__":
    sys.exit(main())
