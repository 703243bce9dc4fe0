"""`gateway-server --worker-cpus` (gateway/process/cpus.py): the cpulist parser, the check against
the allowed CPUs, which CPU each worker gets, and the flag's way from the command line into the
frozen config. The pinned processes themselves are in tests/test_gateway_workers.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import cpu_of_worker
from gateway.process.cluster import build_config as cluster_config
from gateway.process.cluster import build_parser as cluster_parser
from gateway.process.cpus import (
    check_allowed,
    format_cpu_list,
    parse_cpu_list,
    worker_cpus,
)


def test_cpu_lists_parse_in_the_order_written() -> None:
    assert parse_cpu_list("0-3") == (0, 1, 2, 3)
    assert parse_cpu_list("4,6,8,10") == (4, 6, 8, 10)
    assert parse_cpu_list("8-9, 0-1") == (8, 9, 0, 1)  # worker 0 on CPU 8
    assert parse_cpu_list("5") == (5,)
    assert parse_cpu_list("2-2") == (2,)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "'' is not a CPU number or range"),
        ("0,,1", "'' is not a CPU number or range"),
        ("a-b", "'a-b' is not a CPU number or range"),
        ("0-", "'0-' is not a CPU number or range"),
        ("-1", "'-1' is not a CPU number or range"),
        ("0-3:2", "'0-3:2' is not a CPU number or range"),
        ("3-1", "the range '3-1' runs backwards; write 1-3"),
        ("0-3,2", "lists CPU 2 more than once"),
        ("9000", "CPU 9000 is beyond Linux's largest, 8191"),
    ],
)
def test_bad_cpu_lists_name_the_flag(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^--worker-cpus ") as error:
        parse_cpu_list(text)
    assert message in str(error.value)
    with pytest.raises(ValueError, match=r"^--gateway-worker-cpus "):
        parse_cpu_list(text, "--gateway-worker-cpus")


def test_cpus_outside_the_allowed_set_are_refused_with_the_set() -> None:
    check_allowed((0, 1), {0, 1, 2, 3})
    with pytest.raises(ValueError) as error:
        check_allowed((2, 5), {0, 1, 2, 3, 8})
    assert str(error.value) == (
        "--worker-cpus: CPU 5 is not one this process may run on; allowed: 0-3,8"
    )
    assert worker_cpus("1,0", {0, 1}) == (1, 0)
    assert worker_cpus("  ", {0}) == ()  # no pinning
    with pytest.raises(ValueError, match="CPU 2 is not one"):
        worker_cpus("0-2", {0, 1})


def test_each_worker_takes_the_list_in_turn() -> None:
    cpus = (4, 6, 8, 10)
    assert [cpu_of_worker(cpus, i) for i in range(4)] == [4, 6, 8, 10]
    assert [cpu_of_worker((0, 1), i) for i in range(4)] == [0, 1, 0, 1]  # fewer: they share
    assert cpu_of_worker((), 3) is None
    assert format_cpu_list([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert format_cpu_list([]) == ""


def test_the_server_flag_reaches_each_workers_config(default_model_dir: Path) -> None:
    from dataclasses import replace

    from gateway.process.server import build_config, build_parser

    cpu = min(os.sched_getaffinity(0))
    args = build_parser().parse_args(["--bootstrap", "b:1", "--workers", "3"])
    assert build_config(args, str(default_model_dir)).cpu is None  # default: unpinned
    args = build_parser().parse_args(
        ["--bootstrap", "b:1", "--workers", "3", "--worker-cpus", str(cpu)]
    )
    config = build_config(args, str(default_model_dir))
    assert config.worker_cpus == (cpu,)
    assert [replace(config, worker_index=i).cpu for i in range(3)] == [cpu] * 3
    args = build_parser().parse_args(["--bootstrap", "b:1", "--worker-cpus", "0-x"])
    with pytest.raises(ValueError, match="--worker-cpus '0-x'"):
        build_config(args, str(default_model_dir))


def test_pd_cluster_checks_and_passes_the_list() -> None:
    cpu = min(os.sched_getaffinity(0))
    args = cluster_parser().parse_args(["--gateway-worker-cpus", f" {cpu} "])
    assert cluster_config(args).gateway_worker_cpus == str(cpu)
    assert cluster_config(cluster_parser().parse_args([])).gateway_worker_cpus == ""
    args = cluster_parser().parse_args(["--gateway-worker-cpus", "8191"])
    if 8191 not in os.sched_getaffinity(0):
        with pytest.raises(ValueError, match="--gateway-worker-cpus: CPU 8191 is not one"):
            cluster_config(args)


def test_a_pinned_process_starts_its_threads_on_the_cpu() -> None:
    cpu = max(os.sched_getaffinity(0))
    code = (
        "import os, sys, threading\n"
        "from gateway.process.cpus import pin_this_process\n"
        f"pin_this_process({cpu})\n"
        "seen = []\n"
        "thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))\n"
        "thread.start(); thread.join()\n"
        "print(sorted(os.sched_getaffinity(0)), sorted(seen[0]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.split("\n")[0] == f"[{cpu}] [{cpu}]"
