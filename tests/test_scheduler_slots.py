"""Requests a node role parks hold a request slot: admission counts them.

Found by the two-phase planner run (2026-11-26): with `--max-running-requests 3`, prefill nodes
crashed with "a slot is always free below max_running_requests" once requests waiting for their
KV writes to settle (parked, slots held) and newly admitted ones outnumbered the slot table.
This drives the real scheduler and model: parked requests fill the cap, and the next request
waits for a release instead of crashing the node.
"""

from __future__ import annotations

from pathlib import Path

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.request import Req
from engine.sampling import RequestSampler, SamplingParams


def _req(rid: str) -> Req:
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    prompt = list(range(5, 25))
    req = Req(rid, prompt, params, RequestSampler(params, prompt, 256, "cpu"))
    req.stop_after_prefill = True  # parked with its pages after its first token
    return req


def test_parked_requests_count_against_the_running_cap(tiny_model_dir) -> None:
    config = EngineConfig(
        str(Path(tiny_model_dir("llama"))), max_total_tokens=1024, max_running_requests=2
    )
    scheduler = build_engine(config).scheduler
    first = [_req("a"), _req("b")]
    for req in first:
        scheduler.add_request(req)
    scheduler.step()
    assert {r.rid for r in scheduler.take_prefilled()} == {"a", "b"}  # both parked, slots held
    later = [_req("c"), _req("d"), _req("e")]
    for req in later:
        scheduler.add_request(req)
    for _ in range(3):  # before the fix: AssertionError on the table's last slot
        scheduler.step()
    assert not scheduler.running and len(scheduler.waiting) == 3
    scheduler.release(first[0], cache=False)
    scheduler.step()
    assert [r.rid for r in scheduler.take_prefilled()] == ["c"]  # one slot back, one admitted
    assert len(scheduler.waiting) == 2
    scheduler.check_integrity()
