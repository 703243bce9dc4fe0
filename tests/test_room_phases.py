"""The node roles' room phases: the table of moves is the one in each module's docstring, and
`PhaseTable` refuses any move the table does not list."""

from __future__ import annotations

import re
from types import ModuleType

import pytest
import torch

import decode_node.rooms
import prefill_node.rooms
from decode_node.rooms import DECODE_MOVES, DecodeEntry, DecodePhase
from engine.node.phases import IllegalMove, PhaseTable
from engine.request import Req
from engine.sampling import SamplingParams
from prefill_node.rooms import PREFILL_MOVES, PrefillPhase

ARROW = re.compile(r"^\s+([A-Z]+)\s+->\s+([A-Z]+|\(gone\))", re.MULTILINE)


def documented_moves(module: ModuleType) -> set[tuple[str, str | None]]:
    assert module.__doc__
    return {(src, None if dst == "(gone)" else dst) for src, dst in ARROW.findall(module.__doc__)}


@pytest.mark.parametrize(
    "module, moves",
    [(prefill_node.rooms, PREFILL_MOVES), (decode_node.rooms, DECODE_MOVES)],
    ids=["prefill", "decode"],
)
def test_the_docstring_lists_exactly_the_moves_of_the_table(module, moves) -> None:  # type: ignore[no-untyped-def]
    table = {(src.name, dst.name if dst else None) for src, dsts in moves.items() for dst in dsts}
    assert documented_moves(module) == table


def entry(room: int, phase: DecodePhase = DecodePhase.PREALLOC) -> DecodeEntry:
    req = Req(rid=f"r{room}", prompt_ids=[1, 2, 3], params=SamplingParams(), sampler=None)  # type: ignore[arg-type]
    req.room = room
    return DecodeEntry(req, phase, since=0.0)


def test_phase_table_moves_only_along_the_table_and_times_each_phase() -> None:
    now = [10.0]
    rooms: PhaseTable[DecodePhase, DecodeEntry] = PhaseTable(DECODE_MOVES, lambda: now[0])
    first, second = entry(1), entry(2)
    rooms.add(first)
    rooms.add(second)
    assert first.since == 10.0 and rooms.in_phase(DecodePhase.PREALLOC) == [first, second]
    with pytest.raises(IllegalMove, match="room 1: PREALLOC -> QUARANTINE is no move"):
        rooms.move(first, DecodePhase.QUARANTINE)
    assert first.phase is DecodePhase.PREALLOC  # a refused move changes nothing
    now[0] = 12.0
    rooms.move(first, DecodePhase.TRANSFER)
    assert first.since == 12.0 and rooms.counts()[DecodePhase.TRANSFER] == 1
    now[0] = 13.0
    rooms.restart_timer(first)
    assert first.since == 13.0 and first.phase is DecodePhase.TRANSFER
    rooms.move(first, None)
    assert 1 not in rooms and len(rooms) == 1 and rooms.find("r2") is second
    with pytest.raises(IllegalMove, match="room 2 is already held"):
        rooms.add(entry(2))


def can_leave(moves, phase, seen=()) -> bool:  # type: ignore[no-untyped-def]
    """A room in `phase` can reach the end (None) along `moves`."""
    return None in moves[phase] or any(
        can_leave(moves, nxt, (*seen, phase)) for nxt in moves[phase] if nxt and nxt not in seen
    )


def test_every_phase_has_a_way_out() -> None:
    """No phase is a dead end, and every phase of each role has its row in the table."""
    for moves in (PREFILL_MOVES, DECODE_MOVES):
        assert all(can_leave(moves, phase) for phase in moves), moves
    assert set(PREFILL_MOVES) == set(PrefillPhase) and set(DECODE_MOVES) == set(DecodePhase)


def test_scheduler_hand_offs_keep_every_page_accounted_for(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """The roles' hand-offs on a real scheduler: a prefill node's request is parked at its
    first token, a decode node's holds its prompt's pages parked until its KV is in, and both
    count as live (integrity) until `release` gives their pages back."""
    from engine.builder import build_engine
    from engine.config import EngineConfig
    from engine.sampling import RequestSampler

    engine = build_engine(EngineConfig(str(tiny_model_dir("llama"))))
    scheduler, vocab = engine.scheduler, engine.model_config.vocab_size

    def request(rid: str, after_prefill: bool = False) -> Req:
        ids, params = list(range(3, 43)), SamplingParams(max_new_tokens=4)
        req = Req(rid, ids, params, RequestSampler(params, ids, vocab, torch.device("cpu")))
        req.stop_after_prefill = after_prefill
        return req

    prefill = request("p", after_prefill=True)
    scheduler.add_request(prefill)
    steps = 0
    while not (taken := scheduler.take_prefilled()):
        scheduler.step()
        steps += 1
        assert steps < 10
    assert taken == [prefill] and scheduler.take_prefilled() == []
    assert prefill not in scheduler.running and prefill in scheduler.live_requests()
    assert prefill.pages and len(prefill.output_ids) == 1
    scheduler.check_integrity()

    decode = request("d")
    assert scheduler.hold_prompt(decode)
    assert decode not in scheduler.running and decode in scheduler.live_requests()
    scheduler.check_integrity()
    decode.kv_len = len(decode.prompt_ids)  # what the decode role does once P's KV is in
    decode.output_ids.append(7)
    decode.output_logprobs.append(None)
    decode.output_top_logprobs.append(None)
    decode.sampler.adopt(7)
    scheduler.resume(decode)
    scheduler.step()
    assert len(decode.output_ids) == 2 and decode in scheduler.running

    scheduler.release(prefill, cache=True)
    assert scheduler.abort("d") is decode
    scheduler.check_integrity()
    allocator = scheduler.kv.allocator
    assert scheduler.live_requests() == [] and allocator.num_used == 0
