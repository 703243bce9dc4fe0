"""The node gRPC API (`proto/node.proto`) over an `EngineLoop`: served by every node kind.

Runs on the grpc.aio event loop; the engine runs on its own thread (see `engine_loop.py`), so
this module only validates, converts between protobuf and engine types, and relays the engine's
per-step output batches to the request streams (`streams.py`).
A client that goes away mid-stream has its request aborted, which frees its pages at once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import fields
from typing import Protocol

import grpc

from bootstrap.telemetry import current_room
from engine.engine_loop import EngineLoop, RequestFinish
from engine.eplb.recorder import RecordingError
from engine.grammar_spec import GrammarSpec
from engine.node.bootstrap_link import NodeLink
from engine.node.experts import ExpertRecording
from engine.node.multiplex import MAX_UNSENT_TOKENS, RequestError, serve_stream
from engine.node.streams import (
    OutputReceiver,
    OutputRouter,
    RequestOutput,
    prompt_logprobs_to_proto,
    timing_to_proto,
)
from engine.request import Req
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from proto import node_pb2, node_pb2_grpc

_SAMPLING_FIELDS = [f.name for f in fields(SamplingParams)]


def sampling_from_proto(msg: node_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine defaults; ValueError names a bad field."""
    kwargs: dict[str, object] = {}
    for name in _SAMPLING_FIELDS:
        if name in ("stop", "stop_token_ids"):
            kwargs[name] = tuple(getattr(msg, name))
        elif name == "grammar":
            if msg.HasField("grammar"):
                kwargs[name] = GrammarSpec(msg.grammar.kind, msg.grammar.spec)
        elif name == "grammar_generated_ids":
            kwargs[name] = tuple(msg.grammar.generated_ids)
        elif name == "logit_bias":
            kwargs[name] = dict(msg.logit_bias)
        elif msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def sampling_to_proto(params: SamplingParams) -> node_pb2.SamplingParams:
    msg = node_pb2.SamplingParams()
    for name in _SAMPLING_FIELDS:
        value = getattr(params, name)
        if name in ("stop", "stop_token_ids"):
            getattr(msg, name).extend(value)
        elif name == "grammar":
            if value is not None:
                msg.grammar.kind, msg.grammar.spec = value.kind, value.spec
        elif name == "grammar_generated_ids":
            if value:
                msg.grammar.generated_ids.extend(value)
        elif name == "logit_bias":
            msg.logit_bias.update(dict(value))
        elif value is not None:
            setattr(msg, name, value)
    return msg


class NodeService(node_pb2_grpc.NodeServicer):
    def __init__(
        self,
        engine: EngineLoop,
        role: str,
        model_name: str,
        link: NodeLink | None = None,
        max_unsent_tokens: int = MAX_UNSENT_TOKENS,
        experts: ExpertRecording | None = None,
    ) -> None:
        if max_unsent_tokens < 1:
            raise ValueError(f"--stream-buffer-tokens must be >= 1, got {max_unsent_tokens}")
        self.engine = engine
        self.max_unsent_tokens = max_unsent_tokens  # a GenerateStream request's (multiplex.py)
        self.role = role
        self.model_name = model_name
        self.link = link
        self.experts = experts  # a MoE model's expert-load recording (engine/node/experts.py)
        self._live: set[str] = set()
        # SIGTERM or a role switch: new requests are refused (engine/node/server.py, `drain`)
        self.draining = False
        self.drain_reason = ""
        self.switcher: RoleSwitching | None = None  # a registered node's (role_switch.py)
        self._rooms: set[int] = set()
        self.router = OutputRouter()
        engine.bind_output(self.router.on_output)

    def _build_req(self, request: node_pb2.GenerateRequest | node_pb2.PrefillRequest) -> Req:
        """Validate on the gRPC side so a bad request gets INVALID_ARGUMENT, not a stream."""
        scheduler = self.engine.scheduler
        vocab = scheduler.runner.model_config.vocab_size
        params = sampling_from_proto(request.sampling)
        params.check_vocab(vocab)
        ids = list(request.input_ids)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        scheduler.validate_prompt(ids)
        resumed = request.resumed_tokens
        if resumed >= len(ids):
            raise ValueError(
                f"resumed_tokens {resumed} must be less than the {len(ids)} input_ids: they are "
                "the generated tokens that end the prompt of a migrated request"
            )
        split = len(ids) - resumed
        sampler = scheduler.new_sampler(params, ids[:split])
        # A migrated request continues its own stream: the draw positions, the penalties and
        # the grammar's matcher move past what it generated elsewhere.
        sampler.resume(ids[split:])
        rid = request.rid or uuid.uuid4().hex
        return Req(rid=rid, prompt_ids=ids, params=params, sampler=sampler)

    async def _compile_grammar(self, sampling: node_pb2.SamplingParams) -> None:
        """Compile a request's grammar on a worker thread (a large schema can take seconds);
        `_build_req` then finds it in the cache. ValueError: the compiler's reason."""
        grammars = self.engine.scheduler.grammars
        if sampling.HasField("grammar") and grammars is not None:
            spec = GrammarSpec(sampling.grammar.kind, sampling.grammar.spec)
            await asyncio.to_thread(grammars.compiled, spec)

    async def _check_room(self, room: int, peer: str, peer_kind: str, required: bool) -> None:
        if not room:
            if required:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "bootstrap_room is required")
            return
        if self.link is None:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this {self.role} node is not disaggregated: it takes no bootstrap_room "
                "(start it with --mode disaggregated and --bootstrap)",
            )
        if self.role == "colocated":
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this node serves the colocated role now: it takes no bootstrap_room (send the "
                "request without one, or switch it to prefill or decode)",
            )
        if not peer:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{peer_kind}_node_id is required with a room"
            )
        if await self.link.lookup_peer(peer) is None:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{peer_kind} node {peer!r} is not registered with bootstrap",
            )
        if room in self._rooms:
            raise RequestError(
                grpc.StatusCode.ALREADY_EXISTS, f"bootstrap room {room} is already in use"
            )

    async def _admit(
        self,
        request: node_pb2.GenerateRequest | node_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext,
    ) -> Req:
        try:
            return await self.accept(request)
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
            raise  # not reached: abort raises

    async def accept(self, request: node_pb2.GenerateRequest | node_pb2.PrefillRequest) -> Req:
        """The request as the engine takes it; RequestError says why it is refused."""
        prefill = isinstance(request, node_pb2.PrefillRequest)
        current_room.set(request.bootstrap_room)  # this handler's log lines name the room
        if self.draining:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"this {self.role} node is draining ({self.drain_reason}): send the request to "
                "another node",
            )
        try:
            await self._compile_grammar(request.sampling)
            req = self._build_req(request)
            if isinstance(request, node_pb2.PrefillRequest):
                await self._check_room(
                    request.bootstrap_room, request.decode_node_id, "decode", True
                )
                req.peer_node_id = request.decode_node_id
            else:
                await self._check_room(
                    request.bootstrap_room, request.prefill_node_id, "prefill", False
                )
                req.peer_node_id = request.prefill_node_id
                req.room_ticket = request.room_ticket
        except ValueError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        req.room = request.bootstrap_room
        req.stop_after_prefill = prefill
        if req.rid in self._live:
            raise RequestError(
                grpc.StatusCode.ALREADY_EXISTS, f"request id {req.rid!r} is already running"
            )
        return req

    async def Prefill(
        self, request: node_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.PrefillResponse:
        if self.role != "prefill":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"this is a {self.role} node, not prefill"
            )
        req = await self._admit(request, context)
        output = RequestOutput()
        self.open(req, output)
        finish: RequestFinish | None = None
        try:
            finish = await output.wait_finish()
        finally:
            self.close(req, aborted=finish is None)
        if finish.reason != "prefilled":
            await context.abort(grpc.StatusCode.ABORTED, finish.detail or finish.reason)
        t = finish.transfer
        return node_pb2.PrefillResponse(
            bootstrap_room=req.room,
            prompt_tokens=finish.prompt_tokens,
            cached_tokens=finish.cached_tokens,
            sent_pages=t.pages if t else 0,
            sent_bytes=t.bytes if t else 0,
            descriptors=t.descriptors if t else 0,
            page_id_writes=t.page_id_writes if t else 0,
            timing=timing_to_proto(finish.timing),
            prompt_logprobs=prompt_logprobs_to_proto(finish.prompt_logprobs),
        )

    async def Generate(
        self, request: node_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[node_pb2.GenerateResponse]:
        req = await self._admit(request, context)
        async for message in self._run(req):
            yield message

    async def _run(self, req: Req) -> AsyncIterator[node_pb2.GenerateResponse]:
        """Submit `req` and yield its messages; aborts it if the caller goes away first."""
        output = RequestOutput()
        self.open(req, output)
        finished = False
        try:
            while not finished:
                for message in await output.next_messages():
                    finished = message.HasField("finished")
                    yield message
        finally:
            self.close(req, aborted=not finished)

    async def GenerateStream(
        self,
        request_iterator: AsyncIterator[node_pb2.StreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[node_pb2.StreamBatch]:
        try:
            async for batch in serve_stream(self, request_iterator, self.max_unsent_tokens):
                yield batch
        except RequestError as exc:
            await context.abort(exc.code, str(exc))

    def open(self, req: Req, receiver: OutputReceiver) -> None:
        """Submit an accepted request whose output goes to `receiver`."""
        self._live.add(req.rid)
        if req.room:
            self._rooms.add(req.room)
        self.router.register(req.rid, receiver)
        self.engine.submit(req)

    def close(self, req: Req, aborted: bool) -> None:
        """`aborted`: the client cancelled or the server is shutting down before the end."""
        self._live.discard(req.rid)
        self._rooms.discard(req.room)
        self.router.unregister(req.rid)
        if aborted:
            self.engine.abort(req.rid)

    def start_draining(self, why: str) -> None:
        self.draining, self.drain_reason = True, why

    def stop_draining(self) -> None:
        self.draining, self.drain_reason = False, ""

    @property
    def inflight(self) -> int:
        """Requests accepted and not yet over (streaming, or waiting for KV or a prefill)."""
        return len(self._live)

    async def pages_in_use(self) -> int:
        """USED pages (held by live requests, or quarantined); the integrity check runs too."""
        check: node_pb2.CheckIntegrityResponse = await self._on_engine(_integrity)
        if not check.ok:
            raise AssertionError(check.error)
        return check.used_pages

    def abort_all(self, reason: str) -> int:
        """Abort every request still streaming (shutdown); each ends with Finished(abort)."""
        for rid in list(self._live):
            self.engine.abort(rid, reason)
        return len(self._live)

    async def _on_engine(self, fn):  # type: ignore[no-untyped-def]
        return await asyncio.wrap_future(self.engine.call(fn))

    async def Abort(
        self, request: node_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.AbortResponse:
        found = await asyncio.wrap_future(self.engine.abort(request.rid))
        if not found:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no queued or running request with id {request.rid!r}"
            )
        return node_pb2.AbortResponse(found=True)

    async def Health(
        self, request: node_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.HealthResponse:
        ok = self.engine.fatal_error is None
        node_id = self.link.node_id if self.link else ""
        return node_pb2.HealthResponse(
            ok=ok, role=self.role, model=self.model_name, node_id=node_id
        )

    async def GetLoad(
        self, request: node_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.LoadResponse:
        return await self._on_engine(_load)  # type: ignore[no-any-return]

    async def FlushCache(
        self, request: node_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.FlushCacheResponse:
        freed = await self._on_engine(lambda s: s.flush_cache())
        return node_pb2.FlushCacheResponse(freed_pages=freed)

    async def CheckIntegrity(
        self, request: node_pb2.CheckIntegrityRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.CheckIntegrityResponse:
        return await self._on_engine(_integrity)  # type: ignore[no-any-return]

    async def SwitchRole(
        self, request: node_pb2.SwitchRoleRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.SwitchRoleResponse:
        if self.switcher is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this {self.role} node is not registered with a bootstrap, so it cannot switch "
                "roles: start it with --mode disaggregated --bootstrap HOST:PORT",
            )
        assert self.switcher is not None
        timeout = request.drain_timeout_s if request.HasField("drain_timeout_s") else None
        try:
            # Shielded: a caller that gives up (its deadline) must not leave the node half
            # switched, draining or registered nowhere; the switch runs to its end.
            return await asyncio.shield(self.switcher.switch(request.role, timeout))
        except RequestError as exc:
            await context.abort(exc.code, str(exc))
            raise  # not reached: abort raises

    async def ExpertRecording(
        self, request: node_pb2.ExpertRecordingRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.ExpertRecordingResponse:
        experts = self.experts
        if experts is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this node's model {self.model_name} has no mixture-of-experts layers: there "
                "is no expert load to record",
            )
        assert experts is not None
        try:
            answer: node_pb2.ExpertRecordingResponse = await self._on_engine(
                lambda s: experts.act(request.action)
            )
            return answer
        except RecordingError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise  # not reached: abort raises


class RoleSwitching(Protocol):
    """Switches a registered node's role (engine/node/role_switch.py); RequestError refuses."""

    async def switch(
        self, role: str, drain_timeout_s: float | None
    ) -> node_pb2.SwitchRoleResponse: ...


def _load(s: Scheduler) -> node_pb2.LoadResponse:
    alloc = s.kv.allocator
    return node_pb2.LoadResponse(
        running_requests=len(s.running),
        queued_requests=len(s.waiting),
        free_pages=alloc.num_free,
        total_pages=alloc.total,
        token_usage=alloc.num_used / alloc.total,
        cached_pages=alloc.num_cached,
    )


def _integrity(s: Scheduler) -> node_pb2.CheckIntegrityResponse:
    alloc = s.kv.allocator
    error = ""
    try:
        s.check_integrity()
    except AssertionError as exc:
        error = str(exc)
    return node_pb2.CheckIntegrityResponse(
        ok=not error,
        error=error,
        free_pages=alloc.num_free,
        used_pages=alloc.num_used,
        cached_pages=alloc.num_cached,
        total_pages=alloc.total,
    )
