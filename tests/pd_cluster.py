"""A real bootstrap + prefill-server + decode-server trio on 127.0.0.1, for end-to-end tests.

`pd_cluster(...)` starts the three processes (each on a free port, logs in the test's tmp dir),
waits until both nodes are registered and see each other, and stops everything afterwards.
`generate(...)` sends one request through the pair with a fresh room (gateway/pd_client.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from gateway.pd_client import NodeTarget, PDResult, pd_generate
from proto import bootstrap_pb2, bootstrap_pb2_grpc, node_pb2, node_pb2_grpc
from tests.node_harness import NodeServer, running_node

# Loopback-only transports for both engines; quiet Mooncake.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def bootstrap_ready(channel: grpc.Channel) -> bool:
    stub = bootstrap_pb2_grpc.BootstrapStub(channel)
    stub.ListNodes(bootstrap_pb2.ListNodesRequest(), timeout=5)
    return True


def registered(channel: grpc.Channel) -> bool:
    health = node_pb2_grpc.NodeStub(channel).Health(node_pb2.HealthRequest(), timeout=5)
    return bool(health.ok and health.node_id)


@dataclass
class PDCluster:
    bootstrap: NodeServer
    prefill: NodeServer
    decode: NodeServer
    prefill_id: str
    decode_id: str

    def generate(
        self, input_ids: list[int], sampling: node_pb2.SamplingParams, room: int | None = None
    ) -> PDResult:
        return asyncio.run(self.generate_async(input_ids, sampling, room))

    async def generate_async(
        self, input_ids: list[int], sampling: node_pb2.SamplingParams, room: int | None = None
    ) -> PDResult:
        async with (
            grpc.aio.insecure_channel(self.decode.address) as d_chan,
            grpc.aio.insecure_channel(self.prefill.address) as p_chan,
        ):
            decode = NodeTarget(self.decode_id, node_pb2_grpc.NodeStub(d_chan))
            prefill = NodeTarget(self.prefill_id, node_pb2_grpc.NodeStub(p_chan))
            return await pd_generate(decode, prefill, input_ids, sampling, room)

    def generate_many(
        self, prompts: Sequence[list[int]], sampling: node_pb2.SamplingParams
    ) -> list[PDResult]:
        async def run() -> list[PDResult]:
            return list(await asyncio.gather(*(self.generate_async(p, sampling) for p in prompts)))

        return asyncio.run(run())

    def check_no_leaks(self) -> None:
        for node in (self.prefill, self.decode):
            report = node.wait_idle()
            assert report.ok, f"{node.address}: {report.error}"
            assert report.used_pages == 0, f"{node.address}: {report.used_pages} pages leaked"


@contextmanager
def pd_cluster(
    tmp_path: Path,
    model: Path,
    backend: str,
    node_args: Sequence[str] = (),
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    bootstrap_args: Sequence[str] = (),
) -> Iterator[PDCluster]:
    with ExitStack() as stack:
        bootstrap = stack.enter_context(
            running_node(
                "bootstrap-server",
                list(bootstrap_args),
                tmp_path / "bootstrap.log",
                probe=bootstrap_ready,
            )
        )
        common = ["--model", str(model), "--bootstrap", bootstrap.address]
        common += ["--transfer-backend", backend, *node_args]
        prefill = stack.enter_context(
            running_node(
                "prefill-server",
                [*common, *prefill_args],
                tmp_path / "prefill.log",
                probe=registered,
            )
        )
        decode = stack.enter_context(
            running_node(
                "decode-server",
                ["--mode", "disaggregated", *common, *decode_args],
                tmp_path / "decode.log",
                probe=registered,
            )
        )
        ids = [
            node.stub.Health(node_pb2.HealthRequest(), timeout=5).node_id
            for node in (prefill, decode)
        ]
        yield PDCluster(bootstrap, prefill, decode, ids[0], ids[1])
