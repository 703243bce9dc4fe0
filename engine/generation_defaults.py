"""Default sampling parameters from a model's `generation_config.json`, for requests that leave
them out (torch-free: the gateway reads it).

A model's authors know what sampling suits it: a 135M chat model at temperature 1.0 writes noise.
As vLLM does by default, the keys read are `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty` and `max_new_tokens`; a key the file leaves out keeps the engine's default
(`engine/sampling_fields.py`), and a value outside that table's range is refused at start with
the file and the rule named. `do_sample: false` means greedy (temperature 0), as in transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import sampling_fields as table

READ_FIELDS = (
    table.TEMPERATURE,
    table.TOP_P,
    table.TOP_K,
    table.MIN_P,
    table.REPETITION_PENALTY,
    table.MAX_NEW_TOKENS,
)
FILE_NAME = "generation_config.json"


class GenerationConfigError(ValueError):
    pass


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request gets for the sampling fields it leaves out, and where that came from."""

    values: tuple[tuple[str, float | int], ...] = ()  # (field, value) in READ_FIELDS order
    source: str = "none"  # the file read, or "none"

    def get(self, name: str) -> float | int | None:
        return dict(self.values).get(name)

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.values)

    def describe(self) -> str:
        if not self.values:
            return f"generation defaults: the engine's (from {self.source})"
        fields = ", ".join(f"{name}={value}" for name, value in self.values)
        return f"generation defaults from {self.source}: {fields}"


def load_generation_defaults(spec: str, model_dir: str | Path | None) -> GenerationDefaults:
    """`spec`: "auto" (the model directory's file, if it has one), "none", or a path to a
    generation_config.json or to a directory holding one."""
    if spec == "none":
        return GenerationDefaults()
    if spec == "auto":
        if model_dir is None or not (Path(model_dir) / FILE_NAME).is_file():
            return GenerationDefaults(source=f"no {FILE_NAME} in the model directory")
        path = Path(model_dir) / FILE_NAME
    else:
        path = Path(spec)
        path = path / FILE_NAME if path.is_dir() else path
        if not path.is_file():
            raise GenerationConfigError(
                f"--generation-config {spec}: no such file; give a {FILE_NAME}, a directory "
                "holding one, `auto` (the model's) or `none`"
            )
    return GenerationDefaults(_read_values(path), str(path))


def _read_values(path: Path) -> tuple[tuple[str, float | int], ...]:
    try:
        raw: Any = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object")
    if raw.get("do_sample") is False:  # greedy, whatever temperature the file names
        raw = {**raw, "temperature": 0.0}
    values = []
    for spec in READ_FIELDS:
        value = raw.get(spec.name)
        if value is None:
            continue
        problem = spec.problem(value)
        if problem is not None:
            raise GenerationConfigError(
                f"{path}: {spec.name} {problem}; fix the file or start with "
                "--generation-config none"
            )
        values.append((spec.name, value))
    return tuple(values)
