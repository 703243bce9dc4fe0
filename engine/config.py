"""Engine configuration: one frozen dataclass built at the edge (CLI, offline API) and passed in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.eplb.placement import ExpertPlacement
from engine.models.linear_backends import check_linear_kernel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    load_format: str = "safetensors"  # or "dummy": random weights of the real shapes
    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 16
    chunked_prefill_size: int = 2048  # token budget of one prefill step
    max_total_tokens: int = 65536  # KV capacity in tokens
    max_running_requests: int = 256
    context_length: int | None = None  # defaults to the model's max_position_embeddings
    attention_backend: str = "torch_native"
    enable_prefix_cache: bool = True
    schedule_policy: str = "fcfs"  # or "lpm": longest prefix match first
    tp_size: int = 1  # tensor-parallel ranks of this node (processes; see engine/tp/)
    # Expert parallelism: the routed experts of a MoE model sharded over the ranks this many
    # ways, whole experts per rank (a divisor of tp_size; 1: each rank holds every expert's
    # rows). Checked against the model in engine/tp/partition.py.
    ep_size: int = 1
    # Build step N+1 on the host while the GPU runs step N (engine/overlap.py); None: on for
    # CUDA with tp_size 1, where it pays, off elsewhere (a TP step copies its ids to the host).
    overlap_schedule: bool | None = None
    # Linear layers: "onednn" packs their weights for oneDNN (CPU), "triton" runs decode-sized
    # GEMMs through a skinny split-K kernel (CUDA), "aten" keeps torch's F.linear, "auto" packs
    # where it can and is "aten" on CUDA (engine/models/linear_backends.py).
    linear_kernel: str = "auto"
    # KV transfers of scattered pages through a contiguous span (engine/memory/staging.py):
    # pages set aside after the pool (0: off), and the descriptor count above which a write
    # is staged. Staging runs on one rank: it needs tp_size 1.
    kv_staging_pages: int = 0
    kv_staging_min_runs: int = 16
    # CUDA-graph decode steps get their inputs as one packed host-to-device copy and derive the
    # rest (positions, table entries, attention plan, future tokens) inside the graph, which
    # also computes the greedy tokens (engine/step_prep.py, engine/cuda_graph.py).
    graph_step_prep: bool = False
    # Where each MoE layer's experts live under expert parallelism (engine/eplb/placement.py),
    # checked against the model at start. The EP code lays the experts out by it (plan_tp);
    # without expert parallelism every expert is on every rank and it changes nothing.
    expert_placement: ExpertPlacement | None = None

    def __post_init__(self) -> None:
        _at_least("page_size", self.page_size, 1)
        _at_least("chunked_prefill_size", self.chunked_prefill_size, 1)
        _at_least("max_running_requests", self.max_running_requests, 1)
        _at_least("max_total_tokens", self.max_total_tokens, self.page_size)
        _at_least("tp_size", self.tp_size, 1)
        _at_least("ep_size", self.ep_size, 1)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(
                f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}"
            )
        check_linear_kernel(self.linear_kernel)
        _at_least("kv_staging_pages", self.kv_staging_pages, 0)
        _at_least("kv_staging_min_runs", self.kv_staging_min_runs, 0)
        if self.kv_staging_pages and self.tp_size > 1:
            raise ValueError(
                f"kv_staging_pages needs tp_size 1 (got {self.tp_size}): each TP rank would "
                "have to gather and scatter its own shard; leave staging off with TP"
            )
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(
                f"schedule_policy must be 'fcfs' or 'lpm', got {self.schedule_policy!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def use_overlap_schedule(self) -> bool:
        if self.overlap_schedule is not None:
            return self.overlap_schedule
        return self.device.startswith("cuda") and self.tp_size == 1

    @property
    def num_pages(self) -> int:
        """KV pages, plus the scratch page 0."""
        return self.max_total_tokens // self.page_size + 1


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
