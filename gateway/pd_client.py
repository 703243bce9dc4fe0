"""Send one request through a prefill/decode pair: the gateway's core call (DESIGN.md step 2).

`Generate(room, P id)` goes to the decode node and `Prefill(room, D id)` to the prefill node at
the same time; the decode node streams the tokens. Without a prefill node the decode node
prefills locally (colocated). If the prefill call fails, the decode call is aborted so that its
pages are released at once instead of waiting for the transfer timeout.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

import grpc

from proto import node_pb2, node_pb2_grpc


def new_room() -> int:
    """A random non-zero 63-bit bootstrap room."""
    return secrets.randbits(63) or 1


@dataclass
class PDResult:
    room: int
    token_ids: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # monotonic arrival of each chunk
    sent_at: float = 0.0
    finished: node_pb2.Finished | None = None
    prefill: node_pb2.PrefillResponse | None = None
    prefill_error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else float("nan")

    @property
    def e2e_s(self) -> float:
        return self.chunk_times[-1] - self.sent_at if self.chunk_times else float("nan")


@dataclass(frozen=True)
class NodeTarget:
    node_id: str
    stub: node_pb2_grpc.NodeStub


async def pd_generate(
    decode: NodeTarget,
    prefill: NodeTarget | None,
    input_ids: list[int],
    sampling: node_pb2.SamplingParams,
    room: int | None = None,
    rid: str = "",
) -> PDResult:
    """Run one request to completion; raises grpc.aio.AioRpcError if the decode node refuses."""
    room = (room or new_room()) if prefill is not None else 0
    rid = rid or f"r{room or new_room()}"
    result = PDResult(room=room, sent_at=time.monotonic())
    call = decode.stub.Generate(
        node_pb2.GenerateRequest(
            rid=rid,
            input_ids=input_ids,
            sampling=sampling,
            bootstrap_room=room,
            prefill_node_id=prefill.node_id if prefill else "",
        )
    )
    prefill_task = None
    if prefill is not None:
        request = node_pb2.PrefillRequest(
            rid=rid,
            input_ids=input_ids,
            sampling=sampling,
            bootstrap_room=room,
            decode_node_id=decode.node_id,
        )
        prefill_task = asyncio.create_task(_prefill(prefill, request, result, call))
    try:
        async for response in call:
            if response.HasField("chunk"):
                result.token_ids.extend(response.chunk.token_ids)
                result.chunk_times.append(time.monotonic())
            else:
                result.finished = response.finished
    except asyncio.CancelledError:
        if not result.prefill_error:
            raise  # not our own cancel after a failed prefill
    finally:
        if prefill_task is not None:
            await prefill_task
    return result


async def _prefill(
    prefill: NodeTarget, request: node_pb2.PrefillRequest, result: PDResult, decode_call: object
) -> None:
    try:
        result.prefill = await prefill.stub.Prefill(request)
    except grpc.aio.AioRpcError as exc:
        result.prefill_error = f"{exc.code().name}: {exc.details()}"
        cancel = getattr(decode_call, "cancel", None)
        if cancel is not None and result.finished is None:
            cancel()
