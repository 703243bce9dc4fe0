"""The simulator's per-node capacity (planner/simulator.py): a node's KV pool
(`max_total_tokens`) and running cap (`max_running_requests`) bound how many requests it holds
at once; the rest wait in its queue, so their TTFT grows while the node's CPU has room. What
makes a second decode node worth its cores when streams are long (the two-phase benchmark's
memory-bound phase), and what the planner sees through `--node-max-total-tokens`.

Admission and retraction follow the engine (decode_node/decode_role.py `_admit`,
engine/scheduler.py `_reserve_decodes` / `_retract_one`): a decode node admits a request when
its pool holds the prompt + `decode_headroom` tokens, not its whole output; when a decode step
finds the pool short, the newest running request goes back to the waiting queue, its KV freed
(its full pages left in the prefix cache), and is prefilled again on that node."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from planner.metrics import RequestTrace
from planner.profile import NodeProfile
from planner.simulator import Arrival, HostConfig, Simulation

PROMPT, OUTPUT = 96, 100  # a stream holds 96 + 100 tokens of KV at its end
STREAM = PROMPT + OUTPUT
DECODE_S = 0.03


def profile(pool: int, running: int = 256, headroom: int = 32, page_size: int = 1) -> NodeProfile:
    """Decode steps of 0.03 s whatever the batch; n tokens prefill in 0.05 + 0.001 n s. Pages
    of one token unless said: the token arithmetic below is then exact."""
    return NodeProfile(prefill_coef=(0.05, 0.001, 0.0), decode_coef=(DECODE_S, 0.0, 0.0),
                       kv_bytes_per_token=1000, transfer_bytes_per_s=1e9, handoff_s=0.0,
                       gateway_s=0.0, max_total_tokens=pool, max_running_requests=running,
                       decode_headroom=headroom, page_size=page_size)  # fmt: skip


def run(sim: Simulation, n: int) -> list[RequestTrace]:
    return sim.run([Arrival(0.0, PROMPT, OUTPUT) for _ in range(n)])


def ttfts(sim: Simulation, n: int) -> list[float]:
    return sorted(t.ttft or 0.0 for t in run(sim, n))


def gaps(trace: RequestTrace) -> list[float]:
    """gaps[i]: from token i + 1 to token i + 2 of a stream."""
    return [b - a for a, b in itertools.pairwise(trace.chunks)]


def test_a_decode_nodes_pool_bounds_the_streams_it_admits() -> None:
    """A pool of two streams (2 x 196 tokens) and a headroom of 128 tokens: the third request
    finds 392 - 2 x 96 = 200 tokens free, fewer than 96 + 128, so of four requests at once two
    wait until the first two have streamed their 100 tokens (~3 s), and nothing is retracted;
    with two such decode nodes none waits. (Before retraction was modelled, a decode node held
    a request's whole output from admission; with the engine's default headroom the same pool
    now admits a third stream: the next test.)"""
    one = Simulation(profile(2 * STREAM, headroom=128), prefill=1, decode=1)
    waits = ttfts(one, 4)
    assert max(waits[:2]) < 0.6 and min(waits[2:]) > OUTPUT * DECODE_S
    assert one.retractions == 0
    two = ttfts(Simulation(profile(2 * STREAM, headroom=128), prefill=1, decode=2), 4)
    assert max(two) < 1.0  # four prompts of 0.15 s through one prefill node, no KV wait


def test_a_pool_that_admits_more_streams_than_fit_retracts_the_newest_and_prefills_it_again():
    """The same pool with the default headroom of 32: all three requests are admitted (96 + 32
    fits thrice in 392) and decode together until their next tokens need 3 x 131 > 392 tokens,
    at the 35th token: the newest (the third) is retracted. Its cached KV is evicted at the next
    step by the two others' growth, so once they finish (65 tokens later) it is prefilled again
    whole, prompt + its 35 tokens, and goes on to its 100th token: no request lost, one
    retraction, and its stream shows the wait plus the recompute."""
    sim = Simulation(profile(2 * STREAM), prefill=1, decode=1)
    first, second, third = run(sim, 3)
    assert all(t.ok and t.output_tokens == OUTPUT for t in (first, second, third))
    decode, prefill = sim.decode_nodes[0], sim.prefill_nodes[0]
    assert (sim.retractions, decode.retractions, prefill.retractions) == (1, 1, 0)
    assert decode.recomputed_tokens == PROMPT + 35
    assert max(gaps(first) + gaps(second)) == pytest.approx(DECODE_S)
    stalled = [i for i, gap in enumerate(gaps(third)) if gap > DECODE_S + 1e-9]
    assert stalled == [34]  # between its 35th and 36th tokens
    recompute_s = profile(0).prefill_s([(PROMPT + 35, 0)])  # 0.181 s
    assert gaps(third)[34] == pytest.approx((OUTPUT - 35) * DECODE_S + recompute_s)
    assert third.done == pytest.approx(first.done + recompute_s + (OUTPUT - 36) * DECODE_S)


def test_a_retracted_request_whose_pages_are_still_cached_prefills_only_the_rest() -> None:
    """Pages of 16, a pool of 13 pages: the second request is admitted (7 pages of prompt +
    headroom 16 free) and retracted at its first decode step (both need a 7th page, one is free);
    its 6 full pages stay in the prefix cache, the first request finishes 9 tokens later without
    needing another page, and the second comes back on those 6 pages: 1 token recomputed."""
    sim = Simulation(profile(13 * 16, headroom=16, page_size=16), prefill=1, decode=1)
    short, long = sim.run([Arrival(0.0, PROMPT, 10), Arrival(0.0, PROMPT, OUTPUT)])
    assert short.ok and long.ok and long.output_tokens == OUTPUT
    assert sim.retractions == 1 and sim.decode_nodes[0].recomputed_tokens == 1
    recompute_s = profile(0).prefill_s([(1, PROMPT)])
    assert gaps(long)[0] == pytest.approx(9 * DECODE_S + recompute_s)


def test_a_pool_large_enough_never_retracts_and_gives_the_same_streams() -> None:
    """Nothing about retraction shows when the pool holds every stream whole: four requests at
    once are prefilled in one 0.43 s step (as before retraction was modelled) and stream 100
    tokens each, 0.03 s apart, disaggregated or colocated."""
    for prefill in (1, 0):
        sim = Simulation(profile(100 * STREAM), prefill=prefill, decode=1)
        traces = run(sim, 4)
        assert sim.retractions == 0
        for t in traces:
            assert t.ttft == pytest.approx(0.05 + 0.001 * 4 * PROMPT, abs=1e-3)
            assert max(gaps(t)) == pytest.approx(DECODE_S) and len(t.chunks) == OUTPUT


def test_the_running_cap_bounds_them_too_and_a_colocated_node_retracts_as_well() -> None:
    big = 100 * STREAM
    capped = ttfts(Simulation(profile(big, running=2), prefill=1, decode=1), 4)
    assert max(capped[:2]) < 0.6 and min(capped[2:]) > OUTPUT * DECODE_S
    # A colocated node admits by the first chunk's pages, not the output (it used to reserve
    # the output): three prompts fit a pool of two streams, and the newest is retracted.
    colocated = Simulation(profile(2 * STREAM), prefill=0, decode=1)
    traces = run(colocated, 3)
    assert max(t.ttft or 0.0 for t in traces) < 0.6 and all(t.ok for t in traces)
    assert colocated.retractions >= 1 and colocated.decode_nodes[0].recomputed_tokens > PROMPT


def test_a_prefill_node_that_frees_pages_while_idle_admits_its_waiting_prompt_then() -> None:
    """A prefill node whose pool holds one prompt: of two prompts at once the second waits for
    the first's pages, which its transfer frees after the step has ended, the node idle. The
    second is prefilled then (two prefills of 0.146 s), not at some later arrival: before this
    the idle node was never woken and the run ended with the request stuck."""
    sim = Simulation(profile(PROMPT + 32), prefill=1, decode=2)
    first, second = sorted(t.ttft or 0.0 for t in sim.run([Arrival(0.0, PROMPT, 4)] * 2))
    prefill_s = 0.05 + 0.001 * PROMPT
    assert first == pytest.approx(prefill_s, abs=0.01)
    assert second == pytest.approx(2 * prefill_s, abs=0.01)


def test_a_request_larger_than_a_pool_is_said() -> None:
    with pytest.raises(RuntimeError, match="too large for a node"):
        Simulation(replace(profile(PROMPT), max_total_tokens=PROMPT), 1, 1).run(
            [Arrival(0.0, PROMPT, OUTPUT)]
        )


def test_a_request_whose_stream_outgrows_the_pool_alone_is_aborted_as_the_engine_does() -> None:
    """Its prompt + headroom fit (admitted), the KV of its 33rd token does not and nothing else
    runs to retract: the engine aborts it (`_retract_one`), the client sees an error after 33
    tokens, no page leaks."""
    for prefill in (1, 0):
        sim = Simulation(profile(PROMPT + 32), prefill=prefill, decode=1)
        (trace,) = run(sim, 1)
        assert trace.error == "kv_pool_exhausted" and trace.output_tokens == 33
        assert "too small" in trace.error_detail and sim.retractions == 0
        sim.check_pages()


def test_a_busy_small_pool_loses_nothing_and_runs_the_same_twice() -> None:
    """Thirty requests of mixed lengths into pools of 24 pages of 16 tokens, on a shared host:
    many retractions, yet every request ends with its whole output, no page is left in use
    (`run` checks), and a second run gives the same streams and counts (deterministic)."""
    arrivals = [Arrival(0.1 * i, 40 + (37 * i) % 120, 20 + (53 * i) % 150) for i in range(30)]
    for prefill, decode in ((1, 1), (0, 2), (1, 2)):
        results = []
        for _ in range(2):
            sim = Simulation(profile(384, page_size=16), prefill, decode, HostConfig(host_cores=1))
            traces = sim.run(arrivals)
            assert [t.output_tokens for t in traces] == [a.output_len for a in arrivals]
            assert all(t.ok for t in traces)
            results.append(([t.chunks for t in traces], sim.retractions))
        assert results[0] == results[1] and results[0][1] > 0
