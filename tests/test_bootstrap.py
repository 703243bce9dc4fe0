"""End-to-end tests of `bootstrap-server` (a real subprocess) and of `bootstrap/client.py`.

Scenarios on one shared server use unique node ids and room numbers, and skip other tests'
events. Timeouts are generous upper bounds only; no test asserts how fast something happens.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from bootstrap.client import (
    BootstrapClient,
    BootstrapUnreachable,
    NodeSession,
    RegistrationRefused,
    RetryPolicy,
)
from bootstrap.security import NODE_ID_HEADER, NODE_SECRET_HEADER
from engine.ports import free_port
from proto import bootstrap_pb2 as pb
from proto import bootstrap_pb2_grpc

T = TypeVar("T")
WAIT_S = 20.0  # upper bound for anything to arrive; never a timing assertion
LAYOUT = pb.KVLayout(
    model_id="tiny", num_layers=2, num_kv_heads=2, head_dim=16, page_size=16, dtype="bfloat16"
)
_rooms = itertools.count(1000)
NodeEvent = pb.NodeEvent


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=WAIT_S)


def start_server(log_dir: Path, *flags: str, port: int | None = None) -> Server:
    port = port or free_port()
    log = log_dir / f"bootstrap-{port}-{uuid.uuid4().hex[:4]}.log"
    cmd = [sys.executable, "-m", "bootstrap.server", "--port", str(port), *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Server(proc, port, log)
    with grpc.insecure_channel(server.address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=WAIT_S)
        except grpc.FutureTimeoutError:
            server.stop()
            pytest.fail(f"bootstrap-server did not come up:\n{log.read_text()}")
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("bootstrap"), "--heartbeat-timeout", "60")
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path


def run(scenario: Callable[[], object]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))  # type: ignore[arg-type]


def node(role: pb.Role, layout: pb.KVLayout = LAYOUT, node_id: str = "") -> pb.NodeInfo:
    return pb.NodeInfo(
        node_id=node_id,
        role=role,
        grpc_address="127.0.0.1:1",
        transfer_backend="mooncake",
        layout=layout,
    )


def fast_policy() -> RetryPolicy:
    return RetryPolicy(initial_backoff_s=0.05, max_backoff_s=0.5, rpc_timeout_s=5.0)


async def pair(client: BootstrapClient) -> tuple[str, str]:
    """A fresh prefill node and decode node on the shared server: (prefill_id, decode_id)."""
    prefill = await client.register(node(pb.PREFILL))
    decode = await client.register(node(pb.DECODE))
    return prefill.node_id, decode.node_id


def dest(room: int, prefill_id: str, decode_id: str) -> pb.RoomDestination:
    return pb.RoomDestination(
        room=room, prefill_node_id=prefill_id, decode_node_id=decode_id, page_ids=[3, 4]
    )


def room_status(room: int, prefill_id: str, state: pb.RoomState = pb.DONE) -> pb.RoomStatus:
    return pb.RoomStatus(room=room, prefill_node_id=prefill_id, state=state)


async def next_item(stream: AsyncIterator[T]) -> T:
    return await asyncio.wait_for(anext(stream), WAIT_S)


async def next_matching(stream: AsyncIterator[T], wanted: Callable[[T], bool]) -> T:
    while not wanted(item := await next_item(stream)):
        pass
    return item


async def expect_error(call: object, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


def is_event(kind: int, node_id: str) -> Callable[[pb.NodeEvent], bool]:
    return lambda event: event.kind == kind and event.status.node.node_id == node_id


# ---- registry -------------------------------------------------------------------------------


def test_register_list_watch(server: Server) -> None:
    async def scenario() -> None:
        async with BootstrapClient(server.address) as client:
            prefill = await client.register(node(pb.PREFILL))
            assert prefill.node_id.startswith("prefill-")
            assert prefill.heartbeat_interval_s == 1.0
            watch = client.watch_nodes()
            await next_matching(watch, is_event(NodeEvent.JOINED, prefill.node_id))  # snapshot

            decode_id = f"decode-{uuid.uuid4().hex[:6]}"
            capped = pb.NodeLoad(max_running_requests=5, free_pages=64, total_pages=64)
            registered = await client.register(node(pb.DECODE, node_id=decode_id), load=capped)
            assert registered.node_id == decode_id
            joined = await next_matching(watch, is_event(NodeEvent.JOINED, decode_id))
            assert joined.status.load == capped  # its cap is known before its first heartbeat

            prefills = {s.node.node_id for s in await client.list_nodes(pb.PREFILL)}
            decodes = {s.node.node_id for s in await client.list_nodes(pb.DECODE)}
            assert prefill.node_id in prefills and decode_id not in prefills
            assert decode_id in decodes

            await client.heartbeat(decode_id, pb.NodeLoad(running_requests=3, free_pages=7))
            load = await next_matching(watch, is_event(NodeEvent.LOAD, decode_id))
            assert load.status.load.running_requests == 3

            await client.deregister(decode_id)
            left = await next_matching(watch, is_event(NodeEvent.LEFT, decode_id))
            assert not left.status.alive
            assert decode_id not in {s.node.node_id for s in await client.list_nodes()}

    run(scenario)


def test_a_live_id_is_refused_unless_the_same_registration(server: Server) -> None:
    """A second process started with a live node's id (or one guessing its secret) is refused
    and told why; the node itself registers again by proving it holds the secret; once the id
    is free anyone may take it."""

    async def scenario() -> None:
        async with (
            BootstrapClient(server.address, fast_policy()) as first,
            BootstrapClient(server.address, fast_policy()) as second,
        ):
            node_id = f"prefill-{uuid.uuid4().hex[:6]}"
            info = node(pb.PREFILL, node_id=node_id)
            registered = await first.register(info)
            first.identify(node_id, registered.node_secret)

            details = await expect_error(
                second.stub.Register(pb.RegisterRequest(node=info)), grpc.StatusCode.ALREADY_EXISTS
            )
            assert f"node id {node_id} is taken by a live prefill node" in details
            assert "--node-id" in details and "--heartbeat-timeout" in details
            guess = ((NODE_ID_HEADER, node_id), (NODE_SECRET_HEADER, "guessed"))
            await expect_error(
                second.stub.Register(pb.RegisterRequest(node=info), metadata=guess),
                grpc.StatusCode.ALREADY_EXISTS,
            )
            # The client retries (the id frees up when a dead holder is declared dead) and,
            # out of time, says what it was told.
            with pytest.raises(BootstrapUnreachable, match="is taken by a live"):
                await second.register(info, give_up_after_s=0.5)

            again = await first.register(info)  # the same node: it carries its secret
            assert again.node_id == node_id and again.node_secret != registered.node_secret
            assert [s.node.node_id for s in await first.list_nodes()].count(node_id) == 1

            await first.deregister(node_id)
            assert (await second.register(info)).node_id == node_id  # free again

    run(scenario)


def test_register_refusals_name_the_field(server: Server) -> None:
    async def scenario() -> None:
        async with BootstrapClient(server.address) as client:
            await client.register(node(pb.PREFILL))
            other = pb.KVLayout()
            other.CopyFrom(LAYOUT)
            other.head_dim = 128
            with pytest.raises(RegistrationRefused) as info:
                await client.register(node(pb.DECODE, layout=other))
            message = str(info.value)
            assert "layout.head_dim" in message and "128" in message and "16" in message
            assert " node " in message  # names the node it conflicts with

            # Tensor parallelism may differ; colocated nodes never exchange KV.
            tp = pb.KVLayout()
            tp.CopyFrom(LAYOUT)
            tp.tp_size, tp.tp_rank = 2, 1
            await client.register(node(pb.DECODE, layout=tp))
            await client.register(node(pb.COLOCATED, layout=other))

            no_address = node(pb.DECODE)
            no_address.grpc_address = ""
            details = await expect_error(
                client.stub.Register(pb.RegisterRequest(node=no_address)),
                grpc.StatusCode.INVALID_ARGUMENT,
            )
            assert "grpc_address" in details
            details = await expect_error(
                client.stub.Register(pb.RegisterRequest(node=node(pb.ROLE_UNSPECIFIED))),
                grpc.StatusCode.INVALID_ARGUMENT,
            )
            assert "role" in details

    run(scenario)


def test_heartbeat_of_unknown_node_is_not_found(server: Server) -> None:
    async def scenario() -> None:
        async with BootstrapClient(server.address) as client:
            details = await expect_error(
                client.heartbeat("ghost-1", pb.NodeLoad()), grpc.StatusCode.NOT_FOUND
            )
            assert details == "unknown node ghost-1: re-register"

    run(scenario)


# ---- rooms ----------------------------------------------------------------------------------


def test_rendezvous_decode_posts_before_prefill_subscribes(server: Server) -> None:
    async def scenario() -> None:
        async with BootstrapClient(server.address) as client:
            prefill_id, decode_id = await pair(client)
            room = next(_rooms)
            await client.post_destination(dest(room, prefill_id, decode_id))
            got = await next_item(client.watch_destinations(prefill_id))
            assert (got.room, list(got.page_ids), got.cancelled) == (room, [3, 4], False)

            await client.post_room_status(room_status(room, prefill_id))
            status = await next_item(client.watch_room_status(decode_id))  # buffered for D
            assert (status.room, status.state, status.decode_node_id) == (room, pb.DONE, decode_id)

    run(scenario)


def test_rendezvous_prefill_subscribes_first(server: Server) -> None:
    async def scenario() -> None:
        async with BootstrapClient(server.address) as client:
            prefill_id, decode_id = await pair(client)
            destinations = client.watch_destinations(prefill_id)
            statuses = client.watch_room_status(decode_id)
            room = next(_rooms)
            pending = asyncio.ensure_future(next_item(destinations))
            await asyncio.sleep(0.2)  # let the stream open first (order only, not timing)
            await client.post_destination(dest(room, prefill_id, decode_id))
            assert (await pending).room == room

            pending_status = asyncio.ensure_future(next_item(statuses))
            progress = room_status(room, prefill_id, pb.TRANSFERRING)
            await client.post_room_status(progress)
            assert (await pending_status).state == pb.TRANSFERRING
            await client.post_room_status(room_status(room, prefill_id))
            assert (await next_item(statuses)).state == pb.DONE

            # The room is closed: its number may be reused, a late post is NOT_FOUND.
            await expect_error(
                client.post_room_status(room_status(room, prefill_id)),
                grpc.StatusCode.NOT_FOUND,
            )

    run(scenario)


def test_post_destination_refusals(server: Server) -> None:
    async def scenario() -> None:
        async with BootstrapClient(server.address) as client:
            prefill_id, decode_id = await pair(client)
            room = next(_rooms)
            await client.post_destination(dest(room, prefill_id, decode_id))
            details = await expect_error(
                client.post_destination(dest(room, prefill_id, decode_id)),
                grpc.StatusCode.ALREADY_EXISTS,
            )
            assert f"room {room}" in details
            await expect_error(
                client.post_destination(dest(0, prefill_id, decode_id)),
                grpc.StatusCode.INVALID_ARGUMENT,
            )
            details = await expect_error(
                client.post_destination(dest(next(_rooms), "nobody", decode_id)),
                grpc.StatusCode.FAILED_PRECONDITION,
            )
            assert "nobody" in details
            await expect_error(
                client.post_destination(dest(next(_rooms), prefill_id, "ghost")),
                grpc.StatusCode.NOT_FOUND,
            )
            await expect_error(  # a prefill node cannot post destinations
                client.post_destination(dest(next(_rooms), prefill_id, prefill_id)),
                grpc.StatusCode.FAILED_PRECONDITION,
            )

    run(scenario)


def test_room_status_from_the_wrong_node_is_denied(server: Server) -> None:
    async def scenario() -> None:
        async with BootstrapClient(server.address) as client:
            prefill_id, decode_id = await pair(client)
            room = next(_rooms)
            await client.post_destination(dest(room, prefill_id, decode_id))
            status = pb.RoomStatus(room=room, prefill_node_id="intruder", state=pb.DONE)
            details = await expect_error(
                client.post_room_status(status), grpc.StatusCode.PERMISSION_DENIED
            )
            assert f"room {room}" in details and prefill_id in details and "intruder" in details
            details = await expect_error(
                client.fail_room(room, "intruder", "x"), grpc.StatusCode.PERMISSION_DENIED
            )
            assert f"room {room}" in details
            await expect_error(
                client.post_room_status(pb.RoomStatus(room=next(_rooms), prefill_node_id="p")),
                grpc.StatusCode.NOT_FOUND,
            )

    run(scenario)


def test_fail_room_before_and_after_delivery(server: Server) -> None:
    async def scenario() -> None:
        async with BootstrapClient(server.address) as client:
            prefill_id, decode_id = await pair(client)
            undelivered, delivered, by_prefill = next(_rooms), next(_rooms), next(_rooms)
            await client.post_destination(dest(undelivered, prefill_id, decode_id))
            assert await client.fail_room(undelivered, decode_id, "client went away")

            await client.post_destination(dest(delivered, prefill_id, decode_id))
            destinations = client.watch_destinations(prefill_id)
            assert (await next_item(destinations)).room == delivered  # never the undelivered one
            assert not await client.fail_room(delivered, decode_id, "client went away")
            cancel = await next_item(destinations)
            assert (cancel.room, cancel.cancelled) == (delivered, True)
            assert not await client.fail_room(delivered, decode_id, "again")  # still cancelling
            await client.post_room_status(
                pb.RoomStatus(
                    room=delivered, prefill_node_id=prefill_id, state=pb.FAILED, reason="stopped"
                )
            )
            statuses = client.watch_room_status(decode_id)
            status = await next_item(statuses)
            assert (status.room, status.state, status.reason) == (delivered, pb.FAILED, "stopped")

            # FailRoom by the prefill node works like PostRoomStatus(FAILED).
            await client.post_destination(dest(by_prefill, prefill_id, decode_id))
            assert (await next_item(destinations)).room == by_prefill
            assert await client.fail_room(by_prefill, prefill_id, "out of memory")
            status = await next_item(statuses)
            assert (status.room, status.state, status.reason) == (
                by_prefill,
                pb.FAILED,
                "out of memory",
            )

    run(scenario)


def test_stream_disconnect_keeps_pending_items(server: Server) -> None:
    async def scenario() -> None:
        async with BootstrapClient(server.address) as client:
            prefill_id, decode_id = await pair(client)
            stub = bootstrap_pb2_grpc.BootstrapStub(client.channel)
            first, second = next(_rooms), next(_rooms)
            for room in (first, second):
                await client.post_destination(dest(room, prefill_id, decode_id))

            call = stub.WatchDestinations(pb.WatchDestinationsRequest(prefill_node_id=prefill_id))
            assert (await asyncio.wait_for(call.read(), WAIT_S)).room == first
            call.cancel()  # P's stream breaks with `second` still queued

            again = client.watch_destinations(prefill_id)
            # At-least-once: `first` may come again if its acknowledgement raced the cancel.
            assert (await next_matching(again, lambda d: d.room != first)).room == second

            for room in (first, second):
                status = room_status(room, prefill_id)
                await client.post_room_status(status)
            call = stub.WatchRoomStatus(pb.WatchRoomStatusRequest(decode_node_id=decode_id))
            assert (await asyncio.wait_for(call.read(), WAIT_S)).room == first
            call.cancel()
            statuses = client.watch_room_status(decode_id)
            assert (await next_matching(statuses, lambda s: s.room != first)).room == second

            # One stream per node id: a second one takes over and the first ends ABORTED.
            takeover = stub.WatchRoomStatus(pb.WatchRoomStatusRequest(decode_node_id=decode_id))
            await asyncio.wait_for(takeover.initial_metadata(), WAIT_S)
            details = await expect_error(next_item(statuses), grpc.StatusCode.ABORTED)
            assert decode_id in details
            takeover.cancel()

    run(scenario)


# ---- liveness, expiry, restart, shutdown (own servers) --------------------------------------


def test_dead_nodes_fail_their_rooms(log_dir: Path) -> None:
    srv = start_server(log_dir, "--heartbeat-timeout", "1", "--heartbeat-interval", "0.2")

    async def scenario() -> None:
        async with BootstrapClient(srv.address, fast_policy()) as client:
            live_decode = NodeSession(client, node(pb.DECODE))
            live_prefill = NodeSession(client, node(pb.PREFILL))
            await live_decode.start()
            await live_prefill.start()
            silent_prefill = (await client.register(node(pb.PREFILL))).node_id
            silent_decode = (await client.register(node(pb.DECODE))).node_id
            to_dead_prefill, from_dead_decode = next(_rooms), next(_rooms)
            await client.post_destination(
                dest(to_dead_prefill, silent_prefill, live_decode.node_id)
            )
            await client.post_destination(
                dest(from_dead_decode, live_prefill.node_id, silent_decode)
            )
            destinations = client.watch_destinations(live_prefill.node_id)
            assert (await next_item(destinations)).room == from_dead_decode  # delivered

            status = await next_item(client.watch_room_status(live_decode.node_id))
            assert (status.room, status.state) == (to_dead_prefill, pb.FAILED)
            assert f"prefill node {silent_prefill} missed heartbeats" in status.reason
            assert "(dead)" in status.reason
            assert not status.may_still_write  # never delivered: P cannot be writing
            cancel = await next_item(destinations)
            assert (cancel.room, cancel.cancelled) == (from_dead_decode, True)

            alive = {s.node.node_id for s in await client.list_nodes()}
            assert alive == {live_decode.node_id, live_prefill.node_id}
            await live_decode.stop()
            await live_prefill.stop()

    try:
        run(scenario)
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_prefill_dead_while_connected_leaves_its_rooms_unsettled(log_dir: Path) -> None:
    """A prefill node that misses heartbeats while its destination stream stays up may only be
    frozen: D hears FAILED with `may_still_write`, and a second FAILED without it once P says it
    stopped writing, or once P's stream closes (its process is gone)."""
    srv = start_server(log_dir, "--heartbeat-timeout", "1", "--heartbeat-interval", "0.2")

    async def scenario() -> None:
        async with BootstrapClient(srv.address, fast_policy()) as client:
            decode = NodeSession(client, node(pb.DECODE))
            await decode.start()
            statuses = client.watch_room_status(decode.node_id)
            frozen = (await client.register(node(pb.PREFILL))).node_id  # never heartbeats
            killed = (await client.register(node(pb.PREFILL))).node_id
            rooms = {frozen: next(_rooms), killed: next(_rooms)}
            streams = {}
            for prefill_id, room in rooms.items():
                await client.post_destination(dest(room, prefill_id, decode.node_id))
                streams[prefill_id] = client.watch_destinations(prefill_id)
                assert (await next_item(streams[prefill_id])).room == room  # delivered

            failed = [await next_item(statuses) for _ in rooms]
            assert {(s.room, s.state, s.may_still_write) for s in failed} == {
                (room, pb.FAILED, True) for room in rooms.values()
            }
            await client.post_room_status(  # the frozen P wakes up and settles its room
                room_status(rooms[frozen], frozen, pb.FAILED)
            )
            settled = await next_item(statuses)
            assert (settled.room, settled.may_still_write) == (rooms[frozen], False)
            assert f"prefill node {frozen} stopped writing" in settled.reason
            await streams[killed].aclose()  # the other one's process dies
            settled = await next_item(statuses)
            assert (settled.room, settled.may_still_write) == (rooms[killed], False)
            assert "connection closed" in settled.reason
            await decode.stop()

    try:
        run(scenario)
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_rooms_expire_after_ttl(log_dir: Path) -> None:
    srv = start_server(log_dir, "--room-ttl", "1")

    async def scenario() -> None:
        async with BootstrapClient(srv.address) as client:
            prefill_id, decode_id = await pair(client)
            room = next(_rooms)
            await client.post_destination(dest(room, prefill_id, decode_id))
            destinations = client.watch_destinations(prefill_id)
            assert (await next_item(destinations)).room == room
            # Delivered: P may be writing, so D hears nothing until P confirms the cancel.
            cancel = await next_item(destinations)
            assert (cancel.room, cancel.cancelled) == (room, True)
            await client.post_room_status(
                pb.RoomStatus(
                    room=room,
                    prefill_node_id=prefill_id,
                    decode_node_id=decode_id,
                    state=pb.FAILED,
                    reason="stopped",
                )
            )
            statuses = client.watch_room_status(decode_id)
            status = await next_item(statuses)
            assert (status.room, status.state, status.reason) == (room, pb.FAILED, "stopped")
            # Never delivered (P does not watch): closed at once, D told.
            queued = next(_rooms)
            other_prefill, _ = await pair(client)
            await client.post_destination(dest(queued, other_prefill, decode_id))
            status = await next_item(statuses)
            assert (status.state, status.reason) == (pb.FAILED, f"room {queued} expired after 1 s")

    try:
        run(scenario)
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_client_reregisters_after_bootstrap_restart(log_dir: Path) -> None:
    flags = ("--heartbeat-interval", "0.2")
    first = start_server(log_dir, *flags)

    async def scenario() -> None:
        nonlocal first
        reregistered = asyncio.Event()

        async def on_reregistered(node_id: str) -> None:
            reregistered.set()

        async with BootstrapClient(first.address, fast_policy()) as client:
            session = NodeSession(client, node(pb.PREFILL), on_reregistered=on_reregistered)
            prefill_id = await session.start()
            nodes = client.watch_nodes()
            await next_matching(nodes, is_event(NodeEvent.JOINED, prefill_id))
            destinations = client.watch_destinations(prefill_id)
            early = asyncio.ensure_future(next_item(destinations))

            assert first.stop() == 0, first.log.read_text()
            first = start_server(log_dir, *flags, port=first.port)
            await asyncio.wait_for(reregistered.wait(), WAIT_S)
            assert session.node_id == prefill_id and session.registrations == 2
            reset = await next_matching(nodes, lambda e: e.kind == NodeEvent.KIND_UNSPECIFIED)
            assert reset.kind == NodeEvent.KIND_UNSPECIFIED  # "forget what you knew"
            await next_matching(nodes, is_event(NodeEvent.JOINED, prefill_id))

            # The reconnected destination stream serves the new bootstrap's rooms.
            decode_id = (await client.register(node(pb.DECODE))).node_id
            room = next(_rooms)
            await client.post_destination(dest(room, prefill_id, decode_id))
            assert (await early).room == room
            await session.stop()

    try:
        run(scenario)
    finally:
        assert first.stop() == 0, first.log.read_text()


def test_sigterm_with_open_streams_exits_zero(log_dir: Path) -> None:
    srv = start_server(log_dir)

    async def scenario() -> None:
        async with BootstrapClient(srv.address) as client:
            prefill_id, _ = await pair(client)
            stub = bootstrap_pb2_grpc.BootstrapStub(client.channel)
            watch = stub.WatchNodes(pb.WatchNodesRequest())
            await asyncio.wait_for(watch.read(), WAIT_S)
            stub.WatchDestinations(pb.WatchDestinationsRequest(prefill_node_id=prefill_id))
            await asyncio.sleep(0.2)
            started = time.monotonic()
            assert await asyncio.to_thread(srv.stop) == 0, srv.log.read_text()
            assert time.monotonic() - started < WAIT_S
            assert "stopped" in srv.log.read_text()

    run(scenario)
