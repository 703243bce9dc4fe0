"""A grammar across the prefill/decode hand-off, with real bootstrap, prefill and decode processes.

The prefill node samples the first token under the grammar; the decode node advances its own
matcher over that token and constrains the rest. So the output through the pair equals the
decode node prefilling the request itself (colocated), greedy and seeded, and matches the grammar
from its first token on.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import grpc
import pytest

from gateway.process.launcher import pd_trio
from proto import node_pb2

# The first token must be a digit or "[": the unconstrained tiny model picks neither.
REGEX = r"([0-9]{2,4}|\[[a-z]{1,5}\]) (ok|no)\."
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "maximum": 999}, "tag": {"enum": ["a", "b"]}},
    "required": ["id", "tag"],
    "additionalProperties": False,
}
PROMPTS = [[100 + 7 * i + j for j in range(5 + 9 * i)] for i in range(4)]


def _sampling(kind: str, spec: str, **extra: object) -> node_pb2.SamplingParams:
    return node_pb2.SamplingParams(
        max_new_tokens=48, grammar=node_pb2.Grammar(kind=kind, spec=spec), **extra
    )


def test_first_token_constraint_holds_across_the_hand_off(
    tmp_path: Path, tiny_text_model: Path
) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_text_model)
    cases = [
        _sampling("regex", REGEX, temperature=0.0),
        _sampling("regex", REGEX, temperature=1.0, seed=5),
        _sampling("json_schema", json.dumps(SCHEMA), temperature=0.8, seed=9),
    ]
    with pd_trio(tmp_path, tiny_text_model, "mooncake", node_args=["--page-size", "4"]) as pd:
        free = pd.generate_many(PROMPTS, node_pb2.SamplingParams(max_new_tokens=1, temperature=0))
        free_first = [tokenizer.decode(r.token_ids[:1]) for r in free]
        assert not any(re.match(r"[0-9\[]", t) for t in free_first), free_first
        for sampling in cases:
            through_pair = pd.generate_many(PROMPTS, sampling)
            local = asyncio.run(_colocated(pd, sampling))
            for result, alone in zip(through_pair, local, strict=True):
                assert result.finished is not None, result.prefill_error
                assert result.prefill is not None and result.prefill.sent_pages > 0
                assert result.finished.finish_reason == "stop", result.finished.detail
                assert result.token_ids == alone.token_ids
                text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
                if sampling.grammar.kind == "regex":
                    assert re.fullmatch(REGEX, text), text
                else:
                    value = json.loads(text)
                    assert value["tag"] in ("a", "b") and value["id"] <= 999, text
        pd.check_no_leaks()


async def _colocated(pd, sampling: node_pb2.SamplingParams):  # type: ignore[no-untyped-def]
    return await asyncio.gather(
        *(pd.generate_async(p, sampling, through_prefill=False) for p in PROMPTS)
    )


def test_an_invalid_grammar_is_refused_by_both_nodes(tmp_path: Path, tiny_text_model: Path) -> None:
    with pd_trio(tmp_path, tiny_text_model, "mooncake") as pd:
        for node in (pd.prefill, pd.decode):
            request = node_pb2.PrefillRequest(
                input_ids=[1, 2, 3],
                sampling=_sampling("regex", "[a-"),
                bootstrap_room=7,
                decode_node_id=pd.decode_id,
            )
            with pytest.raises(grpc.RpcError) as info:
                if node is pd.prefill:
                    node.stub.Prefill(request, timeout=30)
                else:
                    generate = node_pb2.GenerateRequest(
                        input_ids=[1, 2, 3], sampling=request.sampling
                    )
                    list(node.stub.Generate(generate, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "invalid regex" in str(info.value.details()), info.value.details()
        pd.check_no_leaks()
