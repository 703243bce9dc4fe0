"""The simulator's per-node capacity (scripts/planning/simulator.py): a node's KV pool
(`max_total_tokens`) and running cap (`max_running_requests`) bound how many requests it holds
at once; the rest wait in its queue, so their TTFT grows while the node's CPU has room. What
makes a second decode node worth its cores when streams are long (the two-phase benchmark's
memory-bound phase), and what the planner sees through `--node-max-total-tokens`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scripts.planning.profile import NodeProfile
from scripts.planning.simulator import Arrival, Simulation

PROMPT, OUTPUT = 96, 100  # a stream holds 96 + 100 tokens of KV at its end


def profile(pool: int, running: int = 256) -> NodeProfile:
    """Decode steps of 0.03 s whatever the batch; a prompt prefills in 0.05 + 0.1 s."""
    return NodeProfile(prefill_coef=(0.05, 0.001, 0.0), decode_coef=(0.03, 0.0, 0.0),
                       kv_bytes_per_token=1000, transfer_bytes_per_s=1e9, handoff_s=0.0,
                       gateway_s=0.0, max_total_tokens=pool,
                       max_running_requests=running)  # fmt: skip


def ttfts(sim: Simulation, n: int) -> list[float]:
    traces = sim.run([Arrival(0.0, PROMPT, OUTPUT) for _ in range(n)])
    return sorted(t.ttft or 0.0 for t in traces)


def test_a_decode_nodes_pool_bounds_the_streams_it_holds() -> None:
    """A pool of two streams (2 x 196 tokens): of four requests at once, two wait until the
    first two have streamed their 100 tokens (~3 s); with two such decode nodes none waits."""
    pool = 2 * (PROMPT + OUTPUT)
    one = ttfts(Simulation(profile(pool), prefill=1, decode=1), 4)
    assert max(one[:2]) < 0.6 and min(one[2:]) > 100 * 0.03
    two = ttfts(Simulation(profile(pool), prefill=1, decode=2), 4)
    assert max(two) < 1.0  # four prompts of 0.15 s through one prefill node, no KV wait
    # One token short of a second stream: one at a time.
    tight = ttfts(Simulation(profile(pool - 1), prefill=1, decode=1), 2)
    assert tight[1] > 100 * 0.03


def test_the_running_cap_bounds_them_too_and_a_colocated_node_reserves_its_output() -> None:
    big = 100 * (PROMPT + OUTPUT)
    capped = ttfts(Simulation(profile(big, running=2), prefill=1, decode=1), 4)
    assert max(capped[:2]) < 0.6 and min(capped[2:]) > 100 * 0.03
    colocated = ttfts(Simulation(profile(2 * (PROMPT + OUTPUT)), prefill=0, decode=1), 3)
    assert colocated[2] > 100 * 0.03 > colocated[1]


def test_a_request_larger_than_a_pool_is_said() -> None:
    with pytest.raises(RuntimeError, match="too large for a node"):
        Simulation(replace(profile(PROMPT), max_total_tokens=PROMPT), 1, 1).run(
            [Arrival(0.0, PROMPT, OUTPUT)]
        )
