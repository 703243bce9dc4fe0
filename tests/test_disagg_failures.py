"""Prefill/decode disaggregation when things go wrong (docs/architecture.md, failure semantics).

Real bootstrap, prefill-server and decode-server processes on 127.0.0.1 with a real transfer
engine (Mooncake over TCP, NIXL over UCX); dying processes get a real SIGKILL. Every case checks
the same three promises:

- the request ends with a clear error: on the decode side the Generate stream's `Finished` has
  finish_reason "abort" and a detail naming the room and the node(s); on the prefill side the
  Prefill RPC fails with the room (and the decode node) in its details;
- every surviving node ends idle with no page in use and a clean integrity check;
- the nodes keep serving: a normal request through the pair afterwards matches the decode node
  prefilling the same prompt itself (colocated).

Cases: 1 D never gets a P, 2 P never gets a D, 3 P dies mid-transfer (with 7: D keeps the pages
of a room it gave up until the frozen P is known dead), 4 D dies while P sends, 5 abort on
either side, 6 failed KV writes (all of them, then 30% under concurrency). Then: a prefill
node frozen past the heartbeat timeout must fence itself (no writes after its lease ran out),
P's connection to bootstrap reset mid-prefill (bootstrap replays the destination,
at-least-once), and the prefill role's side of the late-write rule driven with fakes (a
replayed destination; a cancel that arrives while the last writes are in flight).

One module-scoped fleet per backend (one bootstrap, named nodes on it) is shared by all cases:
the tiny llama with 65536 positions, so a 4000-token prompt in 32-token chunks keeps the prefill
node busy for over a hundred steps and "mid-prefill" is a matter of ordering (act once P's log
shows the first prefill batch), not of timing. Those steps take about a second in all, so a
test freezes or kills its node right then and waits for anything else afterwards. A test that
kills a node kills one it owns (`prefill-victim`, `decode-short`), which the fleet starts
again when a later test needs it.
Nothing here asserts how fast anything is; timeouts only guard against hangs.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from engine.layer_groups import GroupDone
from engine.request import FinishReason, Req
from engine.sampling import SamplingParams
from gateway.dispatch.pd_client import new_room
from gateway.process.launcher import ServerProcess as NodeServer
from gateway.process.launcher import bootstrap_ready, node_registered, running_node
from kvtransfer.aux import AuxBuffer
from kvtransfer.base import (
    MemoryRegion,
    PeerInfo,
    TransferError,
    TransferHandle,
    TransferRange,
    TransferState,
)
from kvtransfer.head_routes import NodeKV
from kvtransfer.room import RoomDestination, RoomState, RoomStatus
from prefill_node.layer_stream import StreamConfig
from prefill_node.prefill_role import PrefillRole, PrefillRoleConfig
from prefill_node.rooms import PrefillPhase
from proto import node_pb2

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback only; the servers inherit it
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

BACKENDS = ["mooncake", "nixl"]
RPC_TIMEOUT = 120.0  # only against hangs
WAIT_TIMEOUT = 60.0
HEARTBEAT_TIMEOUT = 3.0  # bootstrap declares a silent node dead after this
BOOTSTRAP_TIMEOUT = 3.0  # P: wait this long for D's destination
SHORT_TRANSFER_TIMEOUT = 2.0  # `decode-short`: no KV (or progress) this long -> give up
TRANSFER_TIMEOUT = 30.0  # everyone else: longer than any case waits
CHUNK = 32
PAGE_SIZE = 16
LONG_PROMPT = 4000  # 125 chunks on the prefill node
MAX_NEW = 4

NODE_ARGS = [
    "--page-size", str(PAGE_SIZE),
    "--chunked-prefill-size", str(CHUNK),
    "--bootstrap-timeout", str(BOOTSTRAP_TIMEOUT),
    "--transfer-timeout", str(TRANSFER_TIMEOUT),
]  # fmt: skip
# name -> (script, extra args); later flags override NODE_ARGS.
FLEET: dict[str, tuple[str, list[str]]] = {
    "decode": ("decode-server", []),
    "decode-short": ("decode-server", ["--transfer-timeout", str(SHORT_TRANSFER_TIMEOUT)]),
    "prefill": ("prefill-server", []),
    "prefill-victim": ("prefill-server", []),
    "prefill-fail-all": ("prefill-server", ["--inject-transfer-failures", "1.0"]),
    "prefill-fail-some": ("prefill-server", ["--inject-transfer-failures", "0.3"]),
}


def greedy(max_new_tokens: int = MAX_NEW) -> node_pb2.SamplingParams:
    return node_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# ---- the fleet -------------------------------------------------------------------------------


@dataclass
class FleetNode:
    server: NodeServer
    node_id: str
    context: AbstractContextManager[NodeServer]

    @property
    def alive(self) -> bool:
        return self.server.process.poll() is None


class Fleet:
    """One bootstrap-server and the named nodes of `FLEET` registered with it.

    `ensure(...)` starts the named nodes that are not running, in parallel to shorten start-up,
    so a test that killed a node leaves the next user a fresh one.
    """

    def __init__(self, tmp: Path, model: Path, backend: str, pool: ThreadPoolExecutor) -> None:
        self.tmp = tmp
        self.model = model
        self.backend = backend
        self.pool = pool
        self.nodes: dict[str, FleetNode] = {}
        self._bootstrap_cm = running_node(
            "bootstrap-server",
            ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--heartbeat-interval", "0.5"],
            tmp / "bootstrap.log",
            probe=bootstrap_ready,
        )
        self.bootstrap = self._bootstrap_cm.__enter__()

    def ensure(self, *names: str) -> None:
        dead = [n for n in names if n not in self.nodes or not self.nodes[n].alive]
        for name in dead:
            if name in self.nodes:
                self.nodes.pop(name).context.__exit__(None, None, None)
        starts = {name: self.pool.submit(self._start, name) for name in dead}
        errors = []
        for name, future in starts.items():
            try:
                self.nodes[name] = future.result()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def _start(self, name: str) -> FleetNode:
        script, extra = FLEET[name]
        args = ["--model", str(self.model), "--bootstrap", self.bootstrap.address]
        args += ["--transfer-backend", self.backend, *NODE_ARGS, *extra]
        if script == "decode-server":
            args = ["--mode", "disaggregated", *args]
        context = running_node(script, args, self.tmp / f"{name}.log", probe=node_registered)
        server = context.__enter__()
        try:
            health = server.stub.Health(node_pb2.HealthRequest(), timeout=RPC_TIMEOUT)
        except BaseException:
            context.__exit__(None, None, None)
            raise
        return FleetNode(server, health.node_id, context)

    def __getitem__(self, name: str) -> NodeServer:
        return self.nodes[name].server

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def close(self) -> None:
        stops = [
            self.pool.submit(node.context.__exit__, None, None, None)
            for node in self.nodes.values()
        ]
        for future in stops:
            future.result()
        self.nodes.clear()
        self._bootstrap_cm.__exit__(None, None, None)

    # ---- checks shared by the cases --------------------------------------------------------

    def assert_idle(self, *names: str) -> None:
        """No request left and no page in use (cached prefix pages are fine), integrity ok."""
        for name in names:
            check = self[name].wait_idle(timeout=WAIT_TIMEOUT)
            assert check.ok, f"{name}: {check.error}"
            assert check.used_pages == 0, f"{name}: {check.used_pages} pages leaked"
            total = check.free_pages + check.used_pages + check.cached_pages
            assert total == check.total_pages, f"{name}: {check}"

    def assert_pair_serves(self, prefill: str = "prefill", decode: str = "decode") -> None:
        """A normal request through the pair gives what the decode node computes by itself."""
        ids = prompt(40, seed=1)
        outcome = run_pd(self, prefill, decode, ids)
        assert outcome.finished is not None, outcome.decode_error
        assert outcome.finished.finish_reason == "length", outcome.finished.detail
        assert outcome.prefill_error is None, outcome.prefill_error
        assert outcome.token_ids == colocated(self[decode], ids)
        self.assert_idle(prefill, decode)


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=32, thread_name_prefix="pd-failures") as executor:
        yield executor


@pytest.fixture(scope="module", params=BACKENDS)
def fleet(
    request: pytest.FixtureRequest,
    long_context_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    pool: ThreadPoolExecutor,
) -> Iterator[Fleet]:
    backend: str = request.param
    fleet = Fleet(tmp_path_factory.mktemp(f"fleet-{backend}"), long_context_model, backend, pool)
    try:
        fleet.ensure(*FLEET)
        yield fleet
    finally:
        fleet.close()


# ---- requests --------------------------------------------------------------------------------


@dataclass
class PDOutcome:
    """What both sides of one disaggregated request said."""

    room: int
    rid: str
    token_ids: list[int] = field(default_factory=list)
    finished: node_pb2.Finished | None = None
    decode_error: grpc.RpcError | None = None  # the Generate stream itself broke
    prefill: node_pb2.PrefillResponse | None = None
    prefill_error: grpc.RpcError | None = None

    @property
    def ok(self) -> bool:
        return self.finished is not None and self.finished.finish_reason != "abort"


@dataclass
class PDCall:
    """One request in flight: Generate(room) on D and Prefill(room) on P, at the same time."""

    outcome: PDOutcome
    decode: Future[None] | None
    prefill: Future[None] | None

    def result(self) -> PDOutcome:
        for future in (self.decode, self.prefill):
            if future is not None:
                future.result(timeout=RPC_TIMEOUT)
        return self.outcome

    def decode_result(self) -> PDOutcome:
        """Once D's stream ended; P's call may still run."""
        assert self.decode is not None
        self.decode.result(timeout=RPC_TIMEOUT)
        return self.outcome


def start_pd(
    fleet: Fleet,
    prefill: str,
    decode: str,
    ids: list[int],
    *,
    send_decode: bool = True,
    send_prefill: bool = True,
) -> PDCall:
    room = new_room()
    outcome = PDOutcome(room=room, rid=f"room-{room}")
    d_future = p_future = None
    if send_decode:
        request = node_pb2.GenerateRequest(
            rid=outcome.rid,
            input_ids=ids,
            sampling=greedy(),
            bootstrap_room=room,
            prefill_node_id=fleet.node_id(prefill),
        )
        stream = fleet[decode].stub.Generate(request, timeout=RPC_TIMEOUT)
        d_future = fleet.pool.submit(_read_stream, stream, outcome)
    if send_prefill:
        p_request = node_pb2.PrefillRequest(
            rid=outcome.rid,
            input_ids=ids,
            sampling=greedy(),
            bootstrap_room=room,
            decode_node_id=fleet.node_id(decode),
        )
        p_future = fleet.pool.submit(_call_prefill, fleet[prefill], p_request, outcome)
    return PDCall(outcome, d_future, p_future)


def run_pd(fleet: Fleet, prefill: str, decode: str, ids: list[int]) -> PDOutcome:
    return start_pd(fleet, prefill, decode, ids).result()


def _read_stream(stream: Iterator[node_pb2.GenerateResponse], outcome: PDOutcome) -> None:
    try:
        for message in stream:
            assert outcome.finished is None, f"a message after Finished: {message}"
            if message.HasField("chunk"):
                outcome.token_ids.extend(message.chunk.token_ids)
            else:
                outcome.finished = message.finished
    except grpc.RpcError as exc:
        outcome.decode_error = exc
        return
    assert outcome.finished is not None, "the stream ended without Finished"


def _call_prefill(server: NodeServer, request: node_pb2.PrefillRequest, outcome: PDOutcome) -> None:
    try:
        outcome.prefill = server.stub.Prefill(request, timeout=RPC_TIMEOUT)
    except grpc.RpcError as exc:
        outcome.prefill_error = exc


def colocated(server: NodeServer, ids: list[int]) -> list[int]:
    """The decode node prefilling the prompt itself (no room)."""
    request = node_pb2.GenerateRequest(input_ids=ids, sampling=greedy())
    tokens: list[int] = []
    finished = None
    for message in server.stub.Generate(request, timeout=RPC_TIMEOUT):
        if message.HasField("chunk"):
            tokens.extend(message.chunk.token_ids)
        else:
            finished = message.finished
    assert finished is not None and finished.finish_reason == "length", finished
    return tokens


def abort(server: NodeServer, rid: str) -> None:
    response = server.stub.Abort(node_pb2.AbortRequest(rid=rid), timeout=RPC_TIMEOUT)
    assert response.found


# ---- what the errors must say ----------------------------------------------------------------


def assert_decode_failed(outcome: PDOutcome, *node_ids: str) -> str:
    """D's stream ended with an abort whose detail names the room and the given nodes."""
    assert outcome.decode_error is None, outcome.decode_error
    finished = outcome.finished
    assert finished is not None and finished.finish_reason == "abort", finished
    for word in (f"room {outcome.room}", *node_ids):
        assert word in finished.detail, f"{word!r} not in {finished.detail!r}"
    return finished.detail


def assert_prefill_failed(outcome: PDOutcome, *node_ids: str) -> str:
    """P's Prefill call failed with the room and the given nodes in its details."""
    assert outcome.prefill is None, outcome.prefill
    error = outcome.prefill_error
    assert error is not None
    assert error.code() == grpc.StatusCode.ABORTED, f"{error.code()}: {error.details()}"
    details = error.details() or ""
    for word in (f"room {outcome.room}", *node_ids):
        assert word in details, f"{word!r} not in {details!r}"
    return details


# ---- logs ------------------------------------------------------------------------------------


def log_size(server: NodeServer) -> int:
    return server.log_path.stat().st_size


def log_since(server: NodeServer, offset: int) -> str:
    with server.log_path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def wait_for_log(server: NodeServer, offset: int, found: Callable[[str], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_TIMEOUT
    while not found(log_since(server, offset)):
        assert server.process.poll() is None, f"{what}: the server exited\n{server.log_tail()}"
        assert time.monotonic() < deadline, f"no {what} in the log\n{server.log_tail()}"
        time.sleep(0.01)


def wait_first_prefill_batch(server: NodeServer, offset: int) -> None:
    """The prefill node computed the first chunk of a long prompt (its pages go out next)."""
    wait_for_log(server, offset, lambda text: "prefill batch" in text, "prefill batch")


def wait_delivered(bootstrap: NodeServer, offset: int, room: int) -> None:
    """Bootstrap handed the room's destination to P: P may be writing into D's pages now."""

    def delivered(text: str) -> bool:
        return any(f"room {room} (" in ln and "delivered to P" in ln for ln in text.splitlines())

    wait_for_log(bootstrap, offset, delivered, f"delivery of room {room}")


# ---- 1. D never gets a P ---------------------------------------------------------------------


def test_decode_never_gets_prefill(fleet: Fleet) -> None:
    """Generate(room) reaches D, Prefill never reaches P. Both orders of the two timeouts:

    - `decode-short`: D's transfer timeout (2 s) fires first; D gives the room up while P holds
      the destination without a request, P confirms at once that it never writes, D frees.
    - `decode`: P's bootstrap timeout (3 s) fires first; P confirms the unclaimed destination
      as unused (FAILED), D ends the request with that and frees.
    """
    fleet.ensure("decode", "decode-short", "prefill")
    p_id = fleet.node_id("prefill")
    ids = prompt(50, seed=2)
    first = start_pd(fleet, "prefill", "decode-short", ids, send_prefill=False)
    second = start_pd(fleet, "prefill", "decode", ids, send_prefill=False)

    detail = assert_decode_failed(first.result(), fleet.node_id("decode-short"), p_id)
    assert "timeout" in detail, detail
    detail = assert_decode_failed(second.result(), fleet.node_id("decode"), p_id)
    assert "no prefill request" in detail, detail
    fleet.assert_idle("decode-short", "decode", "prefill")
    fleet.assert_pair_serves()


# ---- 2. P never gets D -----------------------------------------------------------------------


def test_prefill_never_gets_decode(fleet: Fleet) -> None:
    """Prefill(room) reaches P, Generate never reaches D: P fails after its bootstrap timeout."""
    fleet.ensure("decode", "prefill")
    call = start_pd(fleet, "prefill", "decode", prompt(50, seed=3), send_decode=False)
    details = assert_prefill_failed(call.result(), fleet.node_id("decode"))
    assert "bootstrap timeout" in details, details
    fleet.assert_idle("prefill", "decode")
    fleet.assert_pair_serves()


# ---- 7. late writes from a prefill node declared dead ------------------------------------------
# (before case 3, which kills the same `prefill-victim`, so the fleet starts it only once)


def greedy_logprobs(server: NodeServer, ids: list[int]) -> tuple[list[float], int]:
    """A colocated greedy run's logprobs (fp32 on CPU: the same KV gives the same floats) and
    how many prompt tokens came from the prefix cache."""
    sampling = node_pb2.SamplingParams(
        max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True
    )
    request = node_pb2.GenerateRequest(input_ids=ids, sampling=sampling)
    logprobs: list[float] = []
    cached = -1
    for message in server.stub.Generate(request, timeout=RPC_TIMEOUT):
        if message.HasField("chunk"):
            logprobs.extend(lp.logprob for lp in message.chunk.logprobs)
        else:
            assert message.finished.finish_reason == "length", message.finished
            cached = message.finished.usage.cached_tokens
    return logprobs, cached


def test_prefill_frozen_past_heartbeat_timeout(fleet: Fleet) -> None:
    """P freezes (SIGSTOP) mid-prefill for longer than the heartbeat timeout: bootstrap declares
    it dead and D fails the request, but a frozen P's transfer engine finishes the writes it had
    started when P wakes up, so D keeps the room's pages until P confirms it stopped. A request
    D runs meanwhile (its KV stays in D's prefix cache) is unharmed by P's late writes: reusing
    that cache gives the logprobs of a clean run. P's Prefill fails naming the room."""
    fleet.ensure("decode", "prefill-victim")
    victim, decode = fleet["prefill-victim"], fleet["decode"]
    p_id, d_id = fleet.node_id("prefill-victim"), fleet.node_id("decode")
    p_offset, b_offset, d_offset = log_size(victim), log_size(fleet.bootstrap), log_size(decode)
    call = start_pd(fleet, "prefill-victim", "decode", prompt(LONG_PROMPT, seed=50))
    wait_first_prefill_batch(victim, p_offset)
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        assert_decode_failed(call.decode_result(), p_id, d_id)  # P is dead to bootstrap and D
        held = decode.integrity().used_pages
        assert held >= LONG_PROMPT // PAGE_SIZE, f"D freed the room's pages ({held} in use)"
        cached_prompt = [7] * 1000
        colocated(decode, cached_prompt)  # its KV stays cached on D
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    outcome = call.result()  # P carried on with the room
    reused, cached_tokens = greedy_logprobs(decode, cached_prompt)
    assert cached_tokens >= 900, cached_tokens  # the run above read the cached pages
    decode.stub.FlushCache(node_pb2.FlushCacheRequest(), timeout=RPC_TIMEOUT)
    clean, _ = greedy_logprobs(decode, cached_prompt)
    fleet.assert_idle("decode", "prefill-victim")
    assert reused == clean, "P's late writes changed KV pages D had given to another request"
    assert_prefill_failed(outcome, d_id)
    assert f"prefill node {p_id} stopped writing" in log_since(fleet.bootstrap, b_offset)
    assert "freeing quarantined pages" not in log_since(decode, d_offset)


# ---- 3. P dies mid-transfer (and 7. no early free) -------------------------------------------


def test_prefill_dies_mid_transfer(fleet: Fleet) -> None:
    """SIGKILL P while it writes a long prompt: bootstrap declares P dead, D ends the request
    with an error naming the room and P, frees its pages and keeps serving.

    Late writes (case 7): a second room whose destination P holds is given up by D (client
    abort) while P is frozen (SIGSTOP) so it cannot confirm. D must keep those pages until P is
    known dead: right after the abort they are still in use unless bootstrap already declared
    P dead, and they are freed on bootstrap's word, not by the quarantine expiry.
    """
    fleet.ensure("decode", "prefill-victim", "prefill")
    victim, decode = fleet["prefill-victim"], fleet["decode"]
    p_id, d_id = fleet.node_id("prefill-victim"), fleet.node_id("decode")
    p_offset, b_offset = log_size(victim), log_size(fleet.bootstrap)
    d_offset = log_size(decode)
    writing = start_pd(fleet, "prefill-victim", "decode", prompt(LONG_PROMPT, seed=4))
    queued = start_pd(fleet, "prefill-victim", "decode", prompt(LONG_PROMPT, seed=5))
    wait_first_prefill_batch(victim, p_offset)
    # Freeze P at once: on a calm host it computes a chunk in about 8 ms, the whole prompt in
    # a second or two, and any wait before the freeze (the second room's delivery was one) is
    # time in which P may finish the room it is to die in. Bootstrap hands a frozen P its
    # destinations all the same (they wait in P's socket).
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        for call in (writing, queued):  # D holds both rooms' pages
            wait_delivered(fleet.bootstrap, b_offset, call.outcome.room)
        held = decode.integrity().used_pages
        assert held >= 2 * LONG_PROMPT // PAGE_SIZE  # both rooms' destinations
        abort(decode, queued.outcome.rid)
        given_up = queued.decode_result()  # P's side ends when P is killed below
        assert given_up.finished is not None and given_up.finished.finish_reason == "abort"
        still_held = decode.integrity().used_pages
        dead_line = f"prefill node {p_id} missed heartbeats"
        p_known_dead = dead_line in log_since(fleet.bootstrap, b_offset)
        assert still_held == held or p_known_dead, (
            f"D freed the pages of room {given_up.room} ({held} -> {still_held} in use) while "
            f"prefill node {p_id} could still write into them"
        )
    finally:
        os.kill(victim.pid, signal.SIGKILL)  # case 3: P dies with a room half written

    outcome = writing.result()
    assert_decode_failed(outcome, p_id, d_id)
    assert outcome.prefill_error is not None  # the connection died with P
    fleet.assert_idle("decode")
    closed_by_death = [
        line
        for line in log_since(fleet.bootstrap, b_offset).splitlines()
        if f"room {given_up.room} (" in line and "closed FAILED" in line
    ]
    assert closed_by_death and dead_line in closed_by_death[0], closed_by_death
    assert "freeing quarantined pages" not in log_since(decode, d_offset)

    colocated(decode, prompt(30, seed=6))  # D serves without P ...
    fleet.assert_pair_serves()  # ... and with the other prefill node


# ---- 4. D dies while P is sending ------------------------------------------------------------


def test_decode_dies_while_prefill_sends(fleet: Fleet) -> None:
    """SIGKILL D while P writes a long prompt into it: P's Prefill fails naming the room and D,
    P frees everything, refuses new work for the dead D clearly and serves the live one."""
    fleet.ensure("decode-short", "prefill", "decode")
    prefill, victim = fleet["prefill"], fleet["decode-short"]
    d_id = fleet.node_id("decode-short")
    p_offset, b_offset = log_size(prefill), log_size(fleet.bootstrap)
    call = start_pd(fleet, "prefill", "decode-short", prompt(LONG_PROMPT, seed=7))
    wait_first_prefill_batch(prefill, p_offset)
    os.kill(victim.pid, signal.SIGKILL)

    outcome = call.result()
    assert outcome.decode_error is not None  # the stream died with D
    assert_prefill_failed(outcome, d_id)
    fleet.assert_idle("prefill")

    wait_for_log(fleet.bootstrap, b_offset, lambda t: f"decode node {d_id} removed" in t, "death")
    refused = start_pd(fleet, "prefill", "decode-short", prompt(20, seed=8), send_decode=False)
    error = refused.result().prefill_error
    assert error is not None
    # FAILED_PRECONDITION once P saw D leave; before that P waits for a destination in vain.
    assert error.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED)
    assert d_id in (error.details() or ""), error.details()
    fleet.assert_idle("prefill")
    fleet.assert_pair_serves()


# ---- 5. abort on either side -----------------------------------------------------------------


def test_abort_on_decode(fleet: Fleet) -> None:
    """Abort(rid) on D while the room waits for its KV: the stream ends with "abort" and D frees
    its pages once P confirmed it writes no more.

    (a) P never got the request (it holds only the destination); (b) P is mid-prefill: P stops,
    its Prefill fails naming the room and D.
    """
    fleet.ensure("decode", "prefill")
    prefill, decode = fleet["prefill"], fleet["decode"]
    b_offset = log_size(fleet.bootstrap)
    waiting = start_pd(fleet, "prefill", "decode", prompt(50, seed=9), send_prefill=False)
    wait_delivered(fleet.bootstrap, b_offset, waiting.outcome.room)
    abort(decode, waiting.outcome.rid)
    finished = waiting.result().finished
    assert finished is not None and finished.finish_reason == "abort", finished
    fleet.assert_idle("decode", "prefill")

    p_offset = log_size(prefill)
    call = start_pd(fleet, "prefill", "decode", prompt(LONG_PROMPT, seed=10))
    wait_first_prefill_batch(prefill, p_offset)
    abort(decode, call.outcome.rid)
    outcome = call.result()
    assert outcome.finished is not None and outcome.finished.finish_reason == "abort"
    assert_prefill_failed(outcome, fleet.node_id("decode"))
    fleet.assert_idle("decode", "prefill")
    fleet.assert_pair_serves()


def test_abort_on_prefill(fleet: Fleet) -> None:
    """Abort(rid) on P mid-prefill: D's stream ends with an error naming the room and P."""
    fleet.ensure("decode", "prefill")
    prefill = fleet["prefill"]
    p_offset = log_size(prefill)
    call = start_pd(fleet, "prefill", "decode", prompt(LONG_PROMPT, seed=11))
    wait_first_prefill_batch(prefill, p_offset)
    abort(prefill, call.outcome.rid)
    outcome = call.result()
    assert_decode_failed(outcome, fleet.node_id("prefill"), fleet.node_id("decode"))
    error = outcome.prefill_error
    assert error is not None and error.code() == grpc.StatusCode.ABORTED, error
    fleet.assert_idle("decode", "prefill")
    fleet.assert_pair_serves()


# ---- 6. failed KV writes ---------------------------------------------------------------------


FAULT_LENGTHS = [5, 16, 17, 40, 64, 100, 200, 333]  # one page to eleven chunks


def test_every_transfer_fails(fleet: Fleet) -> None:
    """P with every KV write failing: each request fails clearly on both sides, no leaks."""
    fleet.ensure("decode", "prefill-fail-all")
    p_id, d_id = fleet.node_id("prefill-fail-all"), fleet.node_id("decode")
    calls = [
        start_pd(fleet, "prefill-fail-all", "decode", prompt(n, seed=20 + i))
        for i, n in enumerate(FAULT_LENGTHS[::3])
    ]
    for call in calls:
        outcome = call.result()
        assert_decode_failed(outcome, p_id, d_id)
        assert "KV write" in assert_prefill_failed(outcome, d_id)
    fleet.assert_idle("decode", "prefill-fail-all")
    fleet.assert_pair_serves()


def test_some_transfers_fail_under_concurrency(fleet: Fleet) -> None:
    """P with 30% of KV writes failing, 8 requests at once: each either gives exactly the
    colocated tokens or fails clearly on both sides; no leaks."""
    fleet.ensure("decode", "prefill-fail-some")
    p_id, d_id = fleet.node_id("prefill-fail-some"), fleet.node_id("decode")
    prompts = [prompt(n, seed=30 + i) for i, n in enumerate(FAULT_LENGTHS)]
    calls = [start_pd(fleet, "prefill-fail-some", "decode", ids) for ids in prompts]
    outcomes = [call.result() for call in calls]
    for ids, outcome in zip(prompts, outcomes, strict=True):
        if outcome.ok:
            assert outcome.prefill_error is None, outcome.prefill_error
            assert outcome.token_ids == colocated(fleet["decode"], ids)
        else:
            assert_decode_failed(outcome, p_id, d_id)
            assert_prefill_failed(outcome, d_id)
    fleet.assert_idle("decode", "prefill-fail-some")
    fleet.assert_pair_serves()


# ---- the connection to bootstrap breaks --------------------------------------------------------


def reset_bootstrap_connection(node: NodeServer, bootstrap: NodeServer) -> None:
    """Kill the node's TCP connections to bootstrap (as a network blip would): its streams
    reconnect and bootstrap replays what it sent recently (at-least-once delivery)."""
    if shutil.which("ss") is None:
        pytest.skip("needs `ss` (iproute2) to reset a TCP connection")
    port = bootstrap.address.rsplit(":", 1)[1]
    listing = subprocess.run(
        ["ss", "-tnpH", "state", "established", "dport", "=", f":{port}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    local_ports = [
        line.split()[2].rsplit(":", 1)[1]
        for line in listing.splitlines()
        if f"pid={node.pid}," in line
    ]
    assert local_ports, f"no connection from pid {node.pid} to bootstrap:\n{listing}"
    for local in local_ports:
        killed = subprocess.run(
            ["ss", "-K", "-tnH", "dport", "=", f":{port}", "sport", "=", f":{local}"],
            capture_output=True,
            text=True,
        )
        if killed.returncode != 0 or local not in killed.stdout:
            pytest.skip(f"`ss -K` cannot close sockets here (root, INET_DIAG_DESTROY): {killed}")


def test_bootstrap_connection_reset_mid_prefill(fleet: Fleet) -> None:
    """P's connection to bootstrap breaks while it prefills: its streams reconnect, bootstrap
    replays the room's destination, and P must ignore the duplicate and finish the request."""
    fleet.ensure("decode", "prefill")
    prefill = fleet["prefill"]
    p_offset = log_size(prefill)
    call = start_pd(fleet, "prefill", "decode", prompt(LONG_PROMPT, seed=40))
    wait_first_prefill_batch(prefill, p_offset)
    try:
        reset_bootstrap_connection(prefill, fleet.bootstrap)
    except BaseException:  # skipped: D gives the room up, P follows
        abort(fleet["decode"], call.outcome.rid)
        call.result()
        raise
    outcome = call.result()
    fleet.assert_idle("decode")  # (a crashed P is started again by the next `ensure`)
    assert outcome.ok, outcome.finished or outcome.decode_error
    assert outcome.prefill_error is None, outcome.prefill_error
    assert prefill.process.poll() is None, prefill.log_tail()
    fleet.assert_pair_serves()


# ---- the prefill role's side of the late-write rule, with fakes --------------------------------
#
# Bootstrap delivers destinations at least once, and a cancel may reach P after its last pages
# went out but before the writes finished. Neither can be timed end to end, so these drive the
# real `PrefillRole` with a fake link, transfer engine and scheduler.

ROOM = 7
DEST = RoomDestination(
    room=ROOM,
    decode_node_id="decode-1",
    prefill_node_id="prefill-1",
    page_ids=(10, 11, 12, 13),
    cached_tokens=0,
    aux_slot=0,
    prompt_len=64,
)


class FakeLink:
    node_id = "prefill-1"
    epoch = 1

    def __init__(self) -> None:
        self.posted: list[RoomStatus] = []

    def lease_ok(self) -> bool:
        return True

    def post_status(self, status: RoomStatus) -> None:
        self.posted.append(status)

    def post_destination(self, dest: RoomDestination) -> None:
        raise AssertionError("a prefill node posts no destinations")

    def fail_room(self, room: int, reason: str) -> None:
        raise AssertionError("the prefill role reports failures with post_status")

    def peer(self, node_id: str) -> PeerInfo:
        regions = {"kv": MemoryRegion("kv", 1 << 20, 1 << 20), "aux": MemoryRegion("aux", 0, 1)}
        return PeerInfo(node_id, b"", regions)

    @property
    def final(self) -> list[RoomState]:
        return [s.state for s in self.posted if s.state is not RoomState.TRANSFERRING]


class FakeEngine:
    """Every write stays in flight until `settle()`."""

    notifies_completion = False
    cheap_poll = True

    def __init__(self) -> None:
        self.settled = False
        self.outcome = TransferState.DONE  # what a settled write ends as

    def bind_completion(self, callback: Callable[[], None]) -> None:
        pass

    def connect(self, peer: PeerInfo) -> None:
        pass

    def write(self, peer_id: str, ranges: Sequence[TransferRange]) -> TransferHandle:
        return TransferHandle()

    def write_pages(self, peer_id: str, *pages_and_layout: object) -> TransferHandle:
        return TransferHandle()

    def poll(self, handle: TransferHandle) -> TransferState:
        return self.outcome if self.settled else TransferState.PENDING

    def release(self, handle: TransferHandle) -> None:
        pass


class FakeScheduler:
    """The scheduler's hand-off API to the node role, recording what the role asked for."""

    def __init__(self) -> None:
        self.waiting: list[Req] = []
        self.prefilled: list[Req] = []  # first tokens sampled, not yet taken by the role
        self.parked: list[Req] = []
        self.released: list[tuple[Req, bool]] = []  # (request, cached) per page release

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def park(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req not in self.parked:
            self.parked.append(req)

    def take_prefilled(self) -> list[Req]:
        taken, self.prefilled = self.prefilled, []
        return taken

    def release(self, req: Req, cache: bool) -> None:
        if req in self.parked:
            self.parked.remove(req)
        self.released.append((req, cache))


def prefill_role_with_room(
    engine: FakeEngine | None = None,
    stream: StreamConfig | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[PrefillRole, FakeLink, FakeEngine, Any, Req]:
    """A prefill role whose room 7 got its destination and is being computed."""
    link, engine, scheduler = FakeLink(), engine or FakeEngine(), FakeScheduler()
    role = PrefillRole(
        PrefillRoleConfig(),
        link=link,
        engine=engine,  # type: ignore[arg-type]
        aux=AuxBuffer(4),
        kv=NodeKV.single(kv_base=0, head_page_bytes=1024, num_kv_heads=1),
        page_size=16,
        clock=clock,
        stream=stream,
    )
    req = Req(rid="r", prompt_ids=list(range(64)), params=SamplingParams(), sampler=None)  # type: ignore[arg-type]
    req.room, req.peer_node_id, req.stop_after_prefill = ROOM, DEST.decode_node_id, True
    role.submit(scheduler, req)  # type: ignore[arg-type]
    role.deliver(DEST)
    role.before_step(scheduler)  # type: ignore[arg-type]
    assert phase(role) is PrefillPhase.ACTIVE and scheduler.waiting == [req]
    return role, link, engine, scheduler, req


def phase(role: PrefillRole) -> PrefillPhase | None:
    entry = role.rooms.get(ROOM)
    return entry.phase if entry is not None else None


def test_prefill_role_ignores_a_replayed_destination() -> None:
    role, link, _, scheduler, req = prefill_role_with_room()
    sender = role.rooms.get(ROOM).sender  # type: ignore[union-attr]
    role.deliver(DEST)  # the same destination again, after P's stream reconnected
    role.before_step(scheduler)
    assert phase(role) is PrefillPhase.ACTIVE and role.rooms.get(ROOM).sender is sender  # type: ignore[union-attr]
    assert scheduler.waiting == [req]
    assert link.final == []


def sample_first_token(role: PrefillRole, scheduler: Any, req: Req) -> None:
    """The last chunk ran: the last pages and the aux slot go out (still in flight)."""
    req.slot, req.pages, req.kv_len = 0, [0, 1, 2, 3], 64
    req.output_ids, req.output_logprobs, req.output_top_logprobs = [5], [None], [None]
    scheduler.park(req)  # what the scheduler does with a first token of stop_after_prefill
    scheduler.prefilled.append(req)
    role.after_step(scheduler)
    assert phase(role) is PrefillPhase.SETTLING and scheduler.parked == [req]


def test_prefill_role_reports_done_mid_forward_and_frees_pages_at_the_step_end() -> None:
    role, link, engine, scheduler, req = prefill_role_with_room()
    sample_first_token(role, scheduler, req)
    assert role.during_forward(scheduler) == []  # writes pending: nothing to report
    engine.settled = True  # the writes land while the next step computes
    (out,) = role.during_forward(scheduler)
    assert out.req is req and out.finished and req.finish_reason is FinishReason.PREFILLED
    assert link.final == [RoomState.DONE]  # D may start decoding now
    assert scheduler.released == [] and scheduler.parked == [req]  # the forward still runs
    assert role.during_forward(scheduler) == []  # reported once
    assert role.before_step(scheduler) == []  # the step ended: pages go, nothing re-reported
    assert scheduler.released == [(req, True)] and scheduler.parked == []
    assert link.final == [RoomState.DONE] and phase(role) is None


def test_prefill_role_reports_writes_landed_by_the_first_token_in_that_step() -> None:
    """Writes that ended while the first token's aux slot was written (the KV streamed during
    the forward, a synchronous aux write): DONE goes out from the step that sampled it, not
    from the next loop turn; the pages still wait for the step boundary."""
    role, link, engine, scheduler, req = prefill_role_with_room()
    req.slot, req.pages, req.kv_len = 0, [0, 1, 2, 3], 64
    req.output_ids, req.output_logprobs, req.output_top_logprobs = [5], [None], [None]
    scheduler.park(req)
    scheduler.prefilled.append(req)
    engine.settled = True
    (out,) = role.after_step(scheduler)
    assert out.req is req and out.finished and req.finish_reason is FinishReason.PREFILLED
    assert link.final == [RoomState.DONE] and phase(role) is PrefillPhase.REPORTED
    assert scheduler.released == [] and scheduler.parked == [req]
    assert role.before_step(scheduler) == [] and scheduler.released == [(req, True)]


def test_prefill_role_polls_young_writes_often_and_old_ones_every_ms() -> None:
    now = [100.0]
    role, _, engine, scheduler, req = prefill_role_with_room(clock=lambda: now[0])
    assert role.poll_pause_s is None  # ACTIVE: nothing only a poll would see
    sample_first_token(role, scheduler, req)  # SETTLING since 100.0
    config = role.config
    assert role.poll_pause_s == config.poll_min_s
    now[0] += 0.002
    assert role.poll_pause_s == pytest.approx(0.002 * config.poll_growth)
    now[0] += 1.0
    assert role.poll_pause_s == config.poll_max_s
    now[0] = 100.0
    engine.notifies_completion = True  # type: ignore[misc]  # its wakeup ends the wait
    assert role.poll_pause_s == config.poll_max_s
    engine.notifies_completion, engine.cheap_poll = False, False  # type: ignore[misc]
    assert role.poll_pause_s == config.poll_max_s  # a TP node's poll is a collective
    engine.settled = True
    assert role.during_forward(scheduler)  # REPORTED: its pages go at the next step
    assert role.poll_pause_s == config.poll_min_s
    role.before_step(scheduler)
    assert role.poll_pause_s is None


def test_prefill_role_leaves_a_failed_write_to_the_step_boundary() -> None:
    role, link, engine, scheduler, req = prefill_role_with_room()
    sample_first_token(role, scheduler, req)
    engine.settled, engine.outcome = True, TransferState.FAILED
    assert role.during_forward(scheduler) == [] and link.final == []
    (out,) = role.before_step(scheduler)
    assert out.req is req and req.finish_reason is FinishReason.ABORT
    assert link.final == [RoomState.FAILED]
    assert scheduler.released == [(req, False)]  # a failed room's pages are not cached


class RecordingEngine(FakeEngine):
    """Records each write's ranges; with `refuse_kv`, a KV write cannot start."""

    def __init__(self, refuse_kv: bool = False) -> None:
        super().__init__()
        self.writes: list[list[TransferRange]] = []
        self.refuse_kv = refuse_kv

    def write(self, peer_id: str, ranges: Sequence[TransferRange]) -> TransferHandle:
        if self.refuse_kv and ranges[0].dst_addr >= 1 << 20:  # D's kv region, not its aux
            raise TransferError("connection reset by the decode node")
        self.writes.append(list(ranges))
        return TransferHandle()


# 4 layers in 2 groups; a KV head's share of a page is 1024 bytes: 256 a layer.
STREAM = StreamConfig((range(0, 2), range(2, 4)), 256, 16, False, torch.device("cpu"))


def stream_chunk(role: PrefillRole, req: Req, tokens: int) -> None:
    """The forward of a chunk of `tokens` new tokens, signalling both layer groups."""
    assert role.layer_stream is not None
    on_group = role.layer_stream.begin([req], [tokens])
    assert on_group is not None
    for index, layers in enumerate(STREAM.groups):
        on_group(GroupDone(index, layers))
    req.kv_len += tokens


def test_prefill_role_streams_layer_groups_then_writes_only_the_aux_slot() -> None:
    engine = RecordingEngine()
    role, link, _, scheduler, req = prefill_role_with_room(engine, STREAM)
    req.slot, req.pages = 0, [0, 1, 2, 3]
    stream_chunk(role, req, 40)  # pages 0, 1 complete: layers 0-1, then 2-3
    group_0, group_1 = engine.writes
    assert [(r.src_addr, r.length) for r in group_0] == [(0, 512), (1024, 512)]
    assert [(r.src_addr, r.length) for r in group_1] == [(512, 512), (1536, 512)]
    role.after_step(scheduler)  # nothing left to send after this chunk
    assert len(engine.writes) == 2 and [s.state for s in link.posted] == [RoomState.TRANSFERRING]
    stream_chunk(role, req, 24)  # the last chunk: pages 2, 3 (3 partial)
    assert len(engine.writes) == 4
    sample_first_token(role, scheduler, req)
    aux = engine.writes[-1]
    assert len(engine.writes) == 5 and aux[0].dst_addr < 1 << 20  # only the aux slot, last
    engine.settled = True
    assert role.before_step(scheduler)[0].req.finish_reason is FinishReason.PREFILLED
    assert link.final == [RoomState.DONE] and scheduler.released == [(req, True)]
    assert role.rooms.get(ROOM) is None and req.transfer is not None
    assert req.transfer.pages == 4


def test_prefill_role_posts_a_streamed_rooms_aux_slot_before_waiting_for_the_gpu() -> None:
    """Every page of a streamed prompt left during the forward: the aux slot (host memory)
    goes without `kv_ready` waiting for the GPU (no other room computed, so no wait at all;
    the copies' own events say when they land); a room with pages left waits for it first."""
    engine = RecordingEngine()
    role, _, _, scheduler, req = prefill_role_with_room(engine, STREAM)
    writes_at_ready: list[int] = []
    role.kv_ready = lambda: writes_at_ready.append(len(engine.writes))
    req.slot, req.pages = 0, [0, 1, 2, 3]
    stream_chunk(role, req, 64)  # the whole prompt in one chunk: 2 groups, 4 pages each
    assert len(engine.writes) == 2
    sample_first_token(role, scheduler, req)
    assert writes_at_ready == [] and len(engine.writes) == 3
    assert engine.writes[2][0].dst_addr < 1 << 20  # the aux slot: D's aux region, not its KV

    unstreamed = RecordingEngine()  # the per-chunk push: pages, then the aux slot, after it
    role, _, _, scheduler, req = prefill_role_with_room(unstreamed)
    writes_at_ready.clear()
    role.kv_ready = lambda: writes_at_ready.append(len(unstreamed.writes))
    sample_first_token(role, scheduler, req)
    assert writes_at_ready == [0] and len(unstreamed.writes) == 1  # (pages: `write_pages`)
    assert unstreamed.writes[0][0].dst_addr < 1 << 20  # the aux slot, after the wait


def test_prefill_role_dooms_a_room_whose_streamed_write_cannot_start() -> None:
    engine = RecordingEngine(refuse_kv=True)
    role, link, _, scheduler, req = prefill_role_with_room(engine, STREAM)
    req.slot, req.pages = 0, [0, 1, 2, 3]
    stream_chunk(role, req, 40)  # inside the forward: remembered, nothing parked yet
    assert scheduler.parked == [] and phase(role) is PrefillPhase.ACTIVE
    role.after_step(scheduler)
    assert phase(role) is PrefillPhase.SETTLING and scheduler.parked == [req]
    assert role.layer_stream is not None and role.layer_stream.begin([req], [24]) is None
    (out,) = role.before_step(scheduler)  # no write in flight: reported at once
    assert out.req is req and req.finish_reason is FinishReason.ABORT
    assert "connection reset by the decode node" in req.finish_detail
    assert link.final == [RoomState.FAILED] and scheduler.released == [(req, False)]


def test_prefill_role_confirms_a_cancel_only_after_its_writes_settle() -> None:
    role, link, engine, scheduler, req = prefill_role_with_room()
    sample_first_token(role, scheduler, req)

    role.deliver(replace(DEST, cancelled=True))  # D gave the room up
    role.before_step(scheduler)
    assert link.final == [], "confirmed before the writes into D's pages settled"
    engine.settled = True
    role.before_step(scheduler)
    assert len(link.final) == 1
