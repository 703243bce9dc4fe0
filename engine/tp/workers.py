"""The processes of a tensor-parallel node: rank 0 is the caller, ranks 1.. are spawned here.

Rank 0 (the server or the offline `LLM`) picks a free loopback port, spawns the other ranks
(`torch.multiprocessing`, spawn context, daemon processes), and joins the process group with
them. Every rank loads its shard; a MIN-reduction of "loaded" flags tells rank 0 that all did
(a rank that fails logs why and votes 0, so rank 0 refuses to start instead of hanging).
A spawned rank then runs rank 0's steps until it receives STOP, or until rank 0's process
is gone (the collectives fail and the rank exits).
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from typing import Protocol

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.ports import free_port
from engine.tp import messages
from engine.tp.group import TPGroup, TPInit
from engine.tp.partition import check_tp

logger = logging.getLogger("pdserve.tp")


class RankAgent(Protocol):
    """Handles rank 0's messages beyond forwards on a spawned rank (a disaggregated node's KV
    transfers: engine/node/tp_transfer.py). The node passes its class; the engine knows none."""

    KINDS: frozenset[messages.MessageKind]

    def handle(self, kind: messages.MessageKind, arrays: list[torch.Tensor]) -> None: ...

    def close(self) -> None: ...


RankAgentFactory = Callable[[ModelRunner], RankAgent]


class TPStartError(RuntimeError):
    """A tensor-parallel rank could not load its shard."""


@dataclass
class TPWorkers:
    """Rank 0's handle on the spawned ranks."""

    group: TPGroup
    processes: list[BaseProcess]

    def stop(self, timeout_s: float = 10.0) -> None:
        if any(p.is_alive() for p in self.processes):
            try:
                messages.send(self.group, messages.MessageKind.STOP, [])
            except RuntimeError as exc:  # a rank already died: nothing to tell it
                logger.warning("TP stop message not delivered: %s", exc)
        for proc in self.processes:
            proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("%s did not stop in %.0f s; killing it", proc.name, timeout_s)
                proc.kill()
                proc.join()
        self.group.close()


def _rank_device(device: str, rank: int) -> str:
    """Rank r of a node on `cuda:b` runs on `cuda:b+r` (`cuda` is `cuda:0`): a node started
    with `--device cuda:2 --tp-size 2` holds GPUs 2 and 3."""
    if not device.startswith("cuda"):
        return device
    return f"cuda:{(torch.device(device).index or 0) + rank}"


def start_runner(
    config: EngineConfig, model_config: ModelConfig, rank_agent: RankAgentFactory | None = None
) -> ModelRunner:
    """Rank 0's runner; with tp_size > 1 the other ranks are spawned and loaded first (each
    with `rank_agent(runner)` for messages beyond forwards, when given)."""
    if config.tp_size == 1:
        return ModelRunner(config, model_config)
    workers = launch(config, model_config, rank_agent)
    try:
        runner = ModelRunner(config, model_config, workers.group)
    except Exception:
        confirm_loaded(workers.group, False)
        raise
    confirm_loaded(workers.group, True)
    runner.on_shutdown = workers.stop
    return runner


def launch(
    config: EngineConfig, model_config: ModelConfig, rank_agent: RankAgentFactory | None = None
) -> TPWorkers:
    """Spawn ranks 1..tp_size-1 and join the group as rank 0 (the model is not loaded yet)."""
    check_tp(model_config, config.tp_size, config.ep_size, config.expert_placement)
    method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    for rank in range(1, config.tp_size):
        init = TPInit(config.tp_size, rank, method, _rank_device(config.device, rank))
        rank_config = replace(config, device=init.device)
        proc = ctx.Process(
            target=worker_main,
            args=(rank_config, model_config, init, rank_agent),
            name=f"tp-rank-{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    init = TPInit(config.tp_size, 0, method, _rank_device(config.device, 0))
    return TPWorkers(TPGroup.join(init), procs)


def confirm_loaded(group: TPGroup, loaded: bool) -> None:
    """Every rank calls this once after loading; raises on every rank if one failed."""
    if group.min_int(1 if loaded else 0) == 0:
        raise TPStartError(
            f"a tensor-parallel rank of {group.size} failed to load its shard; see its log"
        )


def worker_main(
    config: EngineConfig,
    model_config: ModelConfig,
    init: TPInit,
    rank_agent: RankAgentFactory | None = None,
) -> None:
    # Ctrl-C reaches the whole process group: rank 0 decides when this rank stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{init.rank} %(message)s")
    group = TPGroup.join(init)
    try:
        runner = ModelRunner(config, model_config, group)
    except Exception:
        logger.exception("rank %d cannot load its shard", init.rank)
        confirm_loaded(group, False)
        sys.exit(1)
    confirm_loaded(group, True)
    serve_steps(runner, rank_agent(runner) if rank_agent is not None else None)
    group.close()


def serve_steps(runner: ModelRunner, agent: RankAgent | None = None) -> None:
    """Run rank 0's messages until STOP: forwards, and what `agent` handles (a disaggregated
    node's KV transfers)."""
    kinds = agent.KINDS if agent is not None else frozenset()
    try:
        while True:
            kind, arrays = messages.receive(runner.group)
            if kind is messages.MessageKind.STOP:
                return
            if kind is messages.MessageKind.FORWARD:
                runner.forward_step(messages.ForwardStep.from_arrays(arrays))
            elif agent is not None and kind in kinds:
                agent.handle(kind, arrays)
            else:
                raise ValueError(f"tp rank {runner.group.rank}: unknown message kind {kind!r}")
    finally:
        if agent is not None:
            agent.close()
