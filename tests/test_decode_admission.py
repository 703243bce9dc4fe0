"""A decode node's prealloc admission against the scheduler's own queue (decode_node/decode_role.py
`_admit`): a request the scheduler retracted for want of pages resumes before any new room is
given pages, so that steady arrivals cannot keep it waiting. Real scheduler and KV pool of a
tiny model; the bootstrap link only records the destinations posted."""

from __future__ import annotations

from pathlib import Path

from decode_node.decode_role import DecodeRole, DecodeRoleConfig
from decode_node.rooms import DecodeEntry, DecodePhase
from engine.builder import build_engine
from engine.config import EngineConfig
from engine.request import Req
from engine.sampling import SamplingParams
from kvtransfer.aux import AuxBuffer


class RecordingLink:
    node_id = "decode-1"
    epoch = 1

    def __init__(self) -> None:
        self.posted: list[object] = []

    def post_destination(self, dest: object) -> None:
        self.posted.append(dest)


def _req(rid: str, room: int = 0) -> Req:
    req = Req(rid=rid, prompt_ids=[1] * 20, params=SamplingParams(), sampler=None)  # type: ignore[arg-type]
    req.room, req.peer_node_id = room, "prefill-1" if room else ""
    return req


def test_a_retracted_request_resumes_before_new_rooms_get_pages(tiny_model_dir) -> None:
    engine = build_engine(EngineConfig(str(Path(tiny_model_dir("llama"))), max_total_tokens=256))
    scheduler = engine.scheduler
    link = RecordingLink()
    role = DecodeRole(DecodeRoleConfig(), link, AuxBuffer(4), page_size=16)  # type: ignore[arg-type]
    room = _req("new-room", room=7)
    role.rooms.add(DecodeEntry(room, DecodePhase.PREALLOC, 0.0))
    retracted = _req("retracted")
    retracted.num_retractions = 1
    scheduler.waiting.append(retracted)

    role._admit(scheduler)
    assert link.posted == [] and [e.req for e in role.rooms.in_phase(DecodePhase.PREALLOC)] == [
        room
    ]

    scheduler.waiting.clear()  # the retracted request was admitted again
    role._admit(scheduler)
    assert len(link.posted) == 1 and role.rooms.in_phase(DecodePhase.PREALLOC) == []
    assert [e.req for e in role.rooms.in_phase(DecodePhase.TRANSFER)] == [room]
