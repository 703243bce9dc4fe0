"""Builds a ready scheduler (model, KV memory, tokenizer-aware stop checks) from a config."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from engine.config import EngineConfig
from engine.grammar import GrammarCompiler, GrammarTokenizer
from engine.model_config import ModelConfig
from engine.overlap import OverlapScheduler
from engine.scheduler import Scheduler
from engine.tokenizer import StopStringChecker, load_tokenizer
from engine.tp.workers import RankAgentFactory, start_runner


@dataclass
class Engine:
    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Any | None
    scheduler: Scheduler


def build_engine(config: EngineConfig, rank_agent: RankAgentFactory | None = None) -> Engine:
    """The engine of `config`; a TP node's spawned ranks also run `rank_agent` (its transfers)."""
    model_config = ModelConfig.from_dir(config.model_path)
    if config.expert_placement is not None:
        config.expert_placement.check_model(model_config)
    tokenizer = load_tokenizer(config.model_path)
    eos = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    model_config = replace(model_config, eos_token_ids=tuple(sorted(eos)))
    runner = start_runner(config, model_config, rank_agent)  # spawns the other TP ranks, if any
    checker = StopStringChecker(tokenizer) if tokenizer is not None else None
    grammars = None
    if tokenizer is not None:  # compiles nothing (imports no backend) until a grammar comes
        vocab = GrammarTokenizer(tokenizer, model_config.vocab_size, model_config.eos_token_ids)
        grammars = GrammarCompiler(vocab)
    scheduler_cls = OverlapScheduler if config.use_overlap_schedule else Scheduler
    scheduler = scheduler_cls(config, runner, checker, grammars)
    return Engine(config, model_config, tokenizer, scheduler)
