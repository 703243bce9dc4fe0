"""Builds a ready scheduler (model, KV memory, tokenizer-aware stop checks) from a config."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.overlap import OverlapScheduler
from engine.scheduler import Scheduler
from engine.tokenizer import StopStringChecker, load_tokenizer
from engine.tp.workers import start_runner


@dataclass
class Engine:
    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Any | None
    scheduler: Scheduler


def build_engine(config: EngineConfig) -> Engine:
    model_config = ModelConfig.from_dir(config.model_path)
    tokenizer = load_tokenizer(config.model_path)
    eos = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    model_config = replace(model_config, eos_token_ids=tuple(sorted(eos)))
    runner = start_runner(config, model_config)  # spawns the other TP ranks, if any
    checker = StopStringChecker(tokenizer) if tokenizer is not None else None
    scheduler_cls = OverlapScheduler if config.use_overlap_schedule else Scheduler
    return Engine(config, model_config, tokenizer, scheduler_cls(config, runner, checker))


def resolve_model(model: str | None) -> str:
    """The model directory to load: `model`, or the default model (fetched on first use)."""
    from pathlib import Path

    if model is None:
        from engine.model_fetch import ensure_default_model

        return str(ensure_default_model())
    if not Path(model).is_dir():
        raise FileNotFoundError(
            f"model directory {model!r} does not exist; pass a Hugging Face model directory "
            "or leave it unset for the default model"
        )
    return model
