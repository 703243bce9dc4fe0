"""The engine both node kinds share: models, KV memory, attention, sampling, scheduling.

`engine.node` is the process shell around it (gRPC service, serving, flags, transfer wiring).
`LLM` and `SamplingParams` are imported on first use, so that a light process (the gateway,
which loads only tokenizers and model configs from here) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM, GenerationOutput
    from engine.sampling import SamplingParams

_LAZY = {"LLM": "engine.llm", "GenerationOutput": "engine.llm", "SamplingParams": "engine.sampling"}

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
