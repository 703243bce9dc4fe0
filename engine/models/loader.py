"""Weights into a model: safetensors files (single or sharded index) or dummy random weights."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.model_config import ModelConfig, ModelConfigError
from engine.models import build_model
from engine.models.linear_backends import linear_rewriter
from engine.tp.group import TPGroup
from engine.tp.partition import TPShard

# Checkpoint tensors we deliberately do not load (rotary tables are recomputed).
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    config: ModelConfig,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    shard: TPShard | None = None,
    group: TPGroup | None = None,
    linear_kernel: str = "auto",
) -> nn.Module:
    """The model (or one tensor-parallel rank's `shard` of it, talking over `group`); its linear
    layers swapped for `linear_kernel`'s (oneDNN-packed on CPU, Triton for decode-sized GEMMs on
    CUDA: engine/models/linear_backends.py), checked before any weight is loaded."""
    rewrite_linears = linear_rewriter(linear_kernel, device, dtype)
    skip_init = _no_random_init() if load_format == "safetensors" else contextlib.nullcontext()
    with torch.device(device), skip_init:
        model = build_model(config, shard, group)
    if load_format == "dummy":
        _init_dummy(model)
    elif load_format == "safetensors":
        _load_safetensors(model, Path(config.model_path))
    else:
        raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {load_format!r}")
    model = model.to(dtype=dtype).eval()
    rewrite_linears(model)
    return model


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Layers built without their random initialisation, every weight of which the checkpoint
    overwrites (`_check_complete` says if one is missing): it took a second of each node's
    start on the default model."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *_args, **_kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _init_dummy(model: nn.Module) -> None:
    generator = torch.Generator(device="cpu").manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            param.data.fill_(1.0)
        else:
            values = torch.empty(param.shape).uniform_(-0.05, 0.05, generator=generator)
            param.data.copy_(values)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ModelConfigError(
            f"{model_dir}: no safetensors weights found (missing: {missing or '*.safetensors'}); "
            "convert the checkpoint to safetensors or use load_format='dummy'"
        )
    return files


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, handle.get_tensor(name)


def _load_safetensors(model: nn.Module, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    stacked: dict[str, tuple[str, int]] = getattr(model, "stacked_params", {})
    tp_slice = getattr(model, "tp_slice", lambda _name, t: t)
    loaded: set[str] = set()
    for raw_name, full_tensor in _iter_tensors(safetensors_files(model_dir)):
        name = raw_name.removeprefix("model.")
        if name.endswith(_SKIPPED_SUFFIXES):
            continue
        tensor = tp_slice(name, full_tensor)
        target, shard = _fused_target(name, stacked)
        if target not in params:
            if name == "lm_head.weight" and "lm_head.weight" not in params:
                continue  # tied embeddings: the checkpoint may still carry a copy
            raise ModelConfigError(f"{model_dir}: checkpoint tensor {raw_name!r} has no place")
        param = params[target]
        if shard is None:
            _copy_checked(param.data, tensor, raw_name)
        else:
            fused = target.rsplit(".", 2)[-2]
            sizes = model.shard_sizes(fused)  # type: ignore[operator]
            start = sum(sizes[:shard])
            _copy_checked(param.data.narrow(0, start, sizes[shard]), tensor, raw_name)
            target = f"{target}#{shard}"
        loaded.add(target)
    _check_complete(params, stacked, loaded, model_dir)


def _fused_target(name: str, stacked: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    for hf_name, (fused, shard) in stacked.items():
        part = f".{hf_name}."
        if part in name:
            return name.replace(part, f".{fused}."), shard
    return name, None


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelConfigError(
            f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, the model expects "
            f"{tuple(dst.shape)}; config.json does not match the weights"
        )
    dst.copy_(src.to(dst.dtype))


def _check_complete(
    params: dict[str, nn.Parameter],
    stacked: dict[str, tuple[str, int]],
    loaded: set[str],
    model_dir: Path,
) -> None:
    shards: dict[str, int] = {}
    for fused, index in stacked.values():
        shards[fused] = max(shards.get(fused, 0), index + 1)
    expected: set[str] = set()
    for name in params:
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        if module in shards:
            expected.update(f"{name}#{i}" for i in range(shards[module]))
        else:
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ModelConfigError(
            f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )
