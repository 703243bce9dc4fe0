"""Programmatic dependent launch (PDL) of the engine's Triton kernels on Hopper and later GPUs.

A decode step is a chain of ~230 short kernels, each waiting for the one before it. Without PDL
the next kernel is launched only once the previous one has fully finished: every boundary costs
the launch latency plus the ramp-up of the new kernel's programs, a microsecond or two each,
which faster HBM does not shrink (on an H200 they are most of what stands between the step and
the bandwidth floor). With PDL the next kernel's programs are placed on the multiprocessors as
the previous kernel's last wave runs, and each of them waits (`griddepcontrol.wait`, Triton's
`gdc_wait`) until the previous kernel has finished and its writes are visible.

The rule that keeps it safe: every kernel launched with PDL calls `dependent_start(PDL)` first,
before it reads or writes any memory. Then nothing it touches can race the kernel before it, and
that kernel's completion implies every earlier one's (each waited for its own predecessor). The
trigger (`gdc_launch_dependents`) comes right after the wait, so at most two kernels are in
flight and the next one's programs only take multiprocessor slots that the current kernel's
last wave left free. A kernel launched without PDL (cuBLAS, torch's own) is ordered as always.

`launch_options(x)` gives a launch's keyword arguments: the `PDL` constexpr and Triton's
`launch_pdl`. PDL is used for CUDA tensors on compute capability 9.0 and up when this Triton
has grid dependency control; `PDSERVE_PDL=0` in the environment turns it off (A/B timings:
scripts/gpu/decode_accounting.py). The results do not change with it: same kernels, same
arithmetic, only the launch overlaps.
"""

from __future__ import annotations

import functools
import os

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

ENV_VAR = "PDSERVE_PDL"

try:  # Triton >= 3.3 (torch 2.7's CUDA wheels and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # type: ignore[import-untyped]

    _HAS_GDC = True
except ImportError:
    _HAS_GDC = False


def _triton_launches_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions  # type: ignore[import-untyped]
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get(ENV_VAR, "1") == "0" or not _HAS_GDC or not _triton_launches_pdl():
        return False
    major, _ = torch.cuda.get_device_capability(device_index)
    return major >= 9


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels on `x`'s device launch with PDL (read once per device and process)."""
    if not x.is_cuda:
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _supported(index)


def launch_options(x: torch.Tensor) -> dict[str, bool]:
    """Keyword arguments for a Triton launch of a kernel that starts with `dependent_start`."""
    return {"PDL": True, "launch_pdl": True} if enabled(x) else {"PDL": False}


@triton.jit
def dependent_start(PDL: tl.constexpr):
    """First statement of a kernel launched with `launch_options`: wait for the kernel before
    (its writes visible), then let the next one be placed."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
