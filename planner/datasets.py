"""Workloads for the load tester: each item is a `Session` of one or more turns.

- random:    prompts of random token ids (exact lengths; sent to /v1/completions), input and
             output lengths uniform in [L * (1 - r), L * (1 + r)] for a range ratio r.
- prefix:    groups of requests sharing a long random prefix (a "system prompt") followed by a
             random suffix of their own: what a prefix cache is for. Completions, token ids.
- sharegpt:  the first human -> gpt exchange of each conversation in a ShareGPT-format JSON file
             (a list of {"conversations": [{"from": "human", "value": ...}, ...]}); chat.
- multiturn: conversations of several user turns sent one after another on /v1/chat/completions,
             each carrying the whole history, so prompts grow turn by turn.
- conversation: N chat sessions sharing a system prompt of S tokens, T turns each (user turns of
             U tokens, outputs of O tokens), a think time between turns; each turn's prompt is
             the session's history plus the new message: the workload of a prefix cache that
             keeps conversations (`--conversation-system-len`, `--think-time`).
- mooncake:  a trace in the public Mooncake format (JSONL, one request a line: `timestamp` in
             ms, `input_length`, `output_length`, `hash_ids`), replayed at its timestamps; each
             hash id is a block of `--mooncake-block-size` (512) token ids, the same ids for the
             same hash id, so requests share prefixes exactly as in the trace. Token ids.

Each request carries `reusable_tokens`: what a perfect prefix cache could skip, as far as the
dataset knows it (a shared system prompt, trace blocks seen before); the report adds each
turn's history and compares the measured hit rate with this best (scripts/serving/report.py).

Text prompts (sharegpt, multiturn) have no tokenizer here: their lengths are estimates (about
four characters per token); the server's reported usage is what the metrics count.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CHARS_PER_TOKEN = 4  # estimate for text without a tokenizer
# Words of one token each in common BPE vocabularies (with their leading space).
_WORD_TEXT = (
    "the of and to in is was for on are with as be at by this had not but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three"
)
WORDS = tuple(_WORD_TEXT.split())


class DatasetError(ValueError):
    """The dataset options or file cannot make a workload; the message says which and why."""


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: a completions prompt, or the user message of a chat turn."""

    prompt: str | tuple[int, ...]
    prompt_len: int  # exact for token ids, an estimate for text (chat history not included)
    output_len: int  # max_tokens
    chat: bool = False
    reusable_tokens: int = 0  # a perfect cache's hit beyond the session's own history


@dataclass(frozen=True)
class Session:
    """Turns sent one after another (each waits for the previous reply); one arrival."""

    turns: tuple[RequestSpec, ...]
    group: int = 0  # prefix group or conversation id
    system: str = ""  # a chat session's system message
    think_s: float = 0.0  # pause between a reply and the next turn
    arrival_s: float | None = None  # a trace's own arrival time (else the load's schedule)


@dataclass(frozen=True)
class DatasetConfig:
    name: str  # random | prefix | sharegpt | multiturn
    num_sessions: int
    seed: int = 0
    input_len: int = 128
    output_len: int = 32
    range_ratio: float = 0.0
    token_id_low: int = 1000  # random token ids come from [low, high): clear of special tokens
    token_id_high: int = 10000
    prefix_len: int = 512
    prefix_group_size: int = 8
    turns: int = 3
    path: Path | None = None
    sharegpt_output_len: int | None = None  # None: estimated from the reference reply
    sharegpt_max_output_len: int = 256
    system_len: int = 1024  # conversation: shared system prompt tokens
    think_s: float = 0.0  # conversation: seconds between a reply and the next turn
    mooncake_block_size: int = 512

    def __post_init__(self) -> None:
        if self.name not in GENERATORS:
            raise DatasetError(f"--dataset must be one of {sorted(GENERATORS)}, got {self.name!r}")
        for field_name in ("num_sessions", "input_len", "output_len", "prefix_group_size", "turns"):
            if getattr(self, field_name) < 1:
                flag = field_name.replace("_", "-")
                raise DatasetError(f"--{flag} must be >= 1, got {getattr(self, field_name)}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise DatasetError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        if not 0 <= self.token_id_low < self.token_id_high:
            raise DatasetError(
                f"token id range [{self.token_id_low}, {self.token_id_high}) is empty"
            )
        if self.name in ("sharegpt", "mooncake") and self.path is None:
            raise DatasetError(f"--dataset {self.name} needs --dataset-path FILE")
        if self.system_len < 0 or self.think_s < 0 or self.mooncake_block_size < 1:
            raise DatasetError(
                "--conversation-system-len and --think-time must be >= 0, "
                "--mooncake-block-size >= 1"
            )


def lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    """n integers uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    low = max(1, math.floor(mean * (1 - ratio)))
    high = max(low, math.ceil(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def random_ids(rng: np.random.Generator, config: DatasetConfig, n: int) -> tuple[int, ...]:
    # tolist() makes the same Python ints as int(x) per element, ten times faster: the planner
    # builds every arrival's ids for each split it simulates.
    return tuple(rng.integers(config.token_id_low, config.token_id_high, size=n).tolist())


def random_words(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), size=n))


def gen_random(config: DatasetConfig, rng: np.random.Generator) -> list[Session]:
    n = config.num_sessions
    ins = lengths(rng, config.input_len, config.range_ratio, n)
    outs = lengths(rng, config.output_len, config.range_ratio, n)
    return [
        Session((RequestSpec(random_ids(rng, config, i), i, o),), group=k)
        for k, (i, o) in enumerate(zip(ins, outs, strict=True))
    ]


def gen_prefix(config: DatasetConfig, rng: np.random.Generator) -> list[Session]:
    n = config.num_sessions
    groups = math.ceil(n / config.prefix_group_size)
    prefixes = [random_ids(rng, config, config.prefix_len) for _ in range(groups)]
    ins = lengths(rng, config.input_len, config.range_ratio, n)
    outs = lengths(rng, config.output_len, config.range_ratio, n)
    sessions = []
    for k in range(n):
        group = k % groups
        ids = prefixes[group] + random_ids(rng, config, ins[k])
        sessions.append(Session((RequestSpec(ids, len(ids), outs[k]),), group=group))
    order = rng.permutation(n)
    return [sessions[int(i)] for i in order]


def gen_multiturn(config: DatasetConfig, rng: np.random.Generator) -> list[Session]:
    sessions = []
    for k in range(config.num_sessions):
        ins = lengths(rng, config.input_len, config.range_ratio, config.turns)
        outs = lengths(rng, config.output_len, config.range_ratio, config.turns)
        turns = tuple(
            RequestSpec(random_words(rng, i), i, o, chat=True)
            for i, o in zip(ins, outs, strict=True)
        )
        sessions.append(Session(turns, group=k))
    return sessions


def gen_sharegpt(config: DatasetConfig, rng: np.random.Generator) -> list[Session]:
    assert config.path is not None
    pairs = load_sharegpt(config.path)
    order = rng.permutation(len(pairs))
    sessions = []
    for k in range(config.num_sessions):  # cycles through the file if it is short
        question, answer = pairs[int(order[k % len(pairs)])]
        estimate = max(1, round(len(answer) / CHARS_PER_TOKEN))
        output_len = config.sharegpt_output_len or min(estimate, config.sharegpt_max_output_len)
        prompt_len = max(1, round(len(question) / CHARS_PER_TOKEN))
        sessions.append(Session((RequestSpec(question, prompt_len, output_len, chat=True),), k))
    return sessions


def load_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(first human message, the gpt reply to it) of every usable conversation in the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetError(f"--dataset-path {path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DatasetError(f"--dataset-path {path} is not a JSON file: {exc}") from None
    if not isinstance(data, list):
        raise DatasetError(
            f"--dataset-path {path} is not ShareGPT JSON: expected a list of conversations, "
            f"got a JSON {type(data).__name__}"
        )
    pairs = [pair for entry in data if (pair := _first_exchange(entry)) is not None]
    if not pairs:
        raise DatasetError(
            f"--dataset-path {path} is not ShareGPT JSON: none of its {len(data)} entries has "
            '"conversations" starting with a "human" message followed by a "gpt" one'
        )
    return pairs


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    if first.get("from") != "human" or second.get("from") != "gpt":
        return None
    question, answer = first.get("value"), second.get("value")
    if not isinstance(question, str) or not isinstance(answer, str) or not question.strip():
        return None
    return question, answer


def gen_conversation(config: DatasetConfig, rng: np.random.Generator) -> list[Session]:
    system = random_words(rng, config.system_len)
    sessions = []
    for k in range(config.num_sessions):
        ins = lengths(rng, config.input_len, config.range_ratio, config.turns)
        outs = lengths(rng, config.output_len, config.range_ratio, config.turns)
        # Only turn 1 can reuse what other sessions computed: the system prompt (not for the
        # first session); later turns reuse their own history, which the report adds.
        shared = config.system_len if k else 0
        turns = tuple(
            RequestSpec(random_words(rng, i), i, o, chat=True, reusable_tokens=0 if t else shared)
            for t, (i, o) in enumerate(zip(ins, outs, strict=True))
        )
        sessions.append(Session(turns, group=k, system=system, think_s=config.think_s))
    return sessions


def gen_mooncake(config: DatasetConfig, rng: np.random.Generator) -> list[Session]:
    assert config.path is not None
    records = load_mooncake(config.path)
    size = config.mooncake_block_size
    seen: set[int] = set()
    sessions = []
    start = records[0].timestamp_ms
    for k, rec in enumerate(records[: config.num_sessions]):
        ids: list[int] = []
        for h in rec.hash_ids:
            block = np.random.default_rng([config.seed, h])  # the same ids for the same hash
            ids.extend(
                int(x) for x in block.integers(config.token_id_low, config.token_id_high, size)
            )
        if len(ids) < rec.input_length:  # the trace's prompt is longer than its blocks
            ids.extend(random_ids(rng, config, rec.input_length - len(ids)))
        ids = ids[: rec.input_length]
        reusable = 0
        for h in rec.hash_ids:
            if h not in seen:
                break
            reusable += size
        seen.update(rec.hash_ids)
        spec = RequestSpec(
            tuple(ids), len(ids), rec.output_length, reusable_tokens=min(reusable, len(ids) - 1)
        )
        arrival = (rec.timestamp_ms - start) / 1000.0
        sessions.append(Session((spec,), group=k, arrival_s=arrival))
    return sessions


@dataclass(frozen=True)
class MooncakeRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake(path: Path) -> list[MooncakeRecord]:
    """The requests of a Mooncake trace (JSONL), in timestamp order."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DatasetError(f"--dataset-path {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"--dataset-path {path} cannot be read: {exc}") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            record = MooncakeRecord(
                float(raw["timestamp"]),
                int(raw["input_length"]),
                int(raw["output_length"]),
                tuple(int(h) for h in raw["hash_ids"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise DatasetError(
                f"--dataset-path {path} line {number} is not a Mooncake trace record "
                f'({{"timestamp", "input_length", "output_length", "hash_ids"}}): {exc}'
            ) from None
        if record.input_length < 1 or record.output_length < 1:
            raise DatasetError(f"--dataset-path {path} line {number}: lengths must be >= 1")
        records.append(record)
    if not records:
        raise DatasetError(f"--dataset-path {path} has no Mooncake trace records")
    return sorted(records, key=lambda r: r.timestamp_ms)


GENERATORS = {
    "random": gen_random,
    "prefix": gen_prefix,
    "sharegpt": gen_sharegpt,
    "multiturn": gen_multiturn,
    "conversation": gen_conversation,
    "mooncake": gen_mooncake,
}


def build_sessions(config: DatasetConfig) -> list[Session]:
    """The workload for this config; the same config (seed included) gives the same sessions."""
    return GENERATORS[config.name](config, np.random.default_rng(config.seed))


Shape = tuple[int, int, int]  # a single-turn session's prompt_len, output_len and group


def shapes_random(config: DatasetConfig, rng: np.random.Generator) -> list[Shape]:
    """`gen_random`'s sessions as shapes: its lengths are drawn before any token id."""
    n = config.num_sessions
    ins = lengths(rng, config.input_len, config.range_ratio, n)
    outs = lengths(rng, config.output_len, config.range_ratio, n)
    return [(i, o, k) for k, (i, o) in enumerate(zip(ins, outs, strict=True))]


def shapes_prefix(config: DatasetConfig, rng: np.random.Generator) -> list[Shape]:
    """`gen_prefix`'s sessions as shapes: its token ids are drawn and dropped, since the
    order it shuffles them into comes from the generator after them."""
    n = config.num_sessions
    groups = math.ceil(n / config.prefix_group_size)
    low, high = config.token_id_low, config.token_id_high
    for _ in range(groups):
        rng.integers(low, high, size=config.prefix_len)
    ins = lengths(rng, config.input_len, config.range_ratio, n)
    outs = lengths(rng, config.output_len, config.range_ratio, n)
    shapes = []
    for k in range(n):
        rng.integers(low, high, size=ins[k])
        shapes.append((config.prefix_len + ins[k], outs[k], k % groups))
    order = rng.permutation(n)
    return [shapes[int(i)] for i in order]


# The generated single-turn datasets whose shapes come without their prompts, draw for draw as
# the generator makes them (tests/test_bench_serving.py compares): the planner simulates lengths
# alone, and a thousand prompts' token ids took it a tenth of a second per window.
SHAPES = {"random": shapes_random, "prefix": shapes_prefix}


def build_shapes(config: DatasetConfig) -> list[Shape]:
    """`build_sessions(config)` as shapes, for a dataset in `SHAPES`."""
    return SHAPES[config.name](config, np.random.default_rng(config.seed))
