"""`pdserve-admin`: look at and steer a running cluster through its bootstrap.

    pdserve-admin list-nodes --bootstrap HOST:PORT
    pdserve-admin switch-role NODE ROLE --bootstrap HOST:PORT [--drain-timeout S] [--timeout S]
                              [--force]

    pdserve-admin expert-distribution start|stop|dump (NODE --bootstrap HOST:PORT |
                              --address HOST:PORT) [--out FILE]

`list-nodes` prints one line per live node: its id, role, gRPC address and load (requests
running and queued, rooms in transfer and waiting, free of total KV pages, draining).
`switch-role` finds NODE's address in the bootstrap's registry, calls the node's `SwitchRole`
(it drains its current role, keeps its weights, KV pool and node id, and registers again as
ROLE; engine/node/role_switch.py), then waits until the bootstrap lists it in ROLE. It refuses
to turn the last node that decodes into a prefill node (`--force` does it anyway).
`expert-distribution` steers a mixture-of-experts node's recording of tokens per layer and
expert (the node's `ExpertRecording`): `start` opens a window, `stop` ends it, `dump` fetches
the window (JSON, to `--out FILE` or stdout: the input of `pdserve-eplb`; a node started with
`--expert-distribution-out` also writes it there). A node not registered with a bootstrap (a
colocated decode-server) is named by `--address`.

Both talk to the internal gRPC APIs the way every other internal client does: the shared token
(`--internal-token-file FILE`, `--internal-token`, or $PDSERVE_INTERNAL_TOKEN) and TLS flags of
bootstrap/security.py. Exit codes: 0 done (or the node already served ROLE), 1 the node refused
or gave up the switch (the message says why and what to do), 2 bad usage or an unknown node,
3 the bootstrap or the node did not answer in time.

The functions below are what pd-planner's `switch` actuator calls too
(planner/actuators.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from bootstrap.client import BootstrapClient, RetryPolicy
from bootstrap.registry import role_name
from bootstrap.security import InternalAuth, add_internal_auth_args, internal_auth_from_args
from proto import bootstrap_pb2, node_pb2, node_pb2_grpc

ROLES = ("prefill", "decode", "colocated")
DECODING = ("decode", "colocated")  # roles that generate tokens
POLL_S = 0.1


class AdminError(Exception):
    """A command that could not be done; `exit_code` as in the module docstring."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class NodeSummary:
    """One live node as the bootstrap lists it."""

    node_id: str
    role: str
    address: str
    running: int
    queued: int
    transfer_queue: int
    bootstrap_queue: int
    free_pages: int
    total_pages: int
    draining: bool

    @classmethod
    def from_status(cls, status: bootstrap_pb2.NodeStatus) -> NodeSummary:
        node, load = status.node, status.load
        return cls(
            node.node_id,
            role_name(node.role),
            node.grpc_address,
            load.running_requests,
            load.queued_requests,
            load.transfer_queue,
            load.bootstrap_queue,
            load.free_pages,
            load.total_pages,
            load.draining,
        )

    @property
    def busy(self) -> int:
        """Requests and rooms on the node: what a switch would drain."""
        return self.running + self.queued + self.transfer_queue + self.bootstrap_queue

    def line(self) -> str:
        state = "draining" if self.draining else "serving"
        return (
            f"{self.node_id:<20} {self.role:<10} {self.address:<22} {self.running:>7} "
            f"{self.queued:>6} {self.transfer_queue:>8} {self.bootstrap_queue:>9} "
            f"{self.free_pages:>6}/{self.total_pages:<6} {state}"
        )


HEADER = (
    f"{'node':<20} {'role':<10} {'address':<22} {'running':>7} {'queued':>6} {'transfer':>8} "
    f"{'bootstrap':>9} {'free/total pages':<13} state"
)


@dataclass(frozen=True)
class SwitchOutcome:
    node_id: str
    from_role: str
    role: str
    switched: bool  # False: it already served the role
    aborted: int  # requests its drain aborted (the gateway moved their streams)
    seconds: float  # the node's switch, drain included
    registered_s: float  # call sent -> the bootstrap lists it in the new role

    def line(self) -> str:
        if not self.switched:
            return f"node {self.node_id} already serves the {self.role} role: nothing to do"
        return (
            f"node {self.node_id}: {self.from_role} -> {self.role} in {self.seconds:.2f} s "
            f"({self.aborted} requests aborted and moved); registered as {self.role} after "
            f"{self.registered_s:.2f} s"
        )


async def list_nodes(bootstrap: str, auth: InternalAuth | None = None) -> list[NodeSummary]:
    """The live nodes, by id; AdminError(3) when the bootstrap does not answer."""
    async with BootstrapClient(bootstrap, RetryPolicy(rpc_timeout_s=10.0), auth) as client:
        try:
            statuses = await client.list_nodes()
        except grpc.aio.AioRpcError as exc:
            raise _unreachable(f"the bootstrap at {bootstrap}", exc) from None
    return sorted((NodeSummary.from_status(s) for s in statuses if s.alive),
                  key=lambda n: n.node_id)  # fmt: skip


async def switch_role(
    bootstrap: str,
    node_id: str,
    role: str,
    auth: InternalAuth | None = None,
    drain_timeout_s: float | None = None,
    timeout_s: float = 120.0,
    force: bool = False,
) -> SwitchOutcome:
    """Ask node `node_id` to serve `role` and wait until the bootstrap lists it so. Refuses to
    turn the last node that decodes into a prefill node (nothing would serve), unless `force`."""
    if role not in ROLES:
        raise AdminError(f"unknown role {role!r}: use one of {', '.join(ROLES)}", 2)
    auth = auth or InternalAuth()
    started = time.monotonic()
    nodes = await list_nodes(bootstrap, auth)
    node = _find(nodes, bootstrap, node_id)
    decoding = [n for n in nodes if n.role in DECODING and not n.draining]
    if role == "prefill" and decoding == [node] and not force:
        raise AdminError(
            f"{node.role} node {node_id} is the last node that decodes: as a prefill node the "
            "cluster would answer no request; start another decode node first (or --force)",
            1,
        )
    request = node_pb2.SwitchRoleRequest(role=role)
    if drain_timeout_s is not None:
        request.drain_timeout_s = drain_timeout_s
    async with auth.channel(node.address) as channel:
        try:
            answer = await node_pb2_grpc.NodeStub(channel).SwitchRole(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            what = f"{node.role} node {node_id}"
            refused = f"{what} did not switch to {role}"
            raise _node_error(f"{what} at {node.address}", exc, refused) from None
    deadline = started + timeout_s
    while not await _registered_as(bootstrap, node_id, role, auth):
        if time.monotonic() >= deadline:
            raise AdminError(
                f"node {node_id} switched to {role} but the bootstrap did not list it so "
                f"within {timeout_s:.0f} s (--timeout): check its log",
                3,
            )
        await asyncio.sleep(POLL_S)
    return SwitchOutcome(node_id, answer.from_role, answer.role, answer.switched, answer.aborted,
                         answer.seconds, time.monotonic() - started)  # fmt: skip


EXPERT_ACTIONS = {
    "start": node_pb2.ExpertRecordingRequest.START,
    "stop": node_pb2.ExpertRecordingRequest.STOP,
    "dump": node_pb2.ExpertRecordingRequest.DUMP,
}


async def expert_recording(
    address: str, action: str, auth: InternalAuth | None = None, timeout_s: float = 30.0
) -> node_pb2.ExpertRecordingResponse:
    """`action` (EXPERT_ACTIONS) on the expert recording of the node at `address`."""
    request = node_pb2.ExpertRecordingRequest(action=EXPERT_ACTIONS[action])
    async with (auth or InternalAuth()).channel(address) as channel:
        try:
            return await node_pb2_grpc.NodeStub(channel).ExpertRecording(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            what = f"the node at {address}"
            raise _node_error(what, exc, f"{what} refused {action}") from None


async def node_address(bootstrap: str, node_id: str, auth: InternalAuth | None = None) -> str:
    """The gRPC address of live node `node_id`, from the bootstrap's registry."""
    return _find(await list_nodes(bootstrap, auth), bootstrap, node_id).address


def _expert_summary(answer: node_pb2.ExpertRecordingResponse, action: str) -> str:
    state = "recording" if answer.recording else "not recording"
    if not answer.distribution_json:
        return f"{action}: the node is {state}"
    dist = json.loads(answer.distribution_json)
    written = f"; the node wrote it to {answer.written_to}" if answer.written_to else ""
    return (
        f"{action}: {dist['tokens']} tokens over {dist['seconds']:.1f} s, {dist['num_layers']} "
        f"MoE layers x {dist['num_experts']} experts{written}; the node is {state}"
    )


def _find(nodes: list[NodeSummary], bootstrap: str, node_id: str) -> NodeSummary:
    for node in nodes:
        if node.node_id == node_id:
            return node
    known = ", ".join(n.node_id for n in nodes) or "none"
    raise AdminError(
        f"no live node {node_id!r} at the bootstrap {bootstrap} (live: {known}): see "
        "`pdserve-admin list-nodes`",
        2,
    )


async def _registered_as(bootstrap: str, node_id: str, role: str, auth: InternalAuth) -> bool:
    nodes = await list_nodes(bootstrap, auth)
    return any(n.node_id == node_id and n.role == role and not n.draining for n in nodes)


def _node_error(what: str, exc: grpc.aio.AioRpcError, refused: str) -> AdminError:
    """A node call that failed: `what` did not answer (3), or `refused` and its reason (1)."""
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return _unreachable(what, exc)
    return AdminError(f"{refused}: {exc.details()}", 1)


def _unreachable(what: str, exc: grpc.aio.AioRpcError) -> AdminError:
    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:  # the server's words name the flags
        return AdminError(f"{what} refused the call: {exc.details()}", 1)
    return AdminError(f"{what} did not answer ({exc.code().name}): is it running?", 3)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve-admin", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list-nodes", help="print each live node and its load")
    switch = commands.add_parser("switch-role", help="switch a node's role without a restart")
    switch.add_argument("node", help="the node id (see list-nodes)")
    switch.add_argument("role", choices=ROLES)
    switch.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="seconds its in-flight requests get to finish before they are aborted and moved "
        "(default: the node's own --drain-timeout)",
    )
    switch.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="give up waiting for the node to be registered in its new role after this long",
    )
    switch.add_argument(
        "--force", action="store_true", help="switch even the last node that decodes"
    )
    for sub in (listing, switch):
        sub.add_argument("--bootstrap", required=True, help="bootstrap-server host:port")
        add_internal_auth_args(sub)
    experts = commands.add_parser(
        "expert-distribution", help="start, stop or dump a MoE node's expert-load recording"
    )
    experts.add_argument("action", choices=list(EXPERT_ACTIONS))
    experts.add_argument("node", nargs="?", help="the node id (see list-nodes), with --bootstrap")
    where = experts.add_mutually_exclusive_group(required=True)
    where.add_argument("--bootstrap", help="bootstrap-server host:port, to find NODE")
    where.add_argument("--address", help="the node's gRPC host:port (a node with no bootstrap)")
    experts.add_argument(
        "--out", type=Path, default=None, help="dump/stop: write it here (default: stdout)"
    )
    add_internal_auth_args(experts)
    return parser


async def _experts(args: argparse.Namespace, auth: InternalAuth) -> None:
    if bool(args.bootstrap) != bool(args.node):
        raise AdminError(
            "expert-distribution: name the node by its id with --bootstrap HOST:PORT (see "
            "list-nodes), or by --address HOST:PORT alone",
            2,
        )
    address = args.address or await node_address(args.bootstrap, args.node, auth)
    answer = await expert_recording(address, args.action, auth)
    if answer.distribution_json and args.out is not None:
        args.out.write_text(answer.distribution_json)
    elif answer.distribution_json:
        sys.stdout.write(answer.distribution_json)
    print(_expert_summary(answer, args.action), file=sys.stderr)


async def _main(args: argparse.Namespace) -> None:
    auth = internal_auth_from_args(args)
    if args.command == "expert-distribution":
        await _experts(args, auth)
        return
    if args.command == "list-nodes":
        nodes = await list_nodes(args.bootstrap, auth)
        print(HEADER)
        for node in nodes:
            print(node.line())
        return
    outcome = await switch_role(
        args.bootstrap, args.node, args.role, auth, args.drain_timeout, args.timeout, args.force
    )
    print(outcome.line())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        asyncio.run(_main(args))
    except AdminError as exc:
        print(f"pdserve-admin: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValueError as exc:  # flags: a token file that cannot be read, TLS without a key
        print(f"pdserve-admin: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
