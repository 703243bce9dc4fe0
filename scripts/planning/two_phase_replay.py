"""A recorded two-phase planner run, decided again by today's `pd-planner` (other flags too):
its predicted goodput per window against the goodput the run measured.

`two_phase.py` keeps, for its planner run, the metrics the planner read
(`planner_scrapes.jsonl[.gz]`) and each window's measured goodput (`two_phase.json`: the
requests the client sent in the window that met the SLO). The measured side does not depend on
what the planner predicted, only on the split that was live, and a replay decides on the same
scrapes with that same live split. So a replay scores another correction rule or weight on the
run's own windows, deterministically:

    python -m scripts.planning.two_phase_replay benchmarks/serving-2026-11-26-two-phase-5/evidence \
        [-- --correction-full-samples 0]

The planner gets the flags `two_phase.py` gave it (from `two_phase.json`), then the ones after
`--`. Prints each window (recorded prediction, replayed prediction, the replay's TPOT correction,
error) and the mean |error| over the steady-state windows, as `two_phase.py` scores them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from planner.metrics import SLO
from planner.splits import parse_splits
from scripts.planning.two_phase import NodeCapacity, PlannerRun, planner_flags


def recorded_flags(doc: dict[str, Any]) -> list[str]:
    """The flags `two_phase.py` ran `pd-planner` with (but the actuator), from its record."""
    p, budget = doc["planner"], int(doc["budget"])
    if "sim_warmup_s" not in p:
        raise SystemExit("this two_phase.json predates --sim-warmup in the record (an older run)")
    start = {s.name: s for s in parse_splits("all", budget)}[p["start"]]
    # A run before the longer simulation decided without it, and one before ties moved the
    # live split held them.
    p = {"lasting_seconds": 0.0, "lasting_hysteresis": 1.0, **p}
    run = PlannerRun(**{**p, "start": start, "profile": Path(p["profile"])})
    slo = SLO(**doc["workload"]["slo"])
    return planner_flags(budget, run, slo, NodeCapacity(**doc["nodes"]))


def scrapes_file(run_dir: Path, into: Path) -> Path:
    plain, packed = run_dir / "planner_scrapes.jsonl", run_dir / "planner_scrapes.jsonl.gz"
    if plain.exists():
        return plain
    if not packed.exists():
        raise SystemExit(f"{run_dir}: no planner_scrapes.jsonl[.gz] (not a planner run?)")
    into.write_bytes(gzip.decompress(packed.read_bytes()))
    return into


def replay(run_dir: Path, extra: list[str]) -> list[dict[str, Any]]:
    """The replayed decisions, one dict per window."""
    doc = json.loads((run_dir / "two_phase.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        scrapes = scrapes_file(run_dir, Path(tmp) / "scrapes.jsonl")
        argv = [sys.executable, "-m", "planner", "--replay", str(scrapes),
                "--dry-run", *recorded_flags(doc), *extra]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pd-planner --replay failed:\n{done.stderr}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def report(run_dir: Path, decisions: list[dict[str, Any]]) -> tuple[str, float | None]:
    """The windows table and the mean |error| over the scored (steady-state) windows."""
    doc = json.loads((run_dir / "two_phase.json").read_text())
    run = next(r for r in doc["runs"] if r["planner"])
    if any("scored" not in w for w in run.get("windows", [{}])):
        raise SystemExit(f"{run_dir}: its two_phase.json has no scored windows (an older run)")
    # The replay decides on the recorded scrape pairs in order: its k-th decision is the run's
    # k-th. The windows are some of the run's decisions, in order: each is the next one with
    # the window's (exact) measured rate.
    recorded = [json.loads(line) for line in (run_dir / "planner_decisions.jsonl").open()]
    if len(recorded) != len(decisions):
        raise SystemExit(f"the replay made {len(decisions)} decisions, the run {len(recorded)}")
    k = 0
    lines = ["| window s | live split | sent | met SLO | measured goodput | recorded prediction "
             "| replayed prediction | TPOT correction | error | scored | replayed target |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]  # fmt: skip
    errors = []
    for w in run["windows"]:
        while k < len(recorded) and float(recorded[k]["window"]["rate"]) != float(w["rate"]):
            k += 1
        d = decisions[k] if k < len(recorded) else None
        k += 1
        new = None if d is None else d.get("predicted_goodput")
        measured = w["measured_goodput"]
        error = None if new is None or measured <= 0 else new / measured - 1
        if w["scored"] and error is not None:
            errors.append(abs(error))
        shown = "unbounded" if error is None else f"{error:+.0%}"
        lines.append(
            f"| {w['start_s']:.0f}-{w['end_s']:.0f} | {w['split']} | {w['sent']} | {w['met']} | "
            f"{measured:.3f} | {w['predicted_goodput']} | {new} | "
            f"{d['correction'] if d else '-'} | {shown} | {'yes' if w['scored'] else 'no'} | "
            f"{d['target'] if d else '-'} |"
        )
    mean = sum(errors) / len(errors) if errors else None
    return "\n".join(lines), mean


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    extra = args[args.index("--") + 1 :] if "--" in args else []
    own = args[: args.index("--")] if "--" in args else args
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="a two_phase.py --out folder's planner run")
    run_dir = parser.parse_args(own).run_dir
    table, mean = report(run_dir, replay(run_dir, extra))
    print(table)
    shown = "n/a" if mean is None else f"{mean:.1%}"
    print(f"\nmean |error| over the scored windows: {shown} (pd-planner flags added: {extra})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
