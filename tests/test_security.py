"""Security on real processes (issue 8, item 6): gateway API keys and scopes, the internal gRPC
token, TLS with client certificates, and room ownership at the bootstrap.

One `pd-cluster` runs with everything on: an inference key and an admin key on the gateway,
`--internal-token-file` and mutual TLS (a throwaway CA from the openssl CLI) on every gRPC server
and client. Requests really go through the prefill node (`--local-prefill-max-tokens 0`), so the
gateway -> P/D, P/D -> bootstrap calls all carry the token over TLS. Then raw gRPC clients try
every way in that they should not have. The room tests run a bootstrap-server with a token
(which turns on node identity checks) and real `BootstrapClient`s, one per node: an insider
holding the token registers its own decode node and tries to take over another node's room.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from bootstrap.client import BootstrapClient
from bootstrap.security import TOKEN_HEADER, InternalAuth, RoomTickets, TLSConfig
from gateway.process.launcher import ServerProcess as NodeServer
from gateway.process.launcher import running_node
from proto import bootstrap_pb2 as pb
from proto import bootstrap_pb2_grpc, node_pb2, node_pb2_grpc
from scripts.tiny_models import tiny_chat_model
from tests.hardening import Certs, assert_openai_error, cluster_process, make_certs
from tests.test_gateway import RunningCluster

TOKEN = "s3cret-internal-token-0123456789"
USER_KEY = "user-key-1"
ADMIN_KEY = "admin-key-1"
WAIT_S = 10.0
ROOM_KEY = "0123456789abcdef0123456789abcdef"  # shared by the gateway and bootstrap only
TICKETS = RoomTickets(ROOM_KEY.encode())


@pytest.fixture(scope="module")
def tiny_model(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_model(default_model_dir, tmp_path_factory.mktemp("tiny-chat") / "model")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secure_cluster(
    tiny_model: Path, certs: Certs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningCluster]:
    tmp = tmp_path_factory.mktemp("secure-cluster")
    token_file = tmp / "internal-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    keys_file = tmp / "api-keys"
    keys_file.write_text(f"{USER_KEY} inference\n{ADMIN_KEY} admin  # the scraper\n")
    room_key = tmp / "room-key"
    room_key.write_text(ROOM_KEY)
    args = ["--internal-token-file", str(token_file), "--tls-ca", str(certs.ca)]
    args += ["--room-key-file", str(room_key)]
    args += ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]
    args += ["--tls-require-client-cert"]
    gateway_args = ["--local-prefill-max-tokens", "0", "--api-keys-file", str(keys_file)]
    with cluster_process(tmp / "pd-cluster.log", tiny_model, args, gateway_args) as cluster:
        yield cluster


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_gateway_api_keys_401_403(secure_cluster: RunningCluster, tiny_model: Path) -> None:
    url = secure_cluster.url
    body = {"model": tiny_model.name, "prompt": "Hello there", "max_tokens": 4}
    with httpx.Client(timeout=60) as http:
        for key, path, status in [
            (None, "/v1/completions", 401),
            ("wrong-key", "/v1/completions", 401),
            (ADMIN_KEY, "/v1/completions", 403),  # the admin key may not generate
            (None, "/metrics", 401),
            (USER_KEY, "/metrics", 403),  # a user key may not read the metrics
            (None, "/v1/models", 401),
            (ADMIN_KEY, "/v1/models", 403),
        ]:
            if path == "/v1/completions":
                response = http.post(url + path, json=body, headers=_auth(key))
            else:
                response = http.get(url + path, headers=_auth(key))
            assert response.status_code == status, (key, path, response.text)
            assert_openai_error(status, response.json())
            if status == 403:
                assert "scope" in response.json()["error"]["message"]
        ok = http.post(url + "/v1/completions", json=body, headers=_auth(USER_KEY))
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 4
        metrics = http.get(url + "/metrics", headers=_auth(ADMIN_KEY))
        assert metrics.status_code == 200 and "pdserve_gateway_requests_total" in metrics.text
        assert http.get(url + "/v1/models", headers=_auth(USER_KEY)).status_code == 200
        assert http.get(url + "/health").status_code == 200  # load balancers probe without keys


def _channel(address: str, certs: Certs, *, client_cert: bool = True, tls: bool = True):
    if not tls:
        return grpc.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=certs.read("ca"),
        private_key=certs.read("key") if client_cert else None,
        certificate_chain=certs.read("cert") if client_cert else None,
    )
    return grpc.secure_channel(address, credentials)


def _probe(channel: grpc.Channel, bootstrap: bool, token: str | None) -> grpc.StatusCode:
    metadata = [(TOKEN_HEADER, token)] if token is not None else None
    try:
        if bootstrap:
            stub = bootstrap_pb2_grpc.BootstrapStub(channel)
            stub.ListNodes(pb.ListNodesRequest(), timeout=WAIT_S, metadata=metadata)
        else:
            node = node_pb2_grpc.NodeStub(channel)
            node.Health(node_pb2.HealthRequest(), timeout=WAIT_S, metadata=metadata)
    except grpc.RpcError as exc:
        assert TOKEN not in (exc.details() or "")  # refusals never echo the token
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_internal_grpc_needs_token_and_client_cert(
    secure_cluster: RunningCluster, certs: Certs
) -> None:
    for name in ("bootstrap", "prefill-0", "decode-0"):
        address = secure_cluster.node_address(name)
        bootstrap = name == "bootstrap"
        with _channel(address, certs) as channel:
            assert _probe(channel, bootstrap, TOKEN) == grpc.StatusCode.OK, name
            assert _probe(channel, bootstrap, None) == grpc.StatusCode.UNAUTHENTICATED, name
            assert _probe(channel, bootstrap, "guess") == grpc.StatusCode.UNAUTHENTICATED, name
            try:
                node_pb2_grpc.NodeStub(channel).Health(node_pb2.HealthRequest(), timeout=WAIT_S)
            except grpc.RpcError as exc:
                assert "internal token" in (exc.details() or "")
            if not bootstrap:  # the per-step stream too (a bidirectional call)
                opens = iter([node_pb2.StreamRequest(cancel_rid="nothing")])
                with pytest.raises(grpc.RpcError) as refused:
                    list(node_pb2_grpc.NodeStub(channel).GenerateStream(opens, timeout=WAIT_S))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        # Right token, but no client certificate, a rogue one, or no TLS: no connection.
        with _channel(address, certs, client_cert=False) as channel:
            assert _probe(channel, bootstrap, TOKEN) == grpc.StatusCode.UNAVAILABLE, name
        rogue = grpc.ssl_channel_credentials(
            certs.read("ca"), certs.read("rogue_key"), certs.read("rogue_cert")
        )
        with grpc.secure_channel(address, rogue) as channel:
            assert _probe(channel, bootstrap, TOKEN) == grpc.StatusCode.UNAVAILABLE, name
        with _channel(address, certs, tls=False) as channel:
            assert _probe(channel, bootstrap, TOKEN) == grpc.StatusCode.UNAVAILABLE, name

    # The token is in no child's argv and in no log line (pd-cluster relays every child's log).
    assert TOKEN not in secure_cluster.log()
    for name in ("bootstrap", "prefill-0", "decode-0", "gateway"):
        cmdline = Path(f"/proc/{secure_cluster.child_pid(name)}/cmdline").read_bytes()
        assert TOKEN.encode() not in cmdline and b"--internal-token-file" in cmdline, name


def test_pdserve_admin_carries_the_token_over_mutual_tls(
    secure_cluster: RunningCluster, certs: Certs, tmp_path: Path
) -> None:
    """pdserve-admin is an internal client like the others: without the token the bootstrap
    refuses it (and says which flag to give); with it, over mutual TLS, it lists the nodes and
    switches the prefill node's role there and back (SwitchRole is token-checked too)."""
    import subprocess
    import sys

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")

    def admin(*argv: str) -> subprocess.CompletedProcess[str]:
        where = ["--bootstrap", secure_cluster.node_address("bootstrap"), "--tls-ca", str(certs.ca)]
        where += ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]
        return subprocess.run([sys.executable, "-m", "bootstrap.admin", *argv, *where],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    refused = admin("list-nodes")
    assert refused.returncode == 1 and "--internal-token-file" in refused.stderr
    listed = admin("list-nodes", "--internal-token-file", str(token_file))
    assert listed.returncode == 0, listed.stderr
    roles = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[1:]}
    (prefill,) = [node for node, role in roles.items() if role == "prefill"]
    for role in ("decode", "prefill"):
        done = admin("switch-role", prefill, role, "--internal-token-file", str(token_file))
        assert done.returncode == 0 and f"-> {role} in" in done.stdout, done.stderr
    assert TOKEN not in listed.stdout + listed.stderr


# -- room ownership ----------------------------------------------------------------------------

LAYOUT = pb.KVLayout(
    model_id="m", num_layers=2, num_kv_heads=2, head_dim=16, page_size=16, dtype="float32"
)


def _ready_with_token(channel: grpc.Channel) -> bool:
    stub = bootstrap_pb2_grpc.BootstrapStub(channel)
    stub.ListNodes(pb.ListNodesRequest(), timeout=5, metadata=[(TOKEN_HEADER, TOKEN)])
    return True


@pytest.fixture(scope="module")
def guarded_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeServer]:
    tmp = tmp_path_factory.mktemp("guarded-bootstrap")
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    room_key = tmp / "room-key"
    room_key.write_text(ROOM_KEY)
    with running_node(
        "bootstrap-server",
        [
            *("--internal-token-file", str(token_file), "--heartbeat-timeout", "120"),
            *("--room-key-file", str(room_key)),
        ],
        tmp / "bootstrap.log",
        probe=_ready_with_token,
    ) as server:
        yield server


def _info(role: int, port: int) -> pb.NodeInfo:
    return pb.NodeInfo(role=role, grpc_address=f"127.0.0.1:{port}", layout=LAYOUT)


async def _node(address: str, role: int, port: int) -> tuple[BootstrapClient, str]:
    """A client registered as a node, calling with that node's credential from then on."""
    client = BootstrapClient(address, auth=InternalAuth(TOKEN))
    response = await client.register(_info(role, port))
    client.identify(response.node_id, response.node_secret)
    return client, response.node_id


async def _denied(call: object, *names: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
    details = info.value.details() or ""
    for name in names:
        assert name in details, (name, details)
    return details


def _run_rooms(address: str, scenario) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        clients = []
        try:
            for role, port in ((pb.PREFILL, 1), (pb.DECODE, 2), (pb.DECODE, 3)):
                clients.append(await _node(address, role, port))
            await scenario(*clients)
        finally:
            for client, _ in clients:
                await client.close()

    asyncio.run(main())


def _destination(
    room: int, prefill: str, decode: str, ticket: str | None = None
) -> pb.RoomDestination:
    """D's destination; with the ticket the gateway gave D for (room, P, D) unless one is given."""
    return pb.RoomDestination(
        room=room,
        prefill_node_id=prefill,
        decode_node_id=decode,
        page_ids=[5, 6],
        aux_slot=1,
        ticket=TICKETS.issue(room, prefill, decode) if ticket is None else ticket,
    )


async def _next(stream):  # type: ignore[no-untyped-def]
    return await asyncio.wait_for(anext(stream), WAIT_S)


def test_destination_hijack_rejected(guarded_bootstrap: NodeServer) -> None:
    """Only the decode node named in a room's destination may post it; the real room goes on."""

    async def scenario(p, d, intruder) -> None:  # type: ignore[no-untyped-def]
        (p_client, p_id), (d_client, d_id), (i_client, i_id) = p, d, intruder
        room = 0x5EC0001
        await d_client.post_destination(_destination(room, p_id, d_id))
        # The intruder (a registered decode node holding the token) posts as the real D:
        # for the open room, and for a room D has not posted yet.
        await _denied(i_client.post_destination(_destination(room, p_id, d_id)), str(room), d_id)
        await _denied(i_client.post_destination(_destination(room + 1, p_id, d_id)), d_id, i_id)
        # ... with D's id but not D's secret.
        forged = BootstrapClient(guarded_bootstrap.address, auth=InternalAuth(TOKEN))
        forged.identify(d_id, "not-the-secret")
        try:
            await _denied(forged.post_destination(_destination(room + 2, p_id, d_id)), d_id)
            await _denied(forged.deregister(d_id), d_id)
        finally:
            await forged.close()
        # ... and cannot read P's destinations (the page ids of D's memory) either.
        await _denied(_next(i_client.watch_destinations(p_id)), p_id)
        # The real room is untouched: P gets D's destination, D gets P's DONE.
        got = await _next(p_client.watch_destinations(p_id))
        assert (got.room, got.decode_node_id, list(got.page_ids)) == (room, d_id, [5, 6])
        await p_client.post_room_status(
            pb.RoomStatus(room=room, prefill_node_id=p_id, state=pb.DONE)
        )
        status = await _next(d_client.watch_room_status(d_id))
        assert (status.room, status.state) == (room, pb.DONE)

    _run_rooms(guarded_bootstrap.address, scenario)


def test_room_opened_only_by_its_assigned_decode_node(guarded_bootstrap: NodeServer) -> None:
    """The gateway assigned a room to D (the room ticket); another decode node that learnt the
    room number cannot open it for itself, with no ticket, D's ticket or a made-up one."""

    async def scenario(p, d, intruder) -> None:  # type: ignore[no-untyped-def]
        (p_client, p_id), (d_client, d_id), (i_client, i_id) = p, d, intruder
        room = 0x5EC0201
        for ticket in ("", TICKETS.issue(room, p_id, d_id), "f" * 32):
            details = await _denied(
                i_client.post_destination(_destination(room, p_id, i_id, ticket)), str(room)
            )
            assert "room ticket" in details and i_id in details
        # Nothing was opened: the assigned D opens the room and P gets D's pages.
        await d_client.post_destination(_destination(room, p_id, d_id))
        got = await _next(p_client.watch_destinations(p_id))
        assert (got.room, got.decode_node_id) == (room, d_id)

    _run_rooms(guarded_bootstrap.address, scenario)


def test_completion_hijack_rejected(guarded_bootstrap: NodeServer) -> None:
    """Only the room's prefill node may report it done or failed; the real room goes on."""

    async def scenario(p, d, intruder) -> None:  # type: ignore[no-untyped-def]
        (p_client, p_id), (d_client, d_id), (i_client, i_id) = p, d, intruder
        room = 0x5EC0101
        statuses = d_client.watch_room_status(d_id)
        await d_client.post_destination(_destination(room, p_id, d_id))
        got = await _next(p_client.watch_destinations(p_id))
        assert got.room == room
        done = pb.RoomStatus(room=room, prefill_node_id=p_id, state=pb.DONE)
        await _denied(i_client.post_room_status(done), str(room), p_id, i_id)
        failed = pb.RoomStatus(room=room, prefill_node_id=p_id, state=pb.FAILED, reason="x")
        await _denied(i_client.post_room_status(failed), str(room), p_id)
        await _denied(i_client.fail_room(room, p_id, "hijack"), str(room), p_id)
        await _denied(i_client.fail_room(room, d_id, "hijack"), str(room), d_id)
        await _denied(_next(i_client.watch_room_status(d_id)), d_id)
        # Nothing reached D; the real P finishes the room and D hears exactly that.
        progress = pb.RoomStatus(room=room, prefill_node_id=p_id, state=pb.TRANSFERRING)
        await p_client.post_room_status(progress)
        assert (await _next(statuses)).state == pb.TRANSFERRING
        await p_client.post_room_status(done)
        final = await _next(statuses)
        assert (final.room, final.state, final.prefill_node_id) == (room, pb.DONE, p_id)

    _run_rooms(guarded_bootstrap.address, scenario)


def test_outsider_without_token_cannot_register(guarded_bootstrap: NodeServer) -> None:
    async def scenario() -> None:
        async with BootstrapClient(guarded_bootstrap.address) as outsider:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await outsider.stub.Register(pb.RegisterRequest(node=_info(pb.DECODE, 9)))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "internal token" in (info.value.details() or "")

    asyncio.run(scenario())


def test_frozen_prefill_node_keeps_its_id_until_declared_dead(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Identity tokens on: a second process started with a live prefill node's --node-id is
    refused (and keeps trying). Once the first one is frozen (SIGSTOP) and the bootstrap
    declared it dead, the newcomer takes the id; the frozen one, thawed, cannot take it back:
    its heartbeats do not carry the new registration's secret."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    auth = ["--internal-token-file", str(token_file)]
    with running_node(
        "bootstrap-server",
        [*auth, "--heartbeat-timeout", "3", "--heartbeat-interval", "0.5"],
        tmp_path / "bootstrap.log",
        probe=_ready_with_token,
    ) as bootstrap:
        args = ["--model", str(tiny_model), "--bootstrap", bootstrap.address, *auth]
        args += ["--transfer-backend", "mooncake", "--node-id", "fixed"]
        first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
        token = [(TOKEN_HEADER, TOKEN)]
        stub = bootstrap_pb2_grpc.BootstrapStub(grpc.insecure_channel(bootstrap.address))

        def holder() -> str:
            nodes = stub.ListNodes(pb.ListNodesRequest(), timeout=5, metadata=token).nodes
            return next((s.node.grpc_address for s in nodes if s.node.node_id == "fixed"), "")

        with running_node("prefill-server", args, first_log, probe=_registered_with_token) as first:
            _wait_for(lambda: holder() == first.address)  # (Health shows a given id at once)
            try:
                with ThreadPoolExecutor(1) as pool:
                    second_node = running_node(
                        "prefill-server", args, second_log, probe=_registered_with_token
                    )
                    starting = pool.submit(_enter, second_node)
                    _wait_for(
                        lambda: "id fixed is taken by a live prefill node" in _text(second_log)
                    )
                    assert holder() == first.address  # the newcomer is refused, and retries
                    os.kill(first.pid, signal.SIGSTOP)
                    second_context, second = starting.result(timeout=120)
                try:
                    _wait_for(lambda: holder() == second.address)  # the frozen one is dead
                    os.kill(first.pid, signal.SIGCONT)
                    _wait_for(lambda: "PERMISSION_DENIED" in _text(first_log))
                    assert holder() == second.address
                finally:
                    second_context.__exit__(None, None, None)
            finally:
                os.kill(first.pid, signal.SIGCONT)


def _registered_with_token(channel: grpc.Channel) -> bool:
    health = node_pb2_grpc.NodeStub(channel).Health(
        node_pb2.HealthRequest(), timeout=5, metadata=[(TOKEN_HEADER, TOKEN)]
    )
    return bool(health.ok and health.node_id)


def _enter(context: AbstractContextManager[NodeServer]) -> tuple[Any, NodeServer]:
    return context, context.__enter__()


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_tls_config_rejects_half_configurations() -> None:
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        TLSConfig(cert=b"x")
    with pytest.raises(ValueError, match="--tls-ca"):
        TLSConfig(cert=b"x", key=b"y", require_client_cert=True)
    assert "secret" not in repr(InternalAuth("secret"))
    assert ROOM_KEY not in repr(TICKETS)
    with pytest.raises(ValueError, match="16 bytes"):
        RoomTickets(b"short")


def test_api_keys_file_parsing(tmp_path: Path) -> None:
    from gateway.config import ADMIN, INFERENCE
    from gateway.process.server import api_keys, build_parser

    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\nk1\nk2 admin\nk3 inference,admin  # both\n\n")
    args = build_parser().parse_args(
        ["--bootstrap", "x", "--api-keys-file", str(keys_file), "--admin-api-key", "k4"]
    )
    scopes = {k.key: k.scopes for k in api_keys(args)}
    assert scopes == {
        "k1": {INFERENCE},
        "k2": {ADMIN},
        "k3": {INFERENCE, ADMIN},
        "k4": {ADMIN},
    }
    keys_file.write_text("k1 root\n")
    with pytest.raises(ValueError, match="scope 'root' is unknown"):
        api_keys(args)
