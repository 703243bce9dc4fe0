"""Weights into a model: safetensors files (single or sharded index) or dummy random weights.

A checkpoint tensor (HF's name) lands in a parameter by the model's maps: a family's own names
are first renamed (`checkpoint_renames`: Mixtral's `block_sparse_moe.experts.<e>.w1`), HF's
separate projections fill parts of one fused parameter (`stacked_params`: q/k/v, gate/up), and
one expert's tensors fill its slice of a layer's stacked expert weights (`expert_params`: no
module per expert; under expert parallelism the rank's slots of that expert, by its placement,
and a tensor of an expert the rank does not hold is never read). Every slot must be filled once
(`_check_complete`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
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
    model = _to_dtype(model, dtype).eval()
    rewrite_linears(model)
    return model


def _to_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)`, but for the parameters a module names in `fp32_params` (a DeepSeek-V3
    router's weight and correction bias: HF keeps them in fp32 in a 16-bit model too)."""
    kept = [
        (param, param.data.clone())
        for module in model.modules()
        for name in getattr(module, "fp32_params", ())
        if (param := getattr(module, name)) is not None
    ]
    model = model.to(dtype=dtype)
    for param, value in kept:
        param.data = value
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


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, its reader) of every checkpoint tensor: a tensor is read only if it is asked for."""
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, functools.partial(handle.get_tensor, name)


def _load_safetensors(model: nn.Module, model_dir: Path) -> None:
    params = dict(model.named_parameters())
    renames: tuple[tuple[str, str], ...] = getattr(model, "checkpoint_renames", ())
    tp_slice = getattr(model, "tp_slice", lambda _name, t: t)
    loaded: set[_Slot] = set()
    for raw_name, read in _iter_tensors(safetensors_files(model_dir)):
        name = raw_name.removeprefix("model.")
        for old, new in renames:
            name = name.replace(old, new)
        if name.endswith(_SKIPPED_SUFFIXES):
            continue
        slots = _slots(model, name)
        if not slots:
            continue  # an expert that only other ranks hold: never read
        if any(s.param not in params or not s.fits(params[s.param]) for s in slots):
            if name == "lm_head.weight" and "lm_head.weight" not in params:
                continue  # tied embeddings: the checkpoint may still carry a copy
            raise ModelConfigError(f"{model_dir}: checkpoint tensor {raw_name!r} has no place")
        tensor = tp_slice(name, read())
        for slot in slots:
            _copy_checked(slot.view(model, params[slot.param]), tensor, raw_name)
            loaded.add(slot)
    _check_complete(model, params, loaded, model_dir)


@dataclass(frozen=True)
class _Slot:
    """Where one checkpoint tensor goes: parameter `param`; in a stacked expert weight, slot
    `expert` (the expert's own index, or under expert parallelism a slot of the rank's
    placement); in a fused projection (or an expert's gate/up rows), part `part`."""

    param: str
    expert: int | None = None
    part: int | None = None

    def fits(self, param: torch.Tensor) -> bool:
        return self.expert is None or self.expert < param.shape[0]

    def view(self, model: nn.Module, param: torch.Tensor) -> torch.Tensor:
        view = param.data if self.expert is None else param.data[self.expert]
        if self.part is None:
            return view
        sizes = model.shard_sizes(self.param)  # type: ignore[operator]
        return view.narrow(0, sum(sizes[: self.part]), sizes[self.part])

    def __str__(self) -> str:
        expert = "" if self.expert is None else f" expert {self.expert}"
        return self.param + expert + ("" if self.part is None else f" part {self.part}")


# `...layers.<i>...experts.<e>.<name>.weight`: one expert's tensor of layer i, stacked with the
# others at load.
_EXPERT_TENSOR = re.compile(
    r"^(?P<experts>(?:.*\.)?layers\.(?P<layer>\d+)\..+\.experts)\."
    r"(?P<expert>\d+)\.(?P<proj>\w+)\.weight$"
)


def _slots(model: nn.Module, name: str) -> list[_Slot]:
    """The slots of checkpoint tensor `name` (HF naming, `model.` prefix removed), by the model's
    `expert_params` (per-expert tensors -> stacked parameters, at the model's
    `local_expert_slots` of the layer's expert: none, one, or several copies) and
    `stacked_params` (HF projections -> one fused parameter)."""
    experts: dict[str, tuple[str, int | None]] = getattr(model, "expert_params", {})
    match = _EXPERT_TENSOR.match(name) if experts else None
    if match is not None and match["proj"] in experts:
        param, part = experts[match["proj"]]
        target = f"{match['experts']}.{param}"
        local_slots = getattr(model, "local_expert_slots", lambda _layer, e: (e,))
        slots = local_slots(int(match["layer"]), int(match["expert"]))
        return [_Slot(target, slot, part) for slot in slots]
    stacked: dict[str, tuple[str, int]] = getattr(model, "stacked_params", {})
    for hf_name, (fused, part) in stacked.items():
        if f".{hf_name}." in name:
            return [_Slot(name.replace(f".{hf_name}.", f".{fused}."), None, part)]
    return [_Slot(name)]


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelConfigError(
            f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, the model expects "
            f"{tuple(dst.shape)}; config.json does not match the weights"
        )
    dst.copy_(src.to(dst.dtype))


def _check_complete(
    model: nn.Module, params: dict[str, nn.Parameter], loaded: set[_Slot], model_dir: Path
) -> None:
    fused = _parts(getattr(model, "stacked_params", {}).values())
    stacked = _parts(getattr(model, "expert_params", {}).values())
    expected: set[_Slot] = set()
    for name, param in params.items():
        module, leaf = name.rsplit(".", 2)[-2:] if "." in name else ("", name)
        if module == "experts" and leaf in stacked:
            experts = range(param.shape[0])
            expected.update(_Slot(name, e, part) for e in experts for part in stacked[leaf])
        elif module in fused:
            expected.update(_Slot(name, None, part) for part in fused[module])
        else:
            expected.add(_Slot(name))
    missing = sorted(str(slot) for slot in expected - loaded)
    if missing:
        raise ModelConfigError(
            f"{model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}"
        )


def _parts(targets: Iterable[tuple[str, int | None]]) -> dict[str, list[int | None]]:
    """Each fused or stacked parameter's parts, from a name map's (target, part) values."""
    parts: dict[str, list[int | None]] = {}
    for target, part in targets:
        parts.setdefault(target, []).append(part)
    return parts
