"""Large bodies without a stalled event loop or memory kept after them (issue 25): units.

- `BodyParser` parses a large body in a parse process: a small body is parsed and answered
  on the event loop while a large one waits for its (stopped) parse process; the route's
  bound runs there too, and its error comes back field for field; a dead one is replaced;
  they start in a daemonic process too (a gateway-server worker);
- `MemoryReturn` hands memory back once, after the last of overlapping large requests;
- a handler that fails leaves no reference cycle behind (`until_disconnected`), so its locals
  (a long prompt, its token ids) are freed at once, not whenever the cyclic GC runs;
- the cheap bounds before validation look at lengths only and answer the usual errors;
- a body holding more JSON containers than any request needs is refused before it is parsed;
- start-up objects are frozen out of the cyclic GC after start-up garbage is collected.
The same against a real cluster: tests/test_hostile_clients.py; figures: the
benchmarks/serving-*-hostile-clients reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import pickle
import signal
import weakref
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from typing import Any

import pytest

import gateway.requests.body as body_module
from gateway.api.app import until_disconnected
from gateway.errors import APIError
from gateway.requests.body import LARGE_BODY_BYTES
from gateway.requests.memory import MemoryReturn, freeze_startup_objects
from gateway.requests.parse_process import BodyParser
from gateway.requests.tokenize import BodyRoute, PromptBounds

SMALL = json.dumps({"prompt": "hi"}).encode()
LARGE = json.dumps({"prompt": "x" * LARGE_BODY_BYTES}).encode()


@pytest.fixture
def parser() -> Iterator[BodyParser]:
    bounds = PromptBounds(context_length=100, max_token_chars=10)
    parser = BodyParser(bounds=bounds, processes=1)
    parser.start()
    yield parser
    parser.close()


def _children(parser: BodyParser) -> list[int]:
    return [process.process.pid for process in parser._all]


def test_a_small_body_is_answered_while_a_large_one_is_parsed(parser: BodyParser) -> None:
    """The parse process is stopped: the large body waits for it, the small one does not."""
    (child,) = _children(parser)

    async def clients() -> None:
        os.kill(child, signal.SIGSTOP)
        try:
            large = asyncio.ensure_future(parser.parse(LARGE))
            await asyncio.sleep(0.2)
            assert (await parser.parse(SMALL)).body == {"prompt": "hi"}
            assert not large.done()  # in the stopped process: the loop was free
        finally:
            os.kill(child, signal.SIGCONT)
        parsed = await large
        assert parsed.refusal is None and parsed.body["prompt"] == "x" * LARGE_BODY_BYTES

    asyncio.run(clients())


def test_a_large_body_is_refused_in_a_parse_process_with_the_same_error(
    parser: BodyParser,
) -> None:
    """The route's bound runs in the parse process; its error comes back field for field and
    is raised where the handler would raise it; an invalid body's error is raised at once."""
    assert parser.bounds is not None
    with pytest.raises(APIError) as in_process:
        parser.bounds.completion_body(json.loads(LARGE))
    parsed = asyncio.run(parser.parse(LARGE, BodyRoute.COMPLETION))
    assert parsed.body == {} and parsed.refusal is not None
    assert parsed.refusal.body() == in_process.value.body()
    assert parsed.refusal.status == 400 and parsed.refusal.code == "context_length_exceeded"
    chat = asyncio.run(parser.parse(LARGE, BodyRoute.CHAT))  # no `messages`: nothing to refuse
    assert chat.refusal is None and chat.body["prompt"] == "x" * LARGE_BODY_BYTES
    deep = b'{"x": ' + b"[" * 40 + b"]" * 40 + b', "pad": "' + b"x" * LARGE_BODY_BYTES + b'"}'
    with pytest.raises(APIError) as caught:
        asyncio.run(parser.parse(deep, BodyRoute.COMPLETION))
    assert caught.value.status == 400 and caught.value.code == "body_too_deep"


def test_a_dead_parse_process_is_replaced(parser: BodyParser) -> None:
    (child,) = _children(parser)
    os.kill(child, signal.SIGKILL)
    parsed = asyncio.run(parser.parse(LARGE))
    assert parsed.body["prompt"] == "x" * LARGE_BODY_BYTES
    assert _children(parser) != [child]


class _Inline(Executor):
    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def test_memory_is_handed_back_once_after_overlapping_large_requests() -> None:
    trims: list[int] = []
    memory = MemoryReturn(_Inline(), trim=lambda: trims.append(1))

    async def burst() -> None:
        with memory.large():
            with memory.large():
                pass
            await asyncio.sleep(0)
            assert trims == []  # one large request still in progress
        await asyncio.sleep(0)
        assert trims == [1]
        with memory.large():
            pass
        await asyncio.sleep(0)
        assert trims == [1, 1]

    asyncio.run(burst())
    assert memory.trims == 2 and memory.in_progress == 0


def test_a_failed_handler_leaves_no_cycle_holding_its_locals() -> None:
    class Prompt:
        pass

    held: list[weakref.ref[Prompt]] = []

    async def handler() -> dict[str, Any]:
        prompt = Prompt()
        held.append(weakref.ref(prompt))
        raise APIError(400, "too long")

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never leaves
        return {}

    async def request() -> None:
        with contextlib.suppress(APIError):
            await until_disconnected(receive, handler())
        assert held[0]() is None, "the handler's locals wait for the cyclic GC"

    gc.disable()
    try:
        asyncio.run(request())
    finally:
        gc.enable()


def _error(call: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        call(*args)
    assert caught.value.status == 400
    return caught.value


def test_bounds_before_validation_look_at_lengths_only() -> None:
    bounds = PromptBounds(context_length=100, max_token_chars=10, max_prompts=4)
    assert pickle.loads(pickle.dumps(bounds)) == bounds  # a parse process gets a copy
    for fits in ([1] * 99, [[1] * 99] * 4, ["a" * 990], "a" * 990, None, 5, [], {"x": 1}):
        bounds.bound_prompts(fits, None)
    error = _error(bounds.bound_prompts, [1] * 100, None)
    assert error.param == "prompt" and error.code == "context_length_exceeded"
    assert "100 tokens" in error.message
    error = _error(bounds.bound_prompts, [[1]] * 1_000_000, 2)
    assert error.param == "n" and "1000000 prompts x n=2" in error.message
    error = _error(bounds.bound_prompts, [[1], [1] * 100], None)
    assert error.param == "prompt" and "100 tokens" in error.message
    error = _error(bounds.bound_prompts, ["a", "a" * 1000], None)
    assert "at least 100 tokens" in error.message
    error = _error(bounds.bound_unvalidated, [1] * 500, "input_ids")
    assert error.param == "input_ids" and "500 tokens" in error.message
    bounds.bound_messages([{}] * 99)
    error = _error(bounds.bound_messages, [{}] * 100)
    assert error.param == "messages" and "100 messages" in error.message


def test_too_many_containers_are_refused_before_any_object_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A million one-id prompts would be a million lists, built by orjson holding the GIL and
    pinning arenas after the request: the body is refused from its bracket count instead."""

    def no_parse(data: bytes) -> Any:
        raise AssertionError("the body was parsed")

    batch = json.dumps({"prompt": [[1]] * 1_000_000}, separators=(",", ":")).encode()
    monkeypatch.setattr(body_module.orjson, "loads", no_parse)
    monkeypatch.setattr(body_module.json, "loads", no_parse)
    with pytest.raises(APIError) as caught:
        body_module.parse_body(batch, body_module.container_limit(8192))
    assert caught.value.status == 400 and caught.value.code == "body_too_many_items"


def test_startup_objects_are_frozen_after_their_garbage_is_collected() -> None:
    class Node:
        pass

    gc.disable()  # the cycle below must wait for freeze_startup_objects' collection
    try:
        garbage = Node()
        garbage.self = garbage  # type: ignore[attr-defined]
        collected = weakref.ref(garbage)
        del garbage
        kept = Node()
        frozen = freeze_startup_objects()
        assert collected() is None, "start-up garbage was frozen instead of collected"
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects()), "a live object was not frozen"
    finally:
        gc.unfreeze()
        gc.enable()


def _parse_in_a_daemon(answers: Any) -> None:
    parser = BodyParser(bounds=PromptBounds(context_length=100, max_token_chars=10))
    try:
        parser.start()
        parsed = asyncio.run(parser.parse(LARGE, BodyRoute.COMPLETION))
        assert parsed.refusal is not None
        answers.put((multiprocessing.current_process().daemon, parsed.refusal.code))
    finally:
        parser.close()


def test_parse_processes_start_in_a_daemonic_worker() -> None:
    """gateway-server's --workers are daemonic multiprocessing processes, which may not start
    multiprocessing children: the parse processes are started by subprocess instead."""
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    worker = context.Process(target=_parse_in_a_daemon, args=(answers,), daemon=True)
    worker.start()
    try:
        assert answers.get(timeout=60) == (True, "context_length_exceeded")
    finally:
        worker.join(30)
    assert worker.exitcode == 0
