"""The HTTP layer: a Starlette app (served by uvicorn on uvloop, see server.py).

Every API request goes through `Gateway.serve`: API key (401; 403 for a key without the route's
scope, see `gateway/config.py`), body size (413) and JSON (400) checks (a large body is parsed
in a parse process, with its route's cheap prompt bound, gateway/requests/body.py; memory is handed
back after a burst of them, gateway/requests/memory.py), admission (`max_inflight`, 429 with
Retry-After), then the handler. A handler returns either a response object (sent as JSON) or
an SSE byte stream (`EventStream`). While a handler works and while a stream is sent, the
client's connection is watched: when it goes away the work is cancelled, which aborts the
request on its prefill and decode nodes.
Errors are answered in OpenAI's error shape, unknown paths and methods included.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from bootstrap.client import BootstrapClient
from gateway.api.native_api import NativeHandler
from gateway.api.openai_api import OpenAIHandlers, Payload
from gateway.api.openapi import openapi_document
from gateway.api.responses_api import ResponsesHandler, response_store, store_refusal
from gateway.api.sse import DONE
from gateway.api.text_api import TextHandlers
from gateway.config import ADMIN, INFERENCE, GatewayConfig
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.lane import ChunkedWriter, LaneFrames
from gateway.dispatch.timeline import RequestTrace, current_trace
from gateway.errors import APIError
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.requests.body import LARGE_BODY_BYTES, container_limit
from gateway.requests.memory import MemoryReturn, freeze_startup_objects, reuse_freed_memory
from gateway.requests.parse_process import BodyParser
from gateway.requests.text import TextCodec
from gateway.requests.tokenize import BodyRoute, PromptEncoder
from gateway.routing.kv_feed import KVFeeds
from gateway.routing.nodes import ROLE_NAMES, NodeDirectory
from gateway.routing.prefix_index import PrefixIndex

logger = logging.getLogger("pdserve.gateway")

Handler = Callable[[dict[str, Any]], Coroutine[Any, Any, Payload]]
CLIENT_CLOSED = 499  # nginx's status for "the client went away first"
# OpenAI answers carry the timing breakdown of their slowest choice
# (gateway/dispatch/timeline.py): a header when not streamed; a stream's headers leave before any
# timing exists, so it ends with the same value in an SSE comment line before `data: [DONE]`
# (clients skip comment lines).
TIMING_HEADER = "Server-Timing"


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Awaitable[Payload]) -> Payload:
    """Await `work`; cancel it and raise ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone()
    try:
        return task.result()
    finally:
        # A failed task keeps its exception, whose traceback holds this frame, which held the
        # task: a cycle that kept the handler's locals (a long prompt, its token ids) alive
        # until the cyclic GC ran, long after the request (issue 25).
        del task, watch


class EventStream(Response):
    """`text/event-stream` from an async iterator of SSE frames; stops when the client leaves."""

    media_type = "text/event-stream"

    def __init__(
        self,
        frames: AsyncGenerator[bytes, None] | LaneFrames,
        on_close: Callable[[], None],
        trace: RequestTrace | None = None,
    ) -> None:
        super().__init__(headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        # Response sets `content-length: 0` for its empty body; a stream has no length.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.frames = frames
        self.on_close = on_close
        self.trace = trace

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send, scope.get(SERVER_SEND, send)))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
            self.on_close()
        if not pump.cancelled() and pump.exception() is not None:
            logger.error("stream failed", exc_info=pump.exception())

    async def _pump(self, send: Send, body_send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        # Body frames go straight onto uvicorn's transport while it takes writes, and so may
        # the lane's (gateway/dispatch/lane.py): no ASGI message and coroutine per frame.
        writer = ChunkedWriter.for_send(body_send)
        lane = self.frames.lane if isinstance(self.frames, LaneFrames) else None
        if lane is not None:
            lane.writer = writer
        try:
            async with contextlib.aclosing(self.frames) as frames:
                async for frame in frames:
                    if frame == DONE and self.trace and (timeline := self.trace.slowest()):
                        comment = f": {TIMING_HEADER}: {timeline.server_timing()}\n\n".encode()
                        frame = comment + frame
                    if writer is not None and writer.writable:
                        writer.write(frame)
                    else:  # uvicorn's send waits while the client reads slowly
                        await body_send({"type": "http.response.body", "body": frame,
                                         "more_body": True})  # fmt: skip
        finally:
            if lane is not None:
                lane.writer = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})


SERVER_SEND = "pdserve.server_send"


def with_server_send(app: ASGIApp) -> ASGIApp:
    """`app` with the server's own ASGI `send` in each request's scope (`SERVER_SEND`).

    Starlette wraps `send` twice on its way to a route (its error middleware and the route's
    exception handling, each a coroutine that only notes whether the response started); a
    stream's start and end go through those wrappers, but its body frames, one per token, go
    straight to the server's `send`.
    """

    async def app_with_server_send(scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        await app(scope, receive, send)

    return app_with_server_send


class Gateway:
    """The gateway's state and request handling; built once by server.py."""

    def __init__(
        self,
        config: GatewayConfig,
        codec: TextCodec,
        multiprocess_dir: str | None = None,
        workers_serving: Callable[[], bool] | None = None,
    ) -> None:
        """`workers_serving`: with `--workers N`, whether every worker has served once (the
        supervisor's word); until then /health answers 503 "starting"."""
        self.config = config
        self.workers_serving = workers_serving
        self.metrics = GatewayMetrics(multiprocess_dir)
        self._worker_inflight = self.metrics.worker_inflight.labels(str(config.worker_index))
        self.directory = NodeDirectory(
            config.routing.node_cooldown_s,
            self._nodes_changed,
            config.internal_auth,
            keepalive_s=config.routing.node_keepalive_s,
        )
        # The nodes' KV events, followed by this worker into its own index
        # (gateway/routing/kv_feed.py).
        self.prefix_index = PrefixIndex()
        self.kv_feeds = KVFeeds(self.prefix_index, self.metrics)
        self.dispatcher = Dispatcher(
            self.directory,
            config.routing,
            self.metrics,
            config.room_tickets,
            self.prefix_index,
            config.worker_index,
        )
        interval = config.stream_interval
        self.encoder = PromptEncoder(
            codec, config.model.context_length, config.tokenizer_workers, config.limits.max_n
        )
        # Large bodies are parsed in parse processes (started with the app); after a burst of
        # them a thread hands the freed memory back (gateway/requests/memory.py).
        limit = container_limit(config.model.context_length)
        self.bodies = BodyParser(limit, self.encoder.bounds)
        self.trimmer = ThreadPoolExecutor(1, thread_name_prefix="memory-trim")
        self.memory = MemoryReturn(self.trimmer)
        handlers = (codec, self.dispatcher, config.model, config.limits, interval, self.encoder)
        self.openai = OpenAIHandlers(*handlers)
        self.native = NativeHandler(*handlers)
        self.text = TextHandlers(*handlers)
        store, store_off = response_store(config), store_refusal(config)
        self.responses = ResponsesHandler(*handlers, store=store, store_off=store_off)
        self.inflight = 0
        # SIGTERM (gateway/process/server.py): finish what is in flight, take no more
        self.draining = False

    async def drain(self, timeout_s: float) -> None:
        """Wait (with `draining` set) until no request is in flight, or `timeout_s`."""
        logger.info(
            "draining: /health fails, new requests get 503; %d in flight get %.1f s to finish",
            self.inflight,
            timeout_s,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        logger.info("drained: %d requests still in flight", self.inflight)

    def _nodes_changed(self, directory: NodeDirectory) -> None:
        for role, name in ROLE_NAMES.items():
            self.metrics.live_nodes.labels(name).set(directory.count(role))
        self.kv_feeds.sync(directory)

    async def serve(
        self, request: Request, endpoint: str, handler: Handler, route: BodyRoute | None = None
    ) -> Response:
        """`route`: whose cheap prompt bound (the handler's first check) a large body's parse
        process applies before sending the parsed body back (gateway/requests/body.py)."""
        status = 200
        trace = RequestTrace()
        current_trace.set(trace)  # this request's choices record their timelines here
        try:
            self.authorize(request, INFERENCE)
            # In flight only once the body is complete: a client that trickles its body
            # (or sends headers and stops) never holds a place under --max-inflight.
            data = await self._read_body(request)
            large = len(data) >= LARGE_BODY_BYTES
            with self.memory.large() if large else contextlib.nullcontext():
                parsed = await self.bodies.parse(data, route)
                del data  # a large body's bytes go before its prompt is tokenized
                if parsed.refusal is not None:  # answered where the handler would raise it
                    handler = _refusing(parsed.refusal)
                return await self._respond(request, handler, parsed.body, trace)
        except APIError as exc:
            status = exc.status
            if status == 503:
                self.metrics.rejected.labels("unavailable").inc()
            return error_response(exc)
        except (ClientGone, ClientDisconnect):
            status = CLIENT_CLOSED
            return Response(status_code=CLIENT_CLOSED)
        except Exception:
            logger.exception("internal error on %s", endpoint)
            status = 500
            return error_response(APIError(500, "internal error in the gateway; see its log",
                                           type_="server_error"))  # fmt: skip
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()

    async def _respond(
        self, request: Request, handler: Handler, body: dict[str, Any], trace: RequestTrace
    ) -> Response:
        if self.draining:
            raise APIError(
                503,
                "this gateway is shutting down: retry after the delay in Retry-After (another "
                "gateway of the cluster takes the request)",
                type_="service_unavailable",
                code="shutting_down",
                headers={"Retry-After": "1"},
            )
        self._admit()
        try:
            payload = await until_disconnected(request.receive, handler(body))
        except BaseException:
            self._release()
            raise
        if isinstance(payload, dict):
            self._release()
            timeline = trace.slowest()
            headers = {TIMING_HEADER: timeline.server_timing()} if timeline else None
            return JSONResponse(payload, headers=headers)
        return EventStream(payload, on_close=self._release, trace=trace)

    def authorize(self, request: Request, scope: str) -> None:
        """401 without a known key, 403 for a key that lacks `scope` (gateway/config.py)."""
        keys = self.config.limits.api_keys
        if not keys or (scope == ADMIN and not any(ADMIN in k.scopes for k in keys)):
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        matches = [k for k in keys if hmac.compare_digest(given, k.key.encode())]
        if scheme.lower() != "bearer" or not matches:
            raise APIError(
                401,
                "missing or wrong API key: send the header `Authorization: Bearer <key>` with a "
                "key the gateway was started with (--api-key, --admin-api-key, --api-keys-file)",
                code="invalid_api_key",
            )
        if scope not in matches[0].scopes:
            raise APIError(
                403,
                f"this API key may not call {request.method} {request.url.path}: the route "
                f"needs scope {scope!r}, the key has {', '.join(sorted(matches[0].scopes))}; "
                "use a key with that scope",
                code="insufficient_scope",
            )

    def _admit(self) -> None:
        limit = self.config.limits.max_inflight
        if self.inflight >= limit:
            self.metrics.rejected.labels("inflight").inc()
            raise APIError(
                429,
                f"the gateway is at its limit of {limit} requests in progress (--max-inflight): "
                "retry after the delay in Retry-After",
                type_="rate_limit_error",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        self._worker_inflight.set(self.inflight)

    def _release(self) -> None:
        self.inflight -= 1
        self.metrics.inflight.set(self.inflight)
        self._worker_inflight.set(self.inflight)

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.limits.max_body_bytes
        too_large = APIError(
            413,
            f"the request body exceeds the limit of {limit} bytes (--max-body-bytes): "
            "send a shorter prompt",
            code="request_too_large",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        pieces: list[bytes] = []  # joined once: no regrowth and copy per piece
        size = 0
        async for piece in request.stream():
            if not piece:  # Starlette's stream ends with b"", which would make the join copy
                continue
            pieces.append(piece)
            size += len(piece)
            if size > limit:
                raise too_large
        return b"".join(pieces)  # a body received whole (gateway/process/connections.py): no copy

    def health(self) -> JSONResponse:
        counts = {name: self.directory.count(role) for role, name in ROLE_NAMES.items()}
        # With --workers N, not ready until every worker listens: load sent earlier lands on
        # the workers that happen to listen already and stays there (gateway/process/workers.py).
        starting = self.workers_serving is not None and not self.workers_serving()
        ok = counts["decode"] + counts["colocated"] > 0 and not self.draining and not starting
        if self.draining:
            status = "draining"
        elif starting:
            status = "starting: not every gateway worker serves yet"
        else:
            status = "ok" if ok else "no decode node"
        body = {
            "status": status,
            **counts,
            "inflight": self.inflight,  # this worker's (gateway-server --workers)
            "pid": os.getpid(),  # the worker that answered
            "worker": self.config.worker_index,  # and its index (0..--workers-1)
        }
        return JSONResponse(body, status_code=200 if ok else 503)


def _refusing(error: APIError) -> Handler:
    async def refuse(body: dict[str, Any]) -> Payload:
        raise error

    return refuse


def _report_watch_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("node discovery stopped: %r; routing is frozen", task.exception())


def build_app(gateway: Gateway) -> Starlette:
    async def completions(request: Request) -> Response:
        completion = BodyRoute.COMPLETION
        return await gateway.serve(request, "completions", gateway.openai.completions, completion)

    async def chat(request: Request) -> Response:
        return await gateway.serve(request, "chat", gateway.openai.chat, BodyRoute.CHAT)

    async def responses(request: Request) -> Response:
        route = BodyRoute.RESPONSES
        return await gateway.serve(request, "responses", gateway.responses.create, route)

    async def generate(request: Request) -> Response:
        return await gateway.serve(request, "generate", gateway.native.generate, BodyRoute.NATIVE)

    async def tokenize(request: Request) -> Response:
        return await gateway.serve(request, "tokenize", gateway.text.tokenize)

    async def detokenize(request: Request) -> Response:
        return await gateway.serve(request, "detokenize", gateway.text.detokenize)

    async def models(request: Request) -> Response:
        try:
            gateway.authorize(request, INFERENCE)
            if "model_id" in request.path_params:
                return JSONResponse(gateway.openai.model_card(request.path_params["model_id"]))
        except APIError as exc:
            return error_response(exc)
        return JSONResponse(gateway.openai.models())

    async def health(request: Request) -> Response:
        return gateway.health()

    schema = openapi_document(gateway.config)

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema)

    async def metrics(request: Request) -> Response:
        try:
            gateway.authorize(request, ADMIN)
        except APIError as exc:
            return error_response(exc)
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
        message = f"{request.method} {request.url.path}: {detail}"
        return error_response(APIError(status, message, code=str(status)))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncGenerator[None, None]:
        client = BootstrapClient(gateway.config.bootstrap, auth=gateway.config.internal_auth)
        watch = asyncio.create_task(gateway.directory.watch(client), name="watch-nodes")
        watch.add_done_callback(_report_watch_end)
        logger.info("following nodes at bootstrap %s", gateway.config.bootstrap)
        reuse_freed_memory()  # a large body's copies fault no fresh pages in (memory.py)
        gateway.bodies.start()  # the parse processes, before the first large body
        frozen = freeze_startup_objects()  # full collections no longer walk them (memory.py)
        logger.info("%d start-up objects frozen out of the cyclic GC", frozen)
        try:
            yield
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            await gateway.kv_feeds.close()
            await gateway.directory.close()
            await client.close()
            gateway.encoder.close()
            gateway.bodies.close()
            gateway.trimmer.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    return Starlette(
        routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan
    )
