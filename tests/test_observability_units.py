"""The pieces of observability that need no process: the log format (text and JSON, where the
room comes from), a node's timing spans, and the gateway's timeline arithmetic."""

from __future__ import annotations

import json
import logging

from bootstrap.telemetry import JsonFormatter, RoomFilter, TextFormatter, current_room
from engine.node.service import timing_to_proto
from engine.timing import RequestTiming
from gateway.dispatch.timeline import SEGMENTS, assemble
from proto import node_pb2


def _record(message: str, room: int | None = None) -> logging.LogRecord:
    record = logging.LogRecord("pdserve.prefill", logging.WARNING, __file__, 1, message, (), None)
    if room is not None:
        record.room = room
    RoomFilter().filter(record)
    return record


def test_text_lines_are_time_level_component_room_message() -> None:
    line = TextFormatter().format(_record("KV write failed", room=42))
    stamp, level, component, room, message = line.split(" ", 4)
    assert stamp.endswith("Z") and "T" in stamp
    assert (level, component, room, message) == ("WARNING", "prefill", "room=42", "KV write failed")
    assert TextFormatter().format(_record("idle")).split(" ")[3] == "room=-"


def test_room_comes_from_extra_then_context_then_message() -> None:
    assert _record("x", room=7).room == 7
    token = current_room.set(9)
    try:
        assert _record("room 5 closed").room == 9
    finally:
        current_room.reset(token)
    assert _record("room 5 (prefill p -> decode d) closed").room == 5
    assert _record("no room here").room == 0


def test_json_lines_carry_the_same_fields() -> None:
    obj = json.loads(JsonFormatter().format(_record("hello", room=3)))
    assert obj["level"] == "WARNING"
    assert obj["component"] == "prefill"
    assert obj["room"] == 3
    assert obj["message"] == "hello"
    assert json.loads(JsonFormatter().format(_record("idle")))["room"] is None


def test_node_spans_from_marks() -> None:
    p = RequestTiming(arrived=1.0, destination=1.5, scheduled=1.75, first_token=2.0)
    p.transfer_done, p.finished = 2.5, 2.5
    msg = timing_to_proto(p)
    assert (msg.bootstrap_wait_s, msg.queue_s, msg.prefill_s, msg.transfer_s) == (
        0.5, 0.25, 0.25, 0.5,
    )  # fmt: skip
    assert msg.first_decode_s == 0 and msg.decode_s == 0
    d = RequestTiming(arrived=1.0, published=1.25, kv_arrived=2.75, admitted=3.0, first_token=3.0)
    d.second_token, d.finished = 3.5, 4.0
    msg = timing_to_proto(d)
    assert (msg.prealloc_s, msg.kv_wait_s, msg.admit_s) == (0.25, 1.5, 0.25)
    assert (msg.first_decode_s, msg.decode_s, msg.total_s) == (0.5, 0.5, 3.0)
    assert msg.queue_s == 0 and msg.prefill_s == 0  # no local prefill


def test_timeline_segments_are_the_published_names_in_order() -> None:
    assert SEGMENTS == (
        "gateway_queue",
        "prefill_bootstrap_wait",
        "prefill_queue",
        "prefill",
        "transfer",
        "decode_queue",
        "decode_first",
        "decode",
        "rpc",
    )


def test_timeline_segments_tile_the_e2e() -> None:
    prefill = node_pb2.PrefillResponse(
        timing=node_pb2.NodeTiming(
            bootstrap_wait_s=0.5, queue_s=0.25, prefill_s=0.25, transfer_s=0.5
        )
    )
    d_spans = dict(prealloc_s=0.25, kv_wait_s=1.75, admit_s=0.25, first_decode_s=0.5, decode_s=0.5)
    finished = node_pb2.Finished(timing=node_pb2.NodeTiming(**d_spans, total_s=3.25))
    t = assemble(started=10.0, sent=10.5, done=14.0, finished=finished, prefill=prefill)
    assert t.gateway_queue == 0.5 and t.e2e == 4.0
    assert t.transfer == 2.0 - (0.5 + 0.25 + 0.25)  # D waited 2 s for KV, P computed 1 s
    assert t.rpc == 3.5 - 3.25
    assert abs(t.segments_total - t.e2e) < 1e-12
    assert set(t.as_dict()) == {*SEGMENTS, "e2e", "transfer_kv"}
    header = t.server_timing()
    assert header.startswith("gateway_queue;dur=500.000, prefill_bootstrap_wait;dur=500.000")
    d_local = node_pb2.NodeTiming(
        queue_s=0.1, prefill_s=0.2, first_decode_s=0.3, decode_s=0.4, total_s=1.0
    )
    local = assemble(10.0, 10.5, 12.0, node_pb2.Finished(timing=d_local), None)
    assert (local.prefill_queue, local.prefill, local.decode_queue) == (0.1, 0.2, 0.0)
    assert local.transfer == 0 and abs(local.rpc - 0.5) < 1e-12
    assert abs(local.segments_total - local.e2e) < 1e-12
