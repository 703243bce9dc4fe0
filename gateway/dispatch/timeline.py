"""A request's timing breakdown: where its end-to-end time went, in consecutive segments.

The gateway measures, on its own clock, when the HTTP request came in (`RequestTrace.started`),
when the attempt that served it sent its node RPCs (`sent`) and when both calls were over
(`done`: the decode node's final message and the prefill node's answer are in). The nodes
measure their own spans (engine/timing.py) and send them back (PrefillResponse.timing,
Finished.timing). The segments, in order:

    gateway_queue           HTTP request in -> node RPCs sent (parsing, tokenising, routing,
                            earlier failed attempts)
    prefill_bootstrap_wait  P: request in -> D's destination arrived through bootstrap and
                            taken at P's next step boundary (a busy P: up to one step)
    prefill_queue           P's waiting queue (a local prefill: D's) -> first chunk scheduled
    prefill                 first chunk -> first token sampled (all chunks)
    transfer                what D waited for the KV beyond P's three spans above: P's KV
                            writes until confirmed and the DONE hand-off through bootstrap
                            (D's prealloc + KV wait minus them; 0 for a local prefill).
                            `transfer_kv` is P's own measure of the writes alone.
    decode_queue            D: P's DONE arrived -> the request joined the running batch
    decode_first            D: in the batch -> first decoded token
    decode                  D: first decoded token -> finished
    rpc                     [sent, done] outside D's own span: the gateway <-> node hops, and
                            waiting for P's answer after D finished

D's spans tile its own [in, finished] and `rpc` is the rest of [sent, done], so the segments add
up to `e2e` (in -> done); tests check that against the E2E a client measures. Spans measured on
P and on D are compared as durations only (the two nodes may not share a clock); `transfer`
assumes both got the request at the same time (the gateway sends both calls at once).
The OpenAI API sends the breakdown as a `Server-Timing` header (milliseconds), the native API in
`meta_info.timing` (seconds).
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import asdict, dataclass, field, fields

from proto import node_pb2


@dataclass(frozen=True)
class Timeline:
    """Seconds per segment (see the module docstring), in order, plus `e2e` and `transfer_kv`."""

    gateway_queue: float
    prefill_bootstrap_wait: float
    prefill_queue: float
    prefill: float
    transfer: float
    decode_queue: float
    decode_first: float
    decode: float
    rpc: float
    e2e: float
    transfer_kv: float

    @property
    def segments_total(self) -> float:
        return sum(getattr(self, name) for name in SEGMENTS)

    def as_dict(self) -> dict[str, float]:
        return {name: round(value, 6) for name, value in asdict(self).items()}

    def server_timing(self) -> str:
        """The `Server-Timing` header value: `name;dur=<ms>` per field."""
        return ", ".join(f"{f.name};dur={getattr(self, f.name) * 1000:.3f}" for f in fields(self))


# The fields that tile `e2e`, in order: all but `e2e` and `transfer_kv` (P's measure of its writes).
SEGMENTS = tuple(f.name for f in fields(Timeline) if f.name not in ("e2e", "transfer_kv"))


def assemble(
    started: float,
    sent: float,
    done: float,
    finished: node_pb2.Finished,
    prefill: node_pb2.PrefillResponse | None,
) -> Timeline:
    """The timeline of one choice; `prefill` is None when the decode node prefilled it."""
    d = finished.timing
    if prefill is not None:
        p = prefill.timing
        wait, queue, compute, kv = p.bootstrap_wait_s, p.queue_s, p.prefill_s, p.transfer_s
        transfer = d.prealloc_s + d.kv_wait_s - (wait + queue + compute)
        decode_queue = d.admit_s
    else:
        wait, queue, compute, kv = 0.0, d.queue_s, d.prefill_s, 0.0
        transfer = decode_queue = 0.0
    return Timeline(
        gateway_queue=sent - started,
        prefill_bootstrap_wait=wait,
        prefill_queue=queue,
        prefill=compute,
        transfer=transfer,
        decode_queue=decode_queue,
        decode_first=d.first_decode_s,
        decode=d.decode_s,
        rpc=(done - sent) - d.total_s,
        e2e=done - started,
        transfer_kv=kv,
    )


@dataclass
class RequestTrace:
    """One HTTP request: when it came in, and the timelines of its finished choices."""

    started: float = field(default_factory=time.monotonic)
    timelines: list[Timeline] = field(default_factory=list)

    def slowest(self) -> Timeline | None:
        """The choice that ended last: the one the client waited for."""
        return max(self.timelines, key=lambda t: t.e2e, default=None)


# Set by the HTTP layer for the request it serves; choices (in child tasks too) add to it.
current_trace: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "pdserve_trace", default=None
)
