"""The engine both node kinds share: models, KV memory, attention, sampling, scheduling."""

from engine.llm import LLM, GenerationOutput
from engine.sampling import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
