"""How fast one core runs Python while others are busy: turbo and hidden SMT siblings.

Gateway scaling is measured as tokens/s of N workers against one worker. That ratio is only the
gateway's if a core runs as fast with N workers (and their clients) busy as with one. Two things
on a host break that, and neither shows in `lscpu` inside a virtual machine:
- the clock: a core's boost falls as more cores are busy;
- hidden siblings: two vCPUs that are hardware threads of one physical core, presented as two
  cores (the guest's topology says "1 thread per core").

This probe runs a fixed pure-Python workload (small dicts, string formatting, bytes joins: the
kind of work a gateway worker does per token) in processes pinned one per CPU:
- `load`: K processes on K CPUs at once, for each K; each one's rate against the rate of one
  process alone. A fall with K is the clock (or shared caches).
- `pairs`: CPU 0 with each other CPU j in turn, and each one's rate against its rate alone,
  measured just before (a shared host drifts), the median over `--repeats` rounds. A CPU whose
  company costs CPU 0 far more than the others' is its hidden sibling.

    python -m scripts.bench.core_speed [--counts 1,2,4,8,16,32] [--seconds 2] [--pairs]
        [--pair-cpus 1,16] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue
from pathlib import Path


def _work_unit() -> int:
    """One unit of gateway-like Python work; returns a value so nothing is optimized away."""
    delta = {"index": 0, "token_ids": [17, 42], "text": "", "finish_reason": None}
    parts = []
    for i in range(32):
        delta["index"] = i
        delta["text"] = f"tok{i}"
        parts.append(f'data: {{"i":{delta["index"]},"t":"{delta["text"]}"}}\n\n'.encode())
    return len(b"".join(parts))


def _runner(cpu: int, start_at: float, seconds: float, out: Queue[tuple[int, float]]) -> None:
    os.sched_setaffinity(0, {cpu})
    while time.monotonic() < start_at:  # every runner starts together
        time.sleep(0.001)
    end = start_at + seconds
    units = 0
    cpu_start = time.process_time()
    while time.monotonic() < end:
        for _ in range(50):
            _work_unit()
        units += 50
    used = time.process_time() - cpu_start
    out.put((cpu, units / used if used > 0 else 0.0))


def rates(cpus: Sequence[int], seconds: float) -> dict[int, float]:
    """Work units per CPU second of one process pinned to each of `cpus`, all at once."""
    context = multiprocessing.get_context("fork")
    out: Queue[tuple[int, float]] = context.Queue()
    start_at = time.monotonic() + 0.3
    procs = [context.Process(target=_runner, args=(c, start_at, seconds, out)) for c in cpus]
    for p in procs:
        p.start()
    got = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return got


@dataclass(frozen=True)
class LoadRow:
    busy: int  # CPUs running the workload at once
    mean: float  # units per CPU second, mean over them
    slowest: float

    def line(self, alone: float) -> str:
        return (
            f"| {self.busy} | {self.mean:,.0f} | {self.mean / alone:.3f} | "
            f"{self.slowest / alone:.3f} |"
        )


def load_table(cpus: Sequence[int], counts: Sequence[int], seconds: float) -> str:
    rows = []
    for k in counts:
        got = rates(cpus[:k], seconds)
        rows.append(LoadRow(k, sum(got.values()) / len(got), min(got.values())))
        print(f"  {k} busy: {rows[-1].mean:,.0f} units/s", flush=True)
    alone = rows[0].mean if rows and rows[0].busy == 1 else rates(cpus[:1], seconds)[cpus[0]]
    head = "| CPUs busy | units / CPU s (mean) | vs one alone | slowest vs one alone |\n"
    return head + "|---:|---:|---:|---:|\n" + "\n".join(r.line(alone) for r in rows)


def pairs_table(cpus: Sequence[int], others: Sequence[int], seconds: float, repeats: int) -> str:
    """CPU `cpus[0]` beside each of `others`, `repeats` times, each pair measured right after
    `cpus[0]` alone (a shared host's speed drifts): the median of the ratios."""
    first = cpus[0]
    ratios: dict[int, list[tuple[float, float]]] = {o: [] for o in others}
    for _ in range(repeats):
        for other in others:
            alone = rates([first], seconds)[first]
            other_alone = rates([other], seconds)[other]
            got = rates([first, other], seconds)
            ratios[other].append((got[first] / alone, got[other] / other_alone))
            print(f"  cpu {first} with cpu {other}: {got[first] / alone:.3f}", flush=True)
    lines = sorted(
        (statistics.median(a for a, _ in r), statistics.median(b for _, b in r), o)
        for o, r in ratios.items()
    )
    head = f"| other CPU | CPU {first} vs alone | other vs alone | repeats |\n"
    body = "\n".join(f"| {o} | {a:.3f} | {b:.3f} | {repeats} |" for a, b, o in lines)
    return head + "|---:|---:|---:|---:|\n" + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", default="1,2,4,8,16,24,32")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--pairs", action="store_true", help="CPU 0 beside each other CPU")
    parser.add_argument(
        "--pair-cpus", default="", help="with --pairs: only these other CPUs (e.g. 1,8,16)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="with --pairs: rounds")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    counts = [k for k in (int(x) for x in args.counts.split(",")) if k <= len(cpus)]
    text = f"{len(cpus)} CPUs; {args.seconds} s per measurement\n\n"
    text += load_table(cpus, counts, args.seconds) + "\n"
    if args.pairs:
        others = [int(c) for c in args.pair_cpus.split(",") if c] or cpus[1:]
        text += "\n" + pairs_table(cpus, others, args.seconds, args.repeats) + "\n"
    print(text, flush=True)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
