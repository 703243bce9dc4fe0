"""`--step-trace-dir`: one JSON line per engine step, to see how a node under load spends its time.

Each line is a `StepStats` plus when the step began (wall clock, seconds since the epoch, so it
lines up with a client's request timestamps) and the scheduler's queue lengths after it.
`python -m scripts.planning.plan_capacity steps` compares such traces with a node profile.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from engine.scheduler import Scheduler


class StepTrace:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", buffering=1)  # a line per step reaches the file at once

    def write(self, scheduler: Scheduler) -> None:
        stats = scheduler.last_stats
        record = {
            "start": time.time() - stats.step_s,
            **asdict(stats),
            "waiting": len(scheduler.waiting),
            "running": len(scheduler.running),
        }
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
