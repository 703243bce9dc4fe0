"""Security of the internal gRPC APIs (bootstrap and node servers): shared token, TLS, bad input.

Threat model. The gateway's HTTP API faces users (API keys, see gateway/api/app.py); the gRPC APIs
are internal: only processes of the deployment may call them. Three layers, all optional and
off by default (a laptop cluster on 127.0.0.1 needs none of them):

- **Shared token** (`--internal-token-file FILE`, or `--internal-token`, or the environment
  variable `PDSERVE_INTERNAL_TOKEN`, read by the entry points only). Every client sends it as
  metadata `x-pdserve-token` on every call; every server checks it in `TokenCheck` (constant
  time) and answers UNAUTHENTICATED without running the handler. The token is never logged:
  it lives only in `InternalAuth.token`, which is left out of the dataclass's repr. pd-cluster
  passes it to its children by file path, never by value in argv.
- **TLS** (`--tls-cert`, `--tls-key`, `--tls-ca`, `--tls-require-client-cert`): servers serve
  their certificate; clients verify servers against the CA and present their own certificate
  when they have one; with `--tls-require-client-cert` a server refuses clients without a
  certificate signed by the CA (mutual TLS).
- **Node identity** (bootstrap only, see `bootstrap/service.py`): `Register` hands each node a
  random secret; a node's room calls carry `x-pdserve-node-id` and `x-pdserve-node-secret`, so
  the bootstrap knows which node is calling, not only which node the message claims to be from.

`MalformedRequestGuard` makes every server answer a request whose bytes are not a valid
protobuf message with INVALID_ARGUMENT (grpc's own answer is UNKNOWN, as for a handler crash).
"""

from __future__ import annotations

import argparse
import functools
import hmac
import inspect
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

logger = logging.getLogger("pdserve.security")

TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"
TOKEN_HEADER = "x-pdserve-token"
NODE_ID_HEADER = "x-pdserve-node-id"
NODE_SECRET_HEADER = "x-pdserve-node-secret"


@dataclass(frozen=True)
class TLSConfig:
    """PEM bytes of this process's certificate and key, and of the CA it trusts."""

    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)
    require_client_cert: bool = False
    server_name: str = ""  # clients: expect this name in server certificates (default: host)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.require_client_cert and self.ca is None:
            raise ValueError("--tls-require-client-cert needs --tls-ca to check client certs")

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("a TLS server needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca if self.require_client_cert else None,
            require_client_auth=self.require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


@dataclass(frozen=True)
class InternalAuth:
    """How this process talks to and serves the internal gRPC APIs (see the module docstring)."""

    token: str = field(default="", repr=False)
    tls: TLSConfig | None = None

    def describe(self) -> str:
        """For the startup log line: what is on, never the secrets themselves."""
        tls = "no TLS"
        if self.tls is not None:
            tls = "mutual TLS" if self.tls.require_client_cert else "TLS"
        return f"{'internal token required' if self.token else 'no internal token'}, {tls}"

    # ---- servers ------------------------------------------------------------------------------
    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        guards: list[grpc.aio.ServerInterceptor] = [MalformedRequestGuard()]
        return [TokenCheck(self.token), *guards] if self.token else guards

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on `address` (TLS if configured); 0 when the bind failed."""
        try:
            if self.tls is not None:
                return server.add_secure_port(address, self.tls.server_credentials())
            return server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises instead of returning 0 when the bind fails
            return 0

    # ---- clients ------------------------------------------------------------------------------
    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        interceptors = _token_interceptors(self.token) if self.token else None
        options = list(options)
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options, interceptors=interceptors)
        if self.tls.server_name:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return grpc.aio.secure_channel(
            address, self.tls.channel_credentials(), options, interceptors=interceptors
        )


# ---- command line (entry points only) ---------------------------------------------------------


def add_internal_auth_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("internal gRPC security")
    g.add_argument(
        "--internal-token-file",
        default=None,
        help="file holding the shared token every internal gRPC call must carry "
        f"(also: --internal-token, or ${TOKEN_ENV})",
    )
    g.add_argument(
        "--internal-token",
        default=None,
        help="the shared token itself (visible in `ps`: prefer --internal-token-file)",
    )
    g.add_argument("--tls-cert", default=None, help="PEM certificate this process presents")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-ca", default=None, help="PEM CA bundle: verifies servers (and client certs)"
    )
    g.add_argument(
        "--tls-require-client-cert",
        action="store_true",
        help="servers refuse clients without a certificate signed by --tls-ca",
    )
    g.add_argument("--tls-server-name", default="", help="name expected in server certificates")


def internal_auth_from_args(args: argparse.Namespace) -> InternalAuth:
    """Read the token and TLS files named by the flags; ValueError names the flag at fault."""
    token = _read_token(args)
    tls_files = (args.tls_cert, args.tls_key, args.tls_ca)
    tls = None
    if any(tls_files) or args.tls_require_client_cert:
        cert, key, ca = (_read_file(path, flag) for path, flag in zip(
            tls_files, ("--tls-cert", "--tls-key", "--tls-ca"), strict=True
        ))  # fmt: skip
        tls = TLSConfig(cert, key, ca, args.tls_require_client_cert, args.tls_server_name)
    return InternalAuth(token, tls)


def internal_auth_argv(args: argparse.Namespace) -> list[str]:
    """The flags that give a child process the same settings; the token only by file path."""
    argv: list[str] = []
    for flag in ("internal_token_file", "tls_cert", "tls_key", "tls_ca", "tls_server_name"):
        value = getattr(args, flag)
        if value:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    if args.tls_require_client_cert:
        argv.append("--tls-require-client-cert")
    return argv


def _read_token(args: argparse.Namespace) -> str:
    if args.internal_token_file and args.internal_token:
        raise ValueError("give --internal-token-file or --internal-token, not both")
    if args.internal_token_file:
        raw = _read_file(args.internal_token_file, "--internal-token-file")
        token = (raw or b"").decode(errors="strict").strip()
        if not token:
            raise ValueError(f"--internal-token-file {args.internal_token_file} is empty")
    else:
        token = (args.internal_token or os.environ.get(TOKEN_ENV, "")).strip()
    if token and not token.isprintable():
        raise ValueError("the internal token must be printable ASCII (it travels as metadata)")
    return token


def _read_file(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror})") from None


# ---- the token on the wire --------------------------------------------------------------------


def metadata_value(metadata: Sequence[tuple[str, Any]] | None, key: str) -> str:
    for name, value in metadata or ():
        if name == key:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuse every call without the shared token (UNAUTHENTICATED), before any handler runs."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        given = metadata_value(details.invocation_metadata, TOKEN_HEADER).encode()
        if hmac.compare_digest(given, self._token):
            return await continuation(details)
        what = "wrong" if given else "missing"
        logger.warning("refused %s: %s internal token", details.method, what)
        message = (
            f"{what} internal token on {details.method}: start the caller with the cluster's "
            f"--internal-token-file (or ${TOKEN_ENV})"
        )

        async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        handler = await continuation(details)
        if handler is not None and handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)  # a bidi call: refused alike
        return grpc.unary_unary_rpc_method_handler(refuse)


class _TokenUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


class _TokenUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


class _TokenStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(_with_token(details, self.token), request_iterator)


def _token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    return [_TokenUnaryUnary(token), _TokenUnaryStream(token), _TokenStreamStream(token)]


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(TOKEN_HEADER, token)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


# ---- malformed requests -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Malformed:
    error: str


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    """Undecodable request bytes -> INVALID_ARGUMENT naming the method (not UNKNOWN).

    The handler's deserializer is wrapped to return a marker instead of raising, and the
    handler to answer the marker with the status; decodable requests pass through unchanged.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method
        deserializer = _tolerant(handler.request_deserializer)
        if handler.request_streaming:
            if not handler.response_streaming or not inspect.isasyncgenfunction(
                handler.stream_stream
            ):
                return handler
            return grpc.stream_stream_rpc_method_handler(
                _guarded_bidi(handler.stream_stream, method),
                deserializer,
                handler.response_serializer,
            )
        if handler.response_streaming:
            behavior = _guarded_stream(handler.unary_stream, method)
            return grpc.unary_stream_rpc_method_handler(
                behavior, deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            _guarded_unary(handler.unary_unary, method), deserializer, handler.response_serializer
        )


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def tolerant(data: bytes) -> Any:
        try:
            return deserialize(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return _Malformed(str(exc) or type(exc).__name__)

    return tolerant


def _refusal(method: str, request: _Malformed) -> str:
    return (
        f"{method}: the request is not a valid protobuf message ({request.error}): "
        "send the message type the .proto declares"
    )


def _guarded_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    @functools.wraps(behavior)
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(method, request))
        return await behavior(request, context)

    return guarded


def _guarded_stream(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        @functools.wraps(behavior)
        async def guarded_gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(method, request))
            async for response in behavior(request, context):
                yield response

        return guarded_gen
    return _guarded_unary(behavior, method)  # a handler that returns an iterator


class _MalformedItem(Exception):
    def __init__(self, request: _Malformed) -> None:
        super().__init__(request.error)
        self.request = request


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for item in requests:
        if isinstance(item, _Malformed):
            raise _MalformedItem(item)
        yield item


def _guarded_bidi(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """A bidirectional handler (an async generator) whose request stream holds undecodable
    bytes ends with INVALID_ARGUMENT, once the handler's reading has surfaced them."""

    @functools.wraps(behavior)
    async def guarded(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        try:
            async for response in behavior(_checked(requests), context):
                yield response
        except _MalformedItem as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(method, exc.request))

    return guarded


# ---- room tickets -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RoomTickets:
    """The gateway's proof that it assigned a room to a (prefill, decode) pair.

    Only the gateway and the bootstrap hold the key (`--room-key-file`), not the nodes: the
    gateway puts `issue(room, P, D)` into D's GenerateRequest, D forwards it with its
    destination, and the bootstrap opens the room only if it matches. So no node, even one
    holding the internal token, can open a room the gateway gave to another decode node.
    """

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise ValueError("--room-key-file must hold at least 16 bytes of random key")

    def issue(self, room: int, prefill_node_id: str, decode_node_id: str) -> str:
        message = f"{room}|{prefill_node_id}|{decode_node_id}".encode()
        return hmac.new(self.key, message, "sha256").hexdigest()[:32]

    def valid(self, ticket: str, room: int, prefill_node_id: str, decode_node_id: str) -> bool:
        expected = self.issue(room, prefill_node_id, decode_node_id)
        return hmac.compare_digest(ticket.encode(), expected.encode())


def add_room_key_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--room-key-file",
        default=None,
        help="secret shared by the gateway and the bootstrap only: the gateway signs each room's "
        "(room, prefill node, decode node) with it and the bootstrap refuses destinations that "
        "do not carry that signature",
    )


def room_tickets_from_args(args: argparse.Namespace) -> RoomTickets | None:
    key = _read_file(args.room_key_file, "--room-key-file")
    return None if key is None else RoomTickets(key.strip())
