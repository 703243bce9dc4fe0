"""The expert load of a tiny random Qwen3-MoE on a slice of a Mooncake trace, and its placement.

    python -m scripts.expert_load --out DIR [--trace TRACE.jsonl] [--requests 32]

Saves the tiny model (scripts/tiny_models.py: 8 experts, top-2, MoE layers 0 and 2), derives
each request's prompt from the trace's hash ids (16 token ids per hash id, drawn from a generator
seeded by the id: requests that share blocks share those tokens, as in the trace), runs the
prompts through the engine (`LLM`: chunked prefill, prefix cache, a few decode steps each),
writes the recorded window to DIR/distribution.json and places it with pdserve-eplb at each
`--ep-sizes` with one redundant slot per rank (DIR/placement-ep<R>.json), printing the expert
skew and each rank balance before and after. Deterministic: the same flags print the same
figures.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine import LLM, SamplingParams
from engine.eplb import cli
from engine.eplb.distribution import ExpertDistribution
from engine.eplb.recorder import ExpertDistributionRecorder
from planner.datasets import MooncakeRecord, load_mooncake
from scripts.tiny_models import save_tiny_moe

TRACE = Path("/work/shared/workloads/mooncake_conversation_first_half.jsonl")
BLOCK_TOKENS = 16  # token ids per hash id (the trace's blocks are 512)
MAX_POSITIONS = 4096  # the slice's longest prompts are ~100 blocks


def trace_prompts(
    records: Sequence[MooncakeRecord], vocab: int, block_tokens: int = BLOCK_TOKENS
) -> list[list[int]]:
    """Each record's prompt: `block_tokens` ids in [1, vocab) per hash id, the same for the
    same id."""
    return [
        [
            int(t)
            for h in rec.hash_ids
            for t in np.random.default_rng([0, h]).integers(1, vocab, block_tokens)
        ]
        for rec in records
    ]


def record(
    model_dir: Path, records: Sequence[MooncakeRecord], max_new_tokens: int
) -> ExpertDistribution:
    """The expert distribution of `records` run through the model at `model_dir`."""
    llm = LLM(str(model_dir), page_size=16, chunked_prefill_size=512, max_total_tokens=1 << 16)
    assert llm.runner.expert_load is not None, f"{model_dir} has no MoE layers"
    recorder = ExpertDistributionRecorder(llm.runner.expert_load, model_dir.name)
    recorder.start()
    prompts = trace_prompts(records, llm.model_config.vocab_size)
    params = [
        SamplingParams(
            max_new_tokens=min(r.output_length, max_new_tokens), temperature=0.0, ignore_eos=True
        )
        for r in records
    ]
    llm.generate(prompts, params)
    return recorder.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the files")
    parser.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake trace (JSONL)")
    parser.add_argument("--requests", type=int, default=32, help="its first N requests")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="decode steps at most")
    parser.add_argument("--ep-sizes", default="2,4", help="EP sizes to place for")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = save_tiny_moe(
        args.out / "tiny-qwen3-moe", "qwen3_moe", max_position_embeddings=MAX_POSITIONS
    )
    dist = record(model_dir, load_mooncake(args.trace)[: args.requests], args.max_new_tokens)
    dump = args.out / "distribution.json"
    dist.write(dump)
    for ep_size in (int(r) for r in args.ep_sizes.split(",")):
        slots = dist.num_experts // ep_size + 1
        print(f"\n$ pdserve-eplb {dump} --ep-size {ep_size} --slots-per-rank {slots}")
        cli.run([dump], ep_size, slots, args.out / f"placement-ep{ep_size}.json")


if __name__ == "__main__":
    main()
