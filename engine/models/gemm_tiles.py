"""Launch settings of the skinny (decode-sized) Triton GEMM: one frozen tile per GEMM shape.

A decode step's GEMMs have few rows (the batch: 1-256) and large weights (Llama-3-8B: 16-1,050
MB each in bf16), so their time is the time to stream the weight from HBM once; the activations
are tiny. The rule (`choose_tile`) fills the SMs in whole waves of programs, cutting K into
SPLIT_K slices when there are few output tiles. Measured in the step, that loses to cuBLAS: a
few deep-pipelined programs (4-5 stages, one per SM, no split-K) stream faster. So the engine
runs the tiles measured per GPU model (`MEASURED`: a `GpuTiles` per `torch.cuda.get_device_name`,
written from scripts/gpu/gemm_chain.py --table-out, which also says where cuBLAS won), and the
rule only where no table exists and `linear_kernel="triton"` was asked for. Plain Python (no
Triton): everything here is tested on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

# Two programs resident per multiprocessor keep the memory pipes full (a program streams 16-20
# KiB of weight per pipeline stage). Split-K is chosen so the programs fill those slots in whole
# waves: at WAVE_EFFICIENCY or better, a last, part-empty wave does not idle the chip. Each K
# slice keeps at least MIN_SLICE_BLOCKS blocks, so a program's pipeline has something to overlap
# and the split-K partials (SPLIT_K x M x N fp32, summed by a second kernel) stay small.
PROGRAMS_PER_SM = 2
MAX_SPLIT_K = 16
MIN_SLICE_BLOCKS = 4
WAVE_EFFICIENCY = 0.9


@dataclass(frozen=True)
class GemmTile:
    """One launch of `gpu_linear_kernels.skinny_linear`: tile sizes, K slices, warps, stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {size}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")

    def k_per_split(self, k: int) -> int:
        """Length of each K slice: a multiple of block_k, so no slice starts mid-block."""
        blocks = -(-k // self.block_k)
        return -(-blocks // self.split_k) * self.block_k

    def num_splits(self, k: int) -> int:
        """Slices that hold keys at all (the last ones may be empty when K is short)."""
        return -(-k // self.k_per_split(k))

    def grid(self, m: int, n: int, k: int) -> tuple[int, int, int]:
        # Row tiles vary fastest: the programs sharing a weight tile run side by side, so the
        # second and later row tiles find that weight in L2.
        return (-(-m // self.block_m), -(-n // self.block_n), self.num_splits(k))

    def describe(self) -> str:
        return (
            f"BM{self.block_m} BN{self.block_n} BK{self.block_k} splitK{self.split_k} "
            f"w{self.num_warps} s{self.num_stages}"
        )


def choose_tile(m: int, n: int, k: int, num_sms: int) -> GemmTile:
    """The tile for an [m, k] x [n, k]^T GEMM: the row tile covers m (up to 64 rows), 64 weight
    rows per program, and the smallest split-K whose programs fill PROGRAMS_PER_SM slots per SM
    at WAVE_EFFICIENCY (else the most efficient one allowed)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 128
    tiles = -(-m // block_m) * -(-n // block_n)
    split_k = wave_split(tiles, -(-k // block_k), PROGRAMS_PER_SM * num_sms)
    return GemmTile(block_m, block_n, block_k, split_k, num_warps=4, num_stages=4)


def wave_efficiency(programs: int, slots: int) -> float:
    """Busy share of the slots over the waves `programs` take (1.0: whole waves)."""
    return programs / (-(-programs // slots) * slots)


def wave_split(tiles: int, k_blocks: int, slots: int) -> int:
    """Split-K for `tiles` output tiles over `k_blocks` K blocks on `slots` program slots."""
    best, best_eff = 1, wave_efficiency(tiles, slots)
    split = 1
    while best_eff < WAVE_EFFICIENCY and split < MAX_SPLIT_K:
        split *= 2
        if k_blocks < split * MIN_SLICE_BLOCKS:
            break
        eff = wave_efficiency(tiles * split, slots)
        if eff > best_eff:
            best, best_eff = split, eff
    return best


# (N, K) of a weight -> {rows measured: the winning tile, or None where cuBLAS won}.
TileTable: TypeAlias = dict[tuple[int, int], dict[int, GemmTile | None]]


def tile_for(
    m: int, n: int, k: int, num_sms: int, max_rows: int, table: TileTable | None = None
) -> GemmTile | None:
    """The tile an [m, k] x [n, k]^T GEMM runs with, None for cuBLAS. With a measured `table`
    only the table decides: a shape in it takes the entry of the smallest measured row count
    >= m (beyond the largest: cuBLAS), any other shape cuBLAS. Without one, `choose_tile` up to
    `max_rows` rows."""
    if table is not None:
        return _measured_at(table.get((n, k), {}), m)
    return choose_tile(m, n, k, num_sms) if m <= max_rows else None


def _measured_at(by_rows: Mapping[int, GemmTile | None], m: int) -> GemmTile | None:
    """The entry of the smallest measured row count >= m; None beyond the largest."""
    above = [rows for rows in sorted(by_rows) if rows >= m]
    return by_rows[above[0]] if above else None


# The fused gate_up + SiLU kernel (`gpu_linear_kernels.gate_up_silu`) takes decode batches up to
# this many rows; larger ones run cuBLAS and the SiLU kernel.
GATE_UP_SILU_MAX_ROWS = 64


@dataclass(frozen=True)
class GpuTiles:
    """The decode GEMM tiles measured on one GPU model by `scripts/gpu/gemm_chain.py` (a 32-layer
    chain in one CUDA graph, programmatic dependent launch on): `linear` for the skinny GEMM of
    each weight shape (None where cuBLAS won), `gate_up_silu` the fused kernel's tile by rows."""

    linear: TileTable
    gate_up_silu: dict[int, GemmTile]

    def gate_up_silu_tile(self, m: int) -> GemmTile | None:
        return _measured_at(self.gate_up_silu, m)

    def to_json(self) -> dict[str, object]:
        return {
            "linear": {
                f"{n},{k}": {str(m): _tile_json(t) for m, t in by_rows.items()}
                for (n, k), by_rows in self.linear.items()
            },
            "gate_up_silu": {str(m): _tile_json(t) for m, t in self.gate_up_silu.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> GpuTiles:
        linear: TileTable = {}
        for shape, by_rows in dict(data["linear"]).items():  # type: ignore[call-overload]
            n, k = (int(v) for v in shape.split(","))
            linear[(n, k)] = {int(m): _tile_of(t) for m, t in by_rows.items()}
        fused = {int(m): _tile_of(t) for m, t in dict(data["gate_up_silu"]).items()}  # type: ignore[call-overload]
        return cls(linear, {m: t for m, t in fused.items() if t is not None})


def _tile_json(tile: GemmTile | None) -> list[int] | None:
    if tile is None:
        return None
    return [tile.block_m, tile.block_n, tile.block_k, tile.split_k, tile.num_warps,
            tile.num_stages]  # fmt: skip


def _tile_of(value: list[int] | None) -> GemmTile | None:
    return None if value is None else GemmTile(*value)


# GPU model (torch.cuda.get_device_name) -> its measured tiles. A GPU listed here runs its decode
# GEMMs on the Triton kernels under linear_kernel "auto"; any other keeps cuBLAS. Written from
# `gemm_chain --rows 16,64 --table-out` (Llama-3-8B shapes, bf16, programmatic dependent launch
# on); the runs are in benchmarks/ (gpu-2026-11-26-pdl-*.md).
MEASURED: dict[str, GpuTiles] = {
    # 2026-11-26 21:04 UTC: qkv at 64 rows stays on cuBLAS (22.5 against 22.6 us a layer).
    "NVIDIA H100 80GB HBM3": GpuTiles(
        linear={
            (6144, 4096): {16: GemmTile(16, 32, 128, 1, 4, 5), 64: None},
            (4096, 4096): {16: GemmTile(16, 64, 256, 1, 4, 5), 64: GemmTile(64, 32, 128, 1, 4, 5)},
            (4096, 14336): {
                16: GemmTile(16, 64, 256, 1, 4, 5),
                64: GemmTile(64, 32, 256, 1, 4, 4),
            },
        },
        gate_up_silu={16: GemmTile(16, 32, 256, 1, 4, 3), 64: GemmTile(64, 32, 128, 1, 4, 3)},
    ),
}


def measured_for(gpu_name: str) -> GpuTiles | None:
    return MEASURED.get(gpu_name)


def gate_up_silu_tile(m: int, measured: GpuTiles | None = None) -> GemmTile:
    """The fused gate_up + SiLU kernel's tile for m rows: this GPU's measured one, else 32 output
    columns (64 weight rows, gate and up) per program, no split-K. The fallback was measured in
    a 32-layer chain on an H100 at Llama-3-8B shapes (scripts/gpu/gemm_chain.py, 2026-11-26):
    the best of 40 tiles at 16 and 64 rows."""
    if m > GATE_UP_SILU_MAX_ROWS:
        raise ValueError(f"gate_up_silu takes at most {GATE_UP_SILU_MAX_ROWS} rows, got {m}")
    tile = measured.gate_up_silu_tile(m) if measured is not None else None
    if tile is not None:
        return tile
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_k = 256 if m <= 16 else 128
    return GemmTile(block_m, 32, block_k, split_k=1, num_warps=4, num_stages=3)
