"""`--step-trace-dir`: what each engine step computed, written by the loop, read by the planner.

The planner (scripts/planning/plan_capacity.py steps) prices a traced step with the node profile, so
the composition must be exact: the chunks with the tokens already in the KV before them, and
the context the decoding requests attend over.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, LoopConfig
from engine.node.args import add_node_args, loop_config
from engine.request import Req
from engine.sampling import RequestSampler, SamplingParams
from planner.profile import NodeProfile
from scripts.planning.plan_capacity import main as plan_capacity
from scripts.planning.step_report import (
    Step,
    TraceError,
    company_report,
    others_stepping,
    read_trace,
    report,
    summarize_steps,
)
from tests.loop_output import LoopOutput


def _serve_one(model_dir: Path, trace: Path, prompt_len: int, new_tokens: int) -> None:
    config = EngineConfig(str(model_dir), chunked_prefill_size=24, max_total_tokens=1024)
    loop = EngineLoop(build_engine(config).scheduler, LoopConfig(step_trace=trace))
    output = LoopOutput(loop)
    loop.start()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    prompt = list(range(5, 5 + prompt_len))
    loop.submit(Req("r0", prompt, params, RequestSampler(params, prompt, 256, "cpu")))
    assert output.wait_finished(["r0"])
    loop.stop()


def test_the_loop_traces_every_step_with_its_composition(tiny_model_dir, tmp_path: Path) -> None:
    trace = tmp_path / "traces" / "decode-1.jsonl"
    _serve_one(tiny_model_dir("llama"), trace, prompt_len=40, new_tokens=3)
    raw = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["prefill_chunks"] for r in raw] == [[[24, 0]], [[16, 24]], [], []]
    assert [r["num_decode_reqs"] for r in raw] == [0, 0, 1, 1]
    assert [r["decode_context"] for r in raw] == [0, 0, 41, 42]  # the prompt, 1 and 2 outputs
    assert all(r["step_s"] >= r["forward_s"] > 0 for r in raw)
    assert raw[0]["start"] <= raw[-1]["start"]
    steps = read_trace(trace)
    assert [s.kind for s in steps] == ["prefill", "prefill", "decode", "decode"]
    assert steps[1].prefill_chunks == ((16, 24),)


def test_the_trace_file_is_named_by_role_and_port(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    args = parser.parse_args(["--port", "31001", "--step-trace-dir", str(tmp_path)])
    assert loop_config(args, "prefill").step_trace == tmp_path / "prefill-31001.jsonl"
    assert loop_config(parser.parse_args([]), "decode").step_trace is None


PROFILE = NodeProfile(
    prefill_coef=(0.1, 0.001, 1e-6), decode_coef=(0.05, 0.01, 0.0), kv_bytes_per_token=1000
)


def _step(chunks: tuple[tuple[int, int], ...], decode: int, step_s: float) -> Step:
    return Step(0.0, chunks, decode, decode * 100, step_s * 0.9, step_s)


def test_steps_are_priced_with_the_profile() -> None:
    steps = [
        _step(((100, 0),), 0, 0.22),  # profile: 0.1 + 0.1 + 0.01 = 0.21
        _step(((100, 0), (100, 0)), 0, 0.42),  # 0.1 + 0.2 + 0.02 = 0.32
        _step((), 4, 0.09),  # 0.05 + 0.04 = 0.09
        _step(((50, 100),), 2, 0.3),  # 0.1 + 0.05 + 1e-6 * 50 * 250 + 0.02 = 0.1825
    ]
    by_kind = {s.kind: s for s in summarize_steps(steps, PROFILE)}
    assert by_kind["prefill"].steps == 2
    assert by_kind["prefill"].predicted_s == pytest.approx(0.21 + 0.32)
    assert by_kind["prefill"].ratio == pytest.approx(0.64 / 0.53)
    assert by_kind["decode"].ratio == pytest.approx(1.0)
    assert by_kind["mixed"].predicted_s == pytest.approx(0.1825)
    text = report({"prefill-1": steps}, PROFILE)
    assert "prefill-1" in text and "busy" in text


def test_steps_are_split_by_the_nodes_stepping_beside_them() -> None:
    """Decode steps of 0.09 s (profile: 0.09 s at batch 4): one alone, one a third inside a
    prefill step of the other node, two wholly inside it at twice the profiled time."""
    decode = [
        Step(0.0, (), 4, 400, 0.09, 0.09),
        Step(1.0, (), 4, 400, 0.09, 0.09),
        Step(2.0, (), 4, 400, 0.18, 0.18),
        Step(2.2, (), 4, 400, 0.18, 0.18),
    ]
    prefill = [Step(1.06, ((100, 0),), 0, 0, 1.5, 1.5)]  # 1.06 to 2.56
    assert others_stepping(decode[0], [prefill]) == 0.0
    assert others_stepping(decode[1], [prefill]) == pytest.approx(1 / 3)
    assert others_stepping(decode[2], [prefill]) == pytest.approx(1.0)
    rows = company_report({"decode-1": decode, "prefill-1": prefill}, PROFILE).splitlines()[2:]
    cells = [row.split() for row in rows]
    assert cells[0] == ["decode-1", "decode", "0", "2", "1.00", "1.00"]  # 1/3 rounds to 0
    assert cells[1] == ["decode-1", "decode", "1", "2", "2.00", "2.00"]
    assert cells[2][:4] == ["prefill-1", "prefill", "0", "1"]  # D stepped 0.39 s of its 1.5 s
    assert "other nodes stepping" in report({"decode-1": decode, "prefill-1": prefill}, PROFILE)
    assert "other nodes stepping" not in report({"decode-1": decode}, PROFILE)


def test_steps_command_rejects_what_is_not_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    PROFILE.save(profile)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert plan_capacity(["steps", "--profile", str(profile), str(empty)]) == 2
    assert "no *.jsonl step traces" in capsys.readouterr().err
    assert plan_capacity(["steps", "--profile", str(profile), str(tmp_path / "gone.jsonl")]) == 2
    assert "gone.jsonl: No such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"start": 1.0}\n')
    with pytest.raises(TraceError, match="line 1"):
        read_trace(bad)
    assert plan_capacity(["steps", "--profile", str(profile), str(bad)]) == 2
    assert "bad.jsonl line 1: not a step record" in capsys.readouterr().err
