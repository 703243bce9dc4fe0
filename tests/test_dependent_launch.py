"""Programmatic dependent launch (engine/models/dependent_launch.py) and the measured decode tiles
(engine/models/gemm_tiles.py) that put the decode GEMMs on Triton under linear_kernel "auto".

The rule that makes PDL safe is checked on the source: every Triton kernel of the engine takes
the PDL constexpr and starts with `dependent_start(PDL)` (nothing touches memory before the
wait), and every launch passes `launch_options`. On a GPU, a chain of the kernels in a CUDA graph
gives the same bits with and without PDL.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from engine.models import dependent_launch, gemm_tiles, gpu_linear
from engine.models.gemm_tiles import GemmTile, GpuTiles, gate_up_silu_tile
from engine.models.linear_backends import resolve_linear_kernel

ROOT = Path(__file__).resolve().parents[1]
KERNEL_MODULES = [
    ROOT / "engine/attention/triton_kernels.py",
    ROOT / "engine/models/elementwise_kernels.py",
    ROOT / "engine/models/gpu_linear_kernels.py",
]
CUDA = torch.device("cuda")


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d) == "triton.jit" for d in fn.decorator_list)


def _launched_kernels(tree: ast.Module) -> dict[str, list[ast.Call]]:
    """`name[grid](...)` calls by kernel name."""
    calls: dict[str, list[ast.Call]] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name)
        ):
            calls.setdefault(node.func.value.id, []).append(node)
    return calls


@pytest.mark.parametrize("path", KERNEL_MODULES, ids=lambda p: p.name)
def test_every_launched_kernel_waits_first_and_launches_with_the_options(path: Path) -> None:
    tree = ast.parse(path.read_text())
    kernels = {fn.name: fn for fn in tree.body if isinstance(fn, ast.FunctionDef) and _is_jit(fn)}
    launches = _launched_kernels(tree)
    assert launches, f"{path.name} launches no kernel"
    for name, calls in launches.items():
        fn = kernels[name]
        params = [a.arg for a in fn.args.args]
        assert params[-1] == "PDL", f"{name}: the PDL constexpr must be its last parameter"
        body = [
            s
            for s in fn.body
            if not isinstance(s, ast.Expr) or not isinstance(s.value, ast.Constant)
        ]
        assert ast.unparse(body[0]) == "dependent_start(PDL)", (
            f"{name} must call dependent_start(PDL) before anything else (it reads or writes "
            f"memory the kernel before it may still be writing)"
        )
        for call in calls:
            spread = [kw for kw in call.keywords if kw.arg is None]
            assert any(ast.unparse(kw.value).startswith("launch_options(") for kw in spread), (
                f"a launch of {name} (line {call.lineno}) must pass **launch_options(...)"
            )


def test_no_pdl_off_cuda_and_when_the_environment_says_so(monkeypatch) -> None:
    assert dependent_launch.launch_options(torch.zeros(1)) == {"PDL": False}
    assert not dependent_launch.enabled(torch.zeros(1))
    monkeypatch.setenv(dependent_launch.ENV_VAR, "0")
    dependent_launch._supported.cache_clear()
    try:
        assert not dependent_launch._supported(0)  # decided before any CUDA call
    finally:
        dependent_launch._supported.cache_clear()


def test_measured_tiles_read_back_and_pick_by_rows() -> None:
    tiles = GpuTiles(
        linear={(4096, 4096): {16: GemmTile(16, 64, 256, 1, 4, 5), 64: None}},
        gate_up_silu={16: GemmTile(16, 32, 256, 1, 4, 3), 64: GemmTile(64, 64, 64, 1, 4, 3)},
    )
    assert GpuTiles.from_json(json.loads(json.dumps(tiles.to_json()))) == tiles
    assert gate_up_silu_tile(8, tiles) == GemmTile(16, 32, 256, 1, 4, 3)
    assert gate_up_silu_tile(17, tiles) == GemmTile(64, 64, 64, 1, 4, 3)
    assert gate_up_silu_tile(17) == GemmTile(32, 32, 128, 1, 4, 3)  # the rule without a table
    for name, measured in gemm_tiles.MEASURED.items():
        assert all(t.split_k == 1 for t in measured.gate_up_silu.values()), name
        assert max(measured.gate_up_silu) <= gemm_tiles.GATE_UP_SILU_MAX_ROWS, name


def test_auto_takes_triton_only_on_a_gpu_with_measured_tiles(monkeypatch) -> None:
    monkeypatch.setattr(gpu_linear, "tiles_here", lambda device: None)
    assert resolve_linear_kernel("auto", CUDA, torch.bfloat16) == "aten"
    measured = next(iter(gemm_tiles.MEASURED.values()))
    monkeypatch.setattr(gpu_linear, "tiles_here", lambda device: measured)
    assert resolve_linear_kernel("auto", CUDA, torch.bfloat16) == "triton"
    assert resolve_linear_kernel("auto", CUDA, torch.float32) == "aten"  # tiles are 16-bit
    assert resolve_linear_kernel("auto", torch.device("cpu"), torch.bfloat16) != "triton"


def test_replace_linears_takes_the_gpus_table(monkeypatch) -> None:
    measured = next(iter(gemm_tiles.MEASURED.values()))
    monkeypatch.setattr(gpu_linear, "tiles_here", lambda device: measured)
    model = torch.nn.Sequential(
        torch.nn.Linear(4096, 4096, bias=False, device="meta", dtype=torch.bfloat16),
        torch.nn.Linear(4096, 1000, bias=False, device="meta", dtype=torch.bfloat16),
    )
    assert gpu_linear.replace_linears(model) == 2
    o_proj, other = model[0], model[1]
    assert o_proj.tile_for(16) == measured.linear[(4096, 4096)][16]
    assert other.tile_for(16) is None  # a shape the table lacks: cuBLAS
    assert o_proj.tile_for(65) is None  # beyond the measured rows
    fp32 = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False, device="meta"))
    gpu_linear.replace_linears(fp32)  # the tiles were measured in 16 bits: the rule's
    assert fp32[0].table is None and fp32[0].tile_for(16) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graph_of_the_kernels_gives_the_same_bits_with_and_without_pdl(monkeypatch) -> None:
    from engine.models import elementwise
    from engine.models.gpu_linear_kernels import gate_up_silu, skinny_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 1024, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(1024, 1024, device="cuda", generator=gen) * 0.03).to(torch.bfloat16)
    w_up = (torch.randn(2048, 1024, device="cuda", generator=gen) * 0.03).to(torch.bfloat16)
    norm_w = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
    split = GemmTile(64, 32, 128, split_k=2, num_warps=4, num_stages=3)

    def chain() -> torch.Tensor:
        h = x
        for _ in range(8):
            h = elementwise.rms_norm(h, norm_w, 1e-5)
            h = skinny_linear(h, w, None, split)
            h = gate_up_silu(h, w_up, GemmTile(64, 32, 128, 1, 4, 3))
        return h

    outs = []
    for env in ("1", "0"):
        monkeypatch.setenv(dependent_launch.ENV_VAR, env)
        dependent_launch._supported.cache_clear()
        chain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        outs.append(out.clone())
    dependent_launch._supported.cache_clear()
    assert torch.equal(outs[0], outs[1])
