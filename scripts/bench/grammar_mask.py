"""What a grammar costs a decode step: the token masks against the step they are applied in.

The default model (fp32, CPU) decodes a batch of `--batch` chat requests twice: free, then each
under a JSON schema (an object holding an array of 40 short strings, so every request keeps
decoding for the whole run). The scheduler is stepped by hand; only decode steps that carry the
whole batch count. Printed per run: the median step and forward time. Then the grammar work alone,
replayed on the tokens the constrained run produced: per step, every matcher's mask filled, the
masks applied to a `[batch, vocab]` float32 logits tensor, the chosen tokens accepted, plus the
float32 copy of the logits that a masked batch takes instead of a bare argmax. Its share of the
free decode step is the overhead figure (the goal: at most 5% at batch 16).

    .venv/bin/python -m scripts.bench.grammar_mask --batch 16 --steps 48 --threads 1 --clock cpu

`--clock cpu` counts only this process's CPU time (with one torch thread that is its work), so a
shared machine's other load does not inflate the figures; `--output-json` keeps them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.grammar import RequestGrammar, apply_grammar_masks
from engine.grammar_spec import GrammarSpec
from engine.model_fetch import ensure_default_model
from engine.request import Req

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
SCHEMA = {
    "type": "object",
    "properties": {
        "animals": {
            "type": "array",
            "items": {"type": "string", "maxLength": 30},
            "minItems": 40,
            "maxItems": 40,
        }
    },
    "required": ["animals"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class RunFigures:
    steps: int
    step_ms: float  # median of decode steps with the whole batch
    forward_ms: float  # wall clock (StepStats.forward_s), whatever --clock says


@dataclass(frozen=True)
class Report:
    batch: int
    threads: int
    clock: str
    free: RunFigures
    constrained: RunFigures
    mask_ms: float  # fill + apply + accept + the float32 copy, per step, median
    mask_share_of_free_step: float
    step_difference: float  # (constrained - free) / free, of the median steps


def _requests(llm: LLM, batch: int, grammar: GrammarSpec | None, steps: int) -> list[Req]:
    assert llm.tokenizer is not None
    reqs = []
    for i in range(batch):
        messages = [{"role": "user", "content": f"List 40 animals as JSON, variant {i}."}]
        ids = llm.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        params = SamplingParams(
            max_new_tokens=steps + 2, temperature=0, ignore_eos=True, grammar=grammar
        )
        sampler = llm.scheduler.new_sampler(params, list(ids))
        reqs.append(Req(rid=f"b{i}", prompt_ids=list(ids), params=params, sampler=sampler))
    return reqs


def _run(llm: LLM, reqs: list[Req], clock) -> RunFigures:  # type: ignore[no-untyped-def]
    for req in reqs:
        llm.scheduler.add_request(req)
    step_ms, forward_ms = [], []
    while llm.scheduler.has_work:
        start = clock()
        llm.scheduler.step()
        elapsed = (clock() - start) * 1e3
        stats = llm.scheduler.last_stats
        if stats.num_prefill_reqs == 0 and stats.num_decode_reqs == len(reqs):
            step_ms.append(elapsed)
            forward_ms.append(stats.forward_s * 1e3)
    llm.check_integrity()
    return RunFigures(len(step_ms), statistics.median(step_ms), statistics.median(forward_ms))


def _mask_ms(llm: LLM, spec: GrammarSpec, outputs: list[list[int]], clock) -> float:  # type: ignore[no-untyped-def]
    """Median per-step cost of the grammar work, replayed over `outputs`."""
    assert llm.scheduler.grammars is not None
    grammars: list[RequestGrammar | None] = [
        llm.scheduler.grammars.request_grammar(spec) for _ in outputs
    ]
    vocab = llm.model_config.vocab_size
    logits = torch.randn(len(outputs), vocab)
    times = []
    for step in range(min(len(o) for o in outputs) - 1):
        start = clock()
        masked = logits.to(torch.float32, copy=True)
        apply_grammar_masks(masked, grammars)
        for grammar, output in zip(grammars, outputs, strict=True):
            assert grammar is not None
            grammar.accept(output[step])
        times.append((clock() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=48, help="decode steps per run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--model", default=None, help="HF model directory (default model)")
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    model = args.model or str(ensure_default_model(progress=False))
    llm = LLM(model, max_total_tokens=32768)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    _run(llm, _requests(llm, args.batch, None, 4), clock)  # warm-up
    free = _run(llm, _requests(llm, args.batch, None, args.steps), clock)
    constrained_reqs = _requests(llm, args.batch, spec, args.steps)
    constrained = _run(llm, constrained_reqs, clock)
    outputs = [r.output_ids for r in constrained_reqs]
    texts = [llm.tokenizer.decode(o) for o in outputs[:2]] if llm.tokenizer else []
    mask_ms = _mask_ms(llm, spec, outputs, clock)
    report = Report(
        batch=args.batch,
        threads=torch.get_num_threads(),
        clock=args.clock,
        free=free,
        constrained=constrained,
        mask_ms=mask_ms,
        mask_share_of_free_step=mask_ms / free.step_ms,
        step_difference=(constrained.step_ms - free.step_ms) / free.step_ms,
    )
    share = 100 * report.mask_share_of_free_step
    print(f"batch {args.batch}, {report.threads} torch threads, {args.clock} clock")
    for name, run in (("free", free), ("constrained", constrained)):
        print(
            f"{name + ' decode step':<24} {run.step_ms:8.2f} ms "
            f"(forward, wall {run.forward_ms:.2f} ms, {run.steps} steps)"
        )
    print(f"{'grammar work per step':<24} {mask_ms:8.3f} ms = {share:.2f}% of the free step")
    print(f"step difference          {100 * report.step_difference:+.2f}%")
    print(f"sample outputs: {texts}")
    if args.output_json:
        args.output_json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
