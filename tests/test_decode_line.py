"""Late binding to a decode node (gateway/dispatch/decode_line.py): requests that find every decode
node at its running-request cap wait at the gateway, first come first served, and go to the first
node that has room; at most --decode-hold. The real-process check is in
tests/test_gateway_routing.py (`test_a_request_waits_for_the_first_decode_node_with_room`)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from gateway.dispatch.decode_line import DecodeLine
from gateway.dispatch.dispatcher import Dispatcher
from gateway.metrics import GatewayMetrics
from gateway.routing.nodes import DECODE, PREFILL, NodeDirectory
from gateway.routing.policies import Route
from proto import bootstrap_pb2
from tests.test_kv_index_units import ROUTING, _node

ROUND_ROBIN = replace(ROUTING, prefill_policy="round_robin", decode_policy="round_robin")


def _capped(running: int, cap: int = 1) -> bootstrap_pb2.NodeLoad:
    return bootstrap_pb2.NodeLoad(running_requests=running, max_running_requests=cap)


def _cluster(hold_s: float) -> tuple[NodeDirectory, Dispatcher]:
    """One prefill node and two decode nodes with a cap of one request, both running one."""
    directory = NodeDirectory(cooldown_s=5.0)
    for node in (_node("p", PREFILL), _node("d1", DECODE), _node("d2", DECODE)):
        directory.nodes[node.node_id] = node
    for node_id in ("d1", "d2"):
        directory.nodes[node_id].inflight = directory.nodes[node_id].decoding = 1
        directory.nodes[node_id].load = _capped(1)
    config = replace(ROUND_ROBIN, decode_hold_s=hold_s)
    return directory, Dispatcher(directory, config, GatewayMetrics())


def _load_event(node_id: str, load: bootstrap_pb2.NodeLoad) -> bootstrap_pb2.NodeEvent:
    event = bootstrap_pb2.NodeEvent(kind=bootstrap_pb2.NodeEvent.LOAD)
    event.status.node.node_id = node_id
    event.status.load.CopyFrom(load)
    return event


def test_the_line_serves_in_arrival_order_and_each_request_looks_again_on_a_wake() -> None:
    async def scenario() -> list[str]:
        line = DecodeLine(hold_s=5.0)
        slots = [0]  # free decode slots
        served: list[str] = []

        async def request(name: str) -> None:
            assert line.must_wait(lambda: slots[0] == 0)
            assert await line.turn(lambda: slots[0] == 0)
            slots[0] -= 1  # routed: it takes the slot before anyone else runs
            served.append(name)

        tasks = [asyncio.create_task(request(name)) for name in ("a", "b", "c")]
        await asyncio.sleep(0.01)
        assert len(line) == 3 and not served
        line.wake()  # nothing changed: the first looks and waits again
        await asyncio.sleep(0.01)
        assert not served
        slots[0] = 2
        line.wake()
        await asyncio.sleep(0.01)
        assert served == ["a", "b"] and len(line) == 1  # two slots: the first two, in order
        slots[0] = 1
        line.wake()
        await asyncio.gather(*tasks)
        assert len(line) == 0 and slots == [0]
        assert not line.must_wait(lambda: False)  # an empty line: only a full cluster waits
        return served

    assert asyncio.run(scenario()) == ["a", "b", "c"]


def test_a_request_gives_up_waiting_after_the_hold_and_one_behind_it_moves_up() -> None:
    async def scenario() -> None:
        line = DecodeLine(hold_s=0.05)
        first = asyncio.create_task(line.turn(lambda: True))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(line.turn(lambda: False))
        await asyncio.sleep(0.01)
        assert not second.done()  # behind the first, though it has room
        assert await first is False  # waited hold_s: route it anyway
        assert await second is True  # the first left the line, so the next looked
        assert len(line) == 0
        assert await DecodeLine(hold_s=0).turn(lambda: True) is False  # --decode-hold 0

    asyncio.run(scenario())


def test_a_cancelled_request_leaves_the_line() -> None:
    async def scenario() -> None:
        line = DecodeLine(hold_s=5.0)
        gone = asyncio.create_task(line.turn(lambda: True))
        await asyncio.sleep(0.01)
        gone.cancel()  # the HTTP client went away
        await asyncio.sleep(0.01)
        assert len(line) == 0

    asyncio.run(scenario())


def test_a_held_request_goes_to_the_decode_node_that_frees_a_slot_first() -> None:
    """Both decode nodes at their cap of one: the request waits, and when d2's stream ends it
    goes to d2 (round robin would have sent it to d1, where it would wait for d1's stream)."""

    async def scenario() -> None:
        directory, dispatcher = _cluster(hold_s=5.0)
        assert dispatcher.router.decode_blocked()
        held = asyncio.create_task(dispatcher.hold((), "r"))
        await asyncio.sleep(0.01)
        assert not held.done() and len(dispatcher.line) == 1
        d2 = directory.nodes["d2"]
        dispatcher.leave(Route(d2, None), decoding=True)  # its stream ended; the heartbeat: 1
        assert d2.slots_taken == 0 and not d2.at_cap
        await asyncio.wait_for(held, 1)
        assert dispatcher.router.choose(list(range(40))).decode is d2

    asyncio.run(scenario())


def test_a_heartbeat_or_a_joining_node_wakes_the_line() -> None:
    async def scenario() -> None:
        directory, dispatcher = _cluster(hold_s=5.0)
        directory.nodes["d1"].decoding = 0  # another gateway's request: only its heartbeat says
        held = asyncio.create_task(dispatcher.hold((), "r"))
        await asyncio.sleep(0.01)
        assert not held.done()
        directory.apply(_load_event("d1", _capped(0)))  # its stream ended
        await asyncio.wait_for(held, 1)

        directory.nodes["d1"].load = _capped(1)
        held = asyncio.create_task(dispatcher.hold((), "r2"))
        await asyncio.sleep(0.01)
        assert not held.done()
        joined = bootstrap_pb2.NodeEvent(kind=bootstrap_pb2.NodeEvent.JOINED)
        joined.status.node.node_id, joined.status.node.role = "d3", DECODE
        joined.status.node.grpc_address = "127.0.0.1:1"
        directory.apply(joined)  # e.g. a prefill node switched to decode
        await asyncio.wait_for(held, 1)
        await directory.close()

    asyncio.run(scenario())


def test_a_hold_that_expires_is_counted_and_routes_as_before() -> None:
    async def scenario() -> None:
        _, dispatcher = _cluster(hold_s=0.05)
        await dispatcher.hold((), "r")  # nobody frees a slot
        assert len(dispatcher.line) == 0
        text = dispatcher.metrics.render().decode()
        assert "pdserve_gateway_decode_hold_expired_total 1.0" in text
        assert "pdserve_gateway_decode_hold_seconds_count 1.0" in text
        assert "pdserve_gateway_decode_held 0.0" in text
        assert dispatcher.router.choose(list(range(40))).decode.node_id in {"d1", "d2"}

    asyncio.run(scenario())


def test_no_wait_while_a_node_has_room_or_for_a_failed_node() -> None:
    async def scenario() -> None:
        directory, dispatcher = _cluster(hold_s=5.0)
        directory.nodes["d1"].decoding = 0
        directory.nodes["d1"].load = _capped(0)
        await asyncio.wait_for(dispatcher.hold((), "r"), 0.5)  # d1 has room
        assert dispatcher.router.decode_blocked(excluded={"d1"})  # d2 alone is at its cap
        assert not dispatcher.router.decode_blocked(excluded={"d1", "d2"})  # none: fail at once
        text = dispatcher.metrics.render().decode()
        assert "pdserve_gateway_decode_hold_seconds_count 0.0" in text

    asyncio.run(scenario())


def test_requests_still_prefilling_elsewhere_take_no_slot() -> None:
    """A decode node's rooms in transfer or waiting for their prefill do not count against its
    cap: holding them would cap how many requests the prefill nodes work on (a 2P1D cluster
    in a prefill-heavy phase keeps more than its decode cap in flight). A request counts from
    its first token, or at once when the decode node prefills it itself."""
    directory, dispatcher = _cluster(hold_s=5.0)
    d1 = directory.nodes["d1"]
    d1.decoding, d1.inflight = 0, 4
    d1.load = bootstrap_pb2.NodeLoad(
        running_requests=0, transfer_queue=3, bootstrap_queue=1, max_running_requests=1
    )
    assert d1.busy == 4 and d1.slots_taken == 0 and not d1.at_cap
    assert not dispatcher.router.decode_blocked()
    prefill = directory.nodes["p"]
    remote, local = Route(d1, prefill), Route(d1, None)
    dispatcher.enter(remote)
    assert d1.slots_taken == 0
    dispatcher.decoding(remote)  # its first token came
    assert d1.slots_taken == 1 and d1.at_cap
    dispatcher.leave(remote, decoding=True)
    dispatcher.enter(local)
    assert d1.slots_taken == 1
    dispatcher.leave(local, decoding=True)
    assert d1.slots_taken == 0


def test_a_request_the_line_releases_takes_its_slot_before_the_next_looks() -> None:
    """PD: a request counts against its decode node from its first token, unless the line
    released it. Were it not counted at once, the next in line would see the same free slot
    and the whole line would go to one node's queue on one wake."""

    async def scenario() -> None:
        directory, dispatcher = _cluster(hold_s=5.0)
        prefill, d2 = directory.nodes["p"], directory.nodes["d2"]

        async def request() -> Route:
            released = await dispatcher.hold((), "r")
            route = Route(dispatcher.router.choose(list(range(40))).decode, prefill)
            assert dispatcher.enter(route, takes_slot=released) == released
            return route

        first, second = asyncio.create_task(request()), asyncio.create_task(request())
        await asyncio.sleep(0.01)
        assert len(dispatcher.line) == 2
        dispatcher.leave(Route(d2, None), decoding=True)  # d2's stream ended: one slot
        route = await asyncio.wait_for(first, 1)
        assert route.decode is d2 and d2.slots_taken == 1 and d2.at_cap
        await asyncio.sleep(0.01)
        assert not second.done() and len(dispatcher.line) == 1  # no slot left for it
        dispatcher.leave(route, decoding=True)  # before its first token (e.g. it failed)
        assert (await asyncio.wait_for(second, 1)).decode is d2

    asyncio.run(scenario())


def test_with_the_line_off_nothing_waits_and_nothing_is_counted() -> None:
    """--decode-hold 0 (the default): a request finding every node at its cap is routed at
    once, into a node's queue, as before late binding."""

    async def scenario() -> None:
        _, dispatcher = _cluster(hold_s=0)
        assert dispatcher.router.decode_blocked()
        await asyncio.wait_for(dispatcher.hold((), "r"), 0.5)
        text = dispatcher.metrics.render().decode()
        assert "pdserve_gateway_decode_hold_seconds_count 0.0" in text
        assert "pdserve_gateway_decode_hold_expired_total 0.0" in text

    asyncio.run(scenario())
