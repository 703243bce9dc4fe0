"""Score recorded two-phase runs again under another SLO, the runs of several `--out` folders
in one table.

    python -m scripts.planning.two_phase_rescore --slo-ttft-ms 15000 --slo-tpot-ms 160 DIR [DIR ...]

A static split's run does not depend on the SLO: the SLO only scores it. So static runs
recorded once can be scored under another SLO, and compared with a planner run made later on
the same schedule under that SLO (`two_phase --no-static`). Every folder's `two_phase.json`
must hold the same phases and seed (the same schedule), and each run its `requests` (written
since 2026-11-27). A planner run's windows are kept only where its folder's SLO is the one
asked for: its predictions were made for that SLO; elsewhere its phases are scored and its
windows left out (said in the output).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from scripts.planning.two_phase_score import (
    GOAL_ATTAINMENT,
    Phase,
    RunResult,
    TwoPhaseError,
    WindowCheck,
    Workload,
    build_schedule,
    check_goals,
    score_run,
    score_table,
    trace_of,
)
from scripts.serving.metrics import SLO


def load_runs(folder: Path, slo: SLO) -> tuple[Workload, list[RunResult], list[str]]:
    """The folder's runs scored under `slo`, its workload (with `slo`) and notes on what was
    left out."""
    path = folder / "two_phase.json"
    try:
        doc = json.loads(path.read_text())
        phases = tuple(Phase(**p) for p in doc["workload"]["phases"])
        workload = Workload(phases, slo, int(doc["workload"]["seed"]))
        recorded = SLO(**doc["workload"]["slo"])
        entries: list[dict[str, Any]] = list(doc["runs"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TwoPhaseError(f"{path}: not a two_phase.json ({exc})") from None
    schedule = build_schedule(workload)
    runs, notes = [], []
    for entry in entries:
        rows: list[dict[str, Any]] = entry.get("requests") or []
        if entry.get("error") or len(rows) != len(schedule.sessions):
            notes.append(f"{folder}: {entry['name']} left out (failed, or no request rows: "
                         f"{len(rows)} of {len(schedule.sessions)})")  # fmt: skip
            continue
        run = RunResult(entry["name"], bool(entry["planner"]))
        run.scores = score_run(workload, schedule, [trace_of(r) for r in rows])
        if run.planner and recorded == slo:
            names = {f.name for f in fields(WindowCheck)}
            run.checks = [WindowCheck(**{k: v for k, v in w.items() if k in names})
                          for w in entry["windows"]]  # fmt: skip
        elif run.planner:
            notes.append(f"{folder}: {run.name}'s windows left out (its planner ran under "
                         f"TTFT {recorded.ttft_ms:g} / TPOT {recorded.tpot_ms:g} ms)")  # fmt: skip
        runs.append(run)
    return workload, runs, notes


def rescore(folders: list[Path], slo: SLO) -> str:
    """The runs' table under `slo`, then the goals of each planner run against every static
    run (runs named by their folder where there are several)."""
    workloads, runs, notes = [], [], []
    for folder in folders:
        workload, found, left_out = load_runs(folder, slo)
        workloads.append(workload)
        for run in found:
            run.name += f" [{folder.name}]" if len(folders) > 1 else ""
        runs += found
        notes += left_out
    if any(w != workloads[0] for w in workloads):
        raise TwoPhaseError("the folders' phases or seeds differ: their schedules do not compare")
    lines = [f"SLO: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms per request",
             "", score_table(runs), "", *notes]  # fmt: skip
    statics = [r for r in runs if not r.planner]
    planners: list[RunResult | None] = [r for r in runs if r.planner]
    for planner in planners or [None]:
        title = "Goals:" if planner is None else f"Goals of {planner.name}:"
        goals = check_goals(statics + ([planner] if planner else []), GOAL_ATTAINMENT)
        lines += ["", title, *goals.lines()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="two_phase_rescore", description=__doc__.splitlines()[0])
    p.add_argument("folders", type=Path, nargs="+", help="two_phase --out folders")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    args = p.parse_args(argv)
    try:
        print(rescore(args.folders, SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)))
    except TwoPhaseError as exc:
        print(f"two_phase_rescore: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
