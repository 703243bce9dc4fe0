"""Bring flashinfer to a GPU host that has no package index.

    python3 -m scripts.gpu wheels flashinfer pack .flashinfer                # here: download, prune
    python3 -m scripts.gpu wheels flashinfer install .flashinfer --site DIR  # there: prints DIR

`pack` downloads flashinfer-python (pure Python plus the CUDA sources it compiles on first use)
and apache-tvm-ffi (its binding layer; the only import-time need the GPU image lacks: torch,
numpy, einops, tabulate, click, nvidia-ml-py, ninja and nvcc are there). The flashinfer wheel is
~62 MB, too close to what one device call may carry, so `pack` keeps every Python file and only
the C++ that the JIT of the paged attention kernels reads (flashinfer's headers, CUTLASS, CCCL,
spdlog and the top-level sources of data/csrc), dropping the model-specific kernel trees: ~26 MB.

`install` unpacks into a private site directory (`--site DIR`, by default a new temporary
folder: scripts/gpu/environment.py) and also places any
compiled modules found under DIR/aot/NAME.so where flashinfer looks for prebuilt ones
(flashinfer/data/aot/NAME/NAME.so), so a later call need not compile them again.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from scripts.gpu.environment import unpack_wheels

FLASHINFER = "flashinfer-python==0.7.2.post1"
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"
PLATFORM_ARGS = [
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
    "--platform", "manylinux_2_17_x86_64", "--platform", "any",
]  # fmt: skip
KEEP_DATA = (
    "data/include/", "data/cutlass/include/", "data/cutlass/tools/util/include/",
    "data/spdlog/include/", "data/cccl/cub/", "data/cccl/libcudacxx/include/",
    "data/cccl/thrust/",
)  # fmt: skip
PRUNED_ZIP = "flashinfer-pruned.zip"


def keep(name: str) -> bool:
    """Whether a path of the flashinfer wheel is needed to import it and JIT-compile the paged
    prefill/decode kernels."""
    if not name.startswith("flashinfer/"):
        return not name.endswith("/RECORD")  # the dist-info, less its file list
    rel = name[len("flashinfer/") :]
    if rel.endswith(".py"):
        return True
    if rel.startswith("data/"):
        top_level_source = rel.startswith("data/csrc/") and rel.count("/") == 2
        return top_level_source or rel.startswith(KEEP_DATA)
    return not rel.startswith(("experimental/", "moe_ep/", "fused_moe/backends/"))


def pack(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    download = [sys.executable, "-m", "pip", "download", "--no-deps", *PLATFORM_ARGS, "-d"]
    subprocess.run([*download, str(out / "download"), FLASHINFER, TVM_FFI], check=True)
    (wheel,) = (out / "download").glob("flashinfer_python-*.whl")
    (tvm,) = (out / "download").glob("apache_tvm_ffi-*.whl")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out / PRUNED_ZIP, "w") as dst:
        for info in src.infolist():
            if keep(info.filename):
                dst.writestr(info, src.read(info), zipfile.ZIP_DEFLATED, 9)
    tvm.replace(out / tvm.name)
    wheel.unlink()
    (out / "download").rmdir()
    sizes = {p.name: p.stat().st_size for p in out.glob("*") if p.is_file()}
    print(f"packed into {out}: {sizes} ({sum(sizes.values()) / 2**20:.1f} MiB)")


def install(src: Path, site: Path) -> None:
    site.mkdir(parents=True, exist_ok=True)
    unpack_wheels(src, site, PRUNED_ZIP)
    (tvm,) = src.glob("apache_tvm_ffi-*.whl")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    subprocess.run([*pip, "--no-compile", "--upgrade", "--target", str(site), str(tvm)], check=True)
    for so in sorted((src / "aot").glob("*.so")):
        target = site / "flashinfer" / "data" / "aot" / so.stem / so.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(so.read_bytes())
        print(f"prebuilt module: {so.stem}")
    print(site)
