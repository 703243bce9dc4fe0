"""Grammar-constrained decoding in the engine (engine/grammar.py, engine/sampling.py).

The reference is HF transformers' greedy `generate` (fp32, CPU) with a logits processor that
applies the same grammar's mask: the engine must pick the same tokens, constrained rows and free
rows sharing one continuous batch, with either scheduler.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarTokenizer,
    GrammarViolation,
    XGrammarBackend,
)
from engine.grammar_spec import GrammarSpec
from engine.sampling import RequestSampler

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [a-z]{1,6}\."
EBNF = 'root ::= "answer: " digit digit? "."\ndigit ::= [0-9]'
SPECS = [
    GrammarSpec("json_schema", json.dumps(PERSON)),
    GrammarSpec("regex", REGEX),
    GrammarSpec("ebnf", EBNF),
]


@pytest.fixture(scope="module")
def tiny_llm(tiny_text_model: Path) -> LLM:
    return LLM(str(tiny_text_model), chunked_prefill_size=16, max_total_tokens=8192)


def _matches(spec: GrammarSpec, text: str) -> bool:
    if spec.kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), json.loads(spec.spec))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if spec.kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if spec.kind == "regex":
        return re.fullmatch(spec.spec, text) is not None
    return re.fullmatch(r"answer: [0-9]{1,2}\.", text) is not None


def _hf_constrained_greedy(
    model_dir: Path, llm: LLM, prompt: list[int], spec: GrammarSpec | None, max_new: int
) -> list[int]:
    """HF greedy generation with a processor masking through a matcher of its own."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    assert llm.scheduler.grammars is not None
    backend = llm.scheduler.grammars.backend
    assert isinstance(backend, XGrammarBackend)
    processors = LogitsProcessorList()
    if spec is not None:
        matcher = backend.matcher(backend.compile(spec))

        class Mask(LogitsProcessor):
            def __init__(self) -> None:
                self.seen = len(prompt)

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                for token in input_ids[0, self.seen :].tolist():
                    assert matcher.accept(token)
                self.seen = input_ids.shape[1]
                mask = backend.allocate_mask(1)
                matcher.fill_mask(mask, 0)
                scores = scores.float().clone()
                backend.apply_mask(scores, mask, [0])
                return scores

        processors.append(Mask())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = list(llm.model_config.eos_token_ids)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new,
            do_sample=False,
            logits_processor=processors,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    return out[0, len(prompt) :].tolist()


def test_spec_kinds_are_checked() -> None:
    with pytest.raises(ValueError, match="grammar kind must be one of"):
        GrammarSpec("yaml", "x")
    with pytest.raises(ValueError, match="json_object grammar takes no spec"):
        GrammarSpec("json_object", "{}")
    with pytest.raises(ValueError, match="a regex grammar needs its regex text"):
        GrammarSpec("regex")


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (GrammarSpec("json_schema", '{"type": "objectx"}'), 'Unsupported type "objectx"'),
        (GrammarSpec("json_schema", '{"type": '), "Expecting value"),
        (GrammarSpec("regex", "a("), "parenthesis is not closed"),
        (GrammarSpec("ebnf", "root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_invalid_specs_give_the_compilers_reason(
    tiny_llm: LLM, spec: GrammarSpec, reason: str
) -> None:
    with pytest.raises(GrammarError, match=f"invalid {spec.kind}: .*{re.escape(reason)}"):
        tiny_llm.generate([[1, 2, 3]], SamplingParams(grammar=spec))
    tiny_llm.check_integrity()


def test_compiled_grammars_are_cached_by_spec(tiny_llm: LLM) -> None:
    assert tiny_llm.tokenizer is not None
    vocab = tiny_llm.model_config.vocab_size
    compiler = GrammarCompiler(GrammarTokenizer(tiny_llm.tokenizer, vocab, (2,)), cache_size=2)
    specs = [GrammarSpec("regex", "a+"), GrammarSpec("regex", "b+"), GrammarSpec("regex", "a+")]
    grammars = [compiler.request_grammar(s) for s in specs]
    assert (compiler.misses, compiler.hits) == (2, 1)
    assert grammars[0].matcher is not grammars[2].matcher  # one matcher per request
    compiler.request_grammar(GrammarSpec("regex", "c+"))  # evicts b+, the least recently used
    compiler.request_grammar(GrammarSpec("regex", "b+"))
    assert compiler.misses == 4


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_greedy_matches_hf_with_the_same_mask(
    tiny_text_model: Path, overlap: bool
) -> None:
    llm = LLM(str(tiny_text_model), chunked_prefill_size=16, overlap_schedule=overlap)
    gen = torch.Generator().manual_seed(3)
    specs: list[GrammarSpec | None] = [*SPECS, None, GrammarSpec("json_object")]
    prompts = [torch.randint(5, 4000, (n,), generator=gen).tolist() for n in (7, 30, 12, 21, 9)]
    params = [SamplingParams(max_new_tokens=40, temperature=0, grammar=s) for s in specs]
    outs = llm.generate(prompts, params)
    llm.check_integrity()
    for prompt, spec, out in zip(prompts, specs, outs, strict=True):
        expected = _hf_constrained_greedy(tiny_text_model, llm, prompt, spec, 40)
        assert out.token_ids == expected, spec
        if spec is not None and spec.kind != "json_object":  # free JSON may run past 40 tokens
            assert out.finish_reason == "stop" and _matches(spec, out.text), (spec, out.text)


def test_sampled_outputs_match_their_grammar(tiny_llm: LLM) -> None:
    params = [
        SamplingParams(max_new_tokens=48, temperature=1.0, top_p=0.9, seed=seed, grammar=spec)
        for seed in range(4)
        for spec in SPECS
    ]
    outs = tiny_llm.generate([[10 + i, 20, 30] for i in range(len(params))], params)
    tiny_llm.check_integrity()
    for p, out in zip(params, outs, strict=True):
        assert p.grammar is not None
        assert out.finish_reason == "stop", out.text
        assert out.finish_detail in ("token 2", "grammar complete")
        assert _matches(p.grammar, out.text), (p.grammar, out.text)


def test_a_forbidden_adopted_token_is_refused(tiny_llm: LLM) -> None:
    """A decode node advances its matcher over the prefill node's first token (adopt)."""
    spec = GrammarSpec("regex", "[0-9]+")
    assert tiny_llm.scheduler.grammars is not None
    vocab = tiny_llm.model_config.vocab_size
    digit = tiny_llm.encode("7")[0]
    letter = tiny_llm.encode("x")[0]
    sampler = RequestSampler(
        SamplingParams(grammar=spec),
        [1],
        vocab,
        "cpu",
        tiny_llm.scheduler.grammars.request_grammar(spec),
    )
    sampler.adopt(digit)
    with pytest.raises(GrammarViolation, match=f"token {letter} does not continue"):
        sampler.adopt(letter)


def test_a_moved_request_continues_under_its_grammar(tiny_llm: LLM) -> None:
    """A request re-issued elsewhere with what it streamed (prompt + those tokens) continues
    exactly as if it had not moved: its matcher advances over the streamed tokens first."""
    spec = SPECS[0]
    prompt = [11, 12, 13, 14]
    whole = tiny_llm.generate(
        [prompt], SamplingParams(max_new_tokens=40, temperature=0, grammar=spec)
    )
    out = whole[0].token_ids
    assert whole[0].finish_reason == "stop" and len(out) > 6
    streamed = out[:5]
    moved = SamplingParams(
        max_new_tokens=40 - len(streamed),
        temperature=0,
        grammar=spec,
        grammar_generated_ids=streamed,
    )
    [rest] = tiny_llm.generate([prompt + streamed], moved)
    assert rest.token_ids == out[len(streamed) :]
    tiny_llm.check_integrity()
    with pytest.raises(GrammarViolation):  # "}" cannot start a JSON object
        bad = tiny_llm.encode("}")
        tiny_llm.generate([prompt + bad], SamplingParams(grammar=spec, grammar_generated_ids=bad))
    with pytest.raises(ValueError, match="must equal the end of input_ids"):
        tiny_llm.generate([prompt], SamplingParams(grammar=spec, grammar_generated_ids=[99]))
    tiny_llm.check_integrity()


@pytest.mark.slow
def test_default_model_answers_in_the_schema(default_model_dir: Path) -> None:
    llm = LLM(str(default_model_dir))
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    messages = [[{"role": "user", "content": "Describe a user of our site as JSON."}]]
    free, constrained = llm.chat(
        messages * 2,
        [
            SamplingParams(max_new_tokens=40, temperature=0),
            SamplingParams(max_new_tokens=40, temperature=0, grammar=spec),
        ],
    )
    assert not _matches(spec, free.text)  # the model alone does not follow the schema
    assert constrained.finish_reason == "stop" and _matches(spec, constrained.text)
    llm.check_integrity()


def test_logit_bias_and_min_tokens_under_a_grammar(tiny_llm: LLM) -> None:
    """The bias steers the choice among the tokens the grammar allows (a forbidden favoured one
    is still never drawn); min_tokens keeps the grammar from ending early, unless it must end
    (its document complete)."""
    spec = GrammarSpec("regex", "(yes|no)( maybe)?")
    letter = tiny_llm.encode("x")[0]  # favoured too, but the grammar forbids it
    for want in ("yes", "no"):
        starts = {tiny_llm.encode(want)[0], tiny_llm.encode(want[0])[0]}
        bias = {letter: 100.0, **dict.fromkeys(starts, 50.0)}
        params = SamplingParams(max_new_tokens=8, temperature=0, grammar=spec, logit_bias=bias)
        [out] = tiny_llm.generate([[10, 20, 30]], params)
        assert out.text.startswith(want), out.text
    held = SamplingParams(max_new_tokens=8, temperature=0, grammar=spec, min_tokens=8)
    [out] = tiny_llm.generate([[10, 20, 30]], held)
    assert out.finish_reason == "stop" and _matches(spec, out.text), out.text
    tiny_llm.check_integrity()
