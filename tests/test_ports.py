"""engine/ports.py: ports for children come from outside the kernel's ephemeral range, bindable,
never twice from one process, and reserved against other processes picking at the same time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import ports


def test_ports_are_bindable_distinct_and_outside_the_ephemeral_range() -> None:
    low, high = ports.ephemeral_range()
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    assert all(not low <= port <= high and port >= ports.LOWEST for port in picked)
    assert all(ports._bindable(port, ports.LOCALHOST) for port in picked)


def test_a_fresh_mark_keeps_the_port_from_another_picker(tmp_path: Path) -> None:
    assert ports._reserve(20001, tmp_path)
    assert not ports._reserve(20001, tmp_path)  # what a second process would see


def test_a_stale_mark_is_taken_over(tmp_path: Path) -> None:
    assert ports._reserve(20002, tmp_path)
    stale = time.time() - ports.RESERVE_S - 1
    os.utime(tmp_path / "20002", (stale, stale))
    assert ports._reserve(20002, tmp_path)


def test_two_processes_never_get_the_same_port() -> None:
    code = "from engine.ports import free_port; print(*(free_port() for _ in range(300)))"
    runs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    first, second = (set(map(int, run.communicate()[0].split())) for run in runs)
    assert len(first) == len(second) == 300
    assert not first & second


def test_a_machine_whose_ephemeral_range_starts_low_uses_the_ports_above_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 50000))
    assert ports.candidate_ports() == range(50001, 65536)
