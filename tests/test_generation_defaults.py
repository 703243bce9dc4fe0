"""Default sampling from a model's generation_config.json: read, checked, applied only to the
fields a request leaves out; and the default model carries its model card's chat sampling."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.generation_defaults import GenerationConfigError, load_generation_defaults
from engine.model_fetch import DEFAULT_SOURCE, recommend_sampling
from gateway.config import LimitsConfig, RequestDefaults
from gateway.requests.protocol import parse_chat, parse_native

LIMITS = LimitsConfig(
    max_inflight=8, max_body_bytes=1 << 20, max_n=4, max_stop=4, max_stop_chars=64
)


def model_dir(tmp_path: Path, config: dict[str, object]) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_auto_reads_the_models_file_and_none_reads_nothing(tmp_path: Path) -> None:
    path = model_dir(tmp_path, {"temperature": 0.2, "top_p": 0.9, "max_length": 20, "eos": 2})
    defaults = load_generation_defaults("auto", path)
    assert defaults.as_dict() == {"temperature": 0.2, "top_p": 0.9}
    assert str(path) in defaults.source and "temperature=0.2" in defaults.describe()
    assert load_generation_defaults("none", path).as_dict() == {}
    assert load_generation_defaults("auto", tmp_path / "elsewhere").as_dict() == {}
    assert load_generation_defaults(str(path / "generation_config.json"), None).get("top_p") == 0.9


def test_do_sample_false_is_greedy_and_bad_values_name_the_file_and_rule(tmp_path: Path) -> None:
    greedy = load_generation_defaults(
        "auto", model_dir(tmp_path, {"do_sample": False, "temperature": 0.7})
    )
    assert greedy.get("temperature") == 0.0
    with pytest.raises(GenerationConfigError, match=r"top_p must be in \(0, 1\], got 1.5"):
        load_generation_defaults("auto", model_dir(tmp_path, {"top_p": 1.5}))
    with pytest.raises(GenerationConfigError, match="no such file"):
        load_generation_defaults(str(tmp_path / "missing.json"), None)


def test_a_request_gets_the_defaults_only_for_what_it_leaves_out(tmp_path: Path) -> None:
    generation = load_generation_defaults(
        "auto", model_dir(tmp_path, {"temperature": 0.2, "top_k": 40, "max_new_tokens": 300})
    )
    limits = replace(LIMITS, defaults=RequestDefaults(generation, 300))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    proto = parse_chat(body, "m", limits).sampling.to_proto(16)
    assert (proto.temperature, proto.top_k) == (pytest.approx(0.2), 40)
    proto = parse_chat({**body, "temperature": 1.5}, "m", limits).sampling.to_proto(16)
    assert (proto.temperature, proto.top_k) == (pytest.approx(1.5), 40)
    native = parse_native({"text": "hi"}, limits).sampling.to_proto(16)
    assert native.temperature == pytest.approx(0.2)
    plain = parse_chat(body, "m", LIMITS).sampling.to_proto(16)
    assert plain.temperature == pytest.approx(1.0)  # the engine's default
    null = parse_chat({**body, "temperature": None}, "m", limits).sampling.to_proto(16)
    assert null.temperature == pytest.approx(0.2)  # null means "the default", as absent
    with pytest.raises(ValueError, match="--default-max-tokens must be >= 1"):
        RequestDefaults(generation, 0)


def test_the_default_model_gets_its_model_cards_chat_sampling(tmp_path: Path) -> None:
    path = model_dir(tmp_path, {"bos_token_id": 1, "top_p": 0.5})
    recommend_sampling(path, DEFAULT_SOURCE)
    written = json.loads((path / "generation_config.json").read_text())
    assert written["temperature"] == 0.2 and written["do_sample"] is True
    assert written["top_p"] == 0.5 and written["bos_token_id"] == 1  # what was there stays
    recommend_sampling(path, DEFAULT_SOURCE)  # idempotent
    assert json.loads((path / "generation_config.json").read_text()) == written
