"""Bring Mooncake's CUDA build (and NIXL) to a GPU host that has no package index.

    python3 -m scripts.gpu wheels mooncake pack .mooncake                  # here: download, prune
    python3 -m scripts.gpu wheels mooncake install .mooncake --site DIR    # there: prints the env

`pack` downloads `mooncake-transfer-engine-cuda13` (the CUDA 13 build, as the GPU image's torch
is cu130; 49.7 MB, with the store, EP and process-group modules and their binaries) and keeps
only the transfer engine: `mooncake/engine.so`, the two libraries it loads from its own folder
and the four it loads from the wheel's `.libs`, plus the Python files and the dist-info (~9 MB).
It prunes `nixl-cu13` the same way (its three `nixl_ep_cu13` modules, one per torch version, are
half the wheel and the agent never loads them), so both fit in one device call.

The engine links system libraries that a CUDA image need not have: libibverbs.so.1 and
libmlx5.so.1 (even without an RDMA device), libnuma.so.1 and libcurl.so.4. `pack` fetches their
Debian packages; `install` unpacks them under the site folder (never into `/`) and links into
one folder there only the sonames the host's loader cannot find, so a host library is never
shadowed. libcudart.so.13 comes from
the image's `nvidia-cuda-runtime` (torch's own), libcuda.so.1 from the driver.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from scripts.gpu.environment import unpack_wheels

MOONCAKE = "mooncake-transfer-engine-cuda13==0.3.14"
NIXL = ("nixl==1.5.1", "nixl-cu13==1.5.1")
PLATFORM_ARGS = [
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
    "--platform", "any",
]  # fmt: skip
# The engine's system libraries and everything they need, by Debian package (bookworm names).
DEBS = (
    "libibverbs1", "ibverbs-providers", "libnl-3-200", "libnl-route-3-200", "libnuma1",
    "libcurl4", "libbrotli1", "libgssapi-krb5-2", "libkrb5-3", "libk5crypto3",
    "libkrb5support0", "libcom-err2", "libkeyutils1", "libidn2-0", "libunistring2",
    "libldap-2.5-0", "libsasl2-2", "libsasl2-modules-db", "libdb5.3", "libgnutls30",
    "libhogweed6", "libnettle8", "libp11-kit0", "libtasn1-6", "libgmp10", "libffi8",
    "libnghttp2-14", "libpsl5", "librtmp1", "libssh2-1", "libssl3", "libzstd1", "zlib1g",
)  # fmt: skip
MOONCAKE_FILES = ("engine.so", "libasio.so", "libetcd_wrapper.so")
MOONCAKE_LIBS = ("libyaml-cpp-", "libjsoncpp-", "libglog-", "libgflags-")
CUDA_LIBS = "nvidia/cu13/lib"  # libcudart.so.13 of the image's nvidia-cuda-runtime (torch's)


def keep_mooncake(name: str) -> bool:
    """Whether a path of the Mooncake CUDA wheel is needed to import `mooncake.engine`."""
    top, _, rest = name.partition("/")
    if top.endswith(".dist-info"):
        return rest != "RECORD"  # pip rewrites it; the pruned files are not in the zip
    if top.endswith(".libs"):
        return rest.startswith(MOONCAKE_LIBS)
    if top != "mooncake":
        return False
    return rest.endswith((".py", ".pyi", "py.typed")) or rest in MOONCAKE_FILES


def keep_nixl(name: str) -> bool:
    """Whether a path of the nixl-cu13 wheel is needed by `nixl_agent` (not by NIXL EP)."""
    return not (
        name.startswith("nixl_ep_cu13/") or "perftest" in name or name.endswith(".dist-info/RECORD")
    )


def _prune(wheel: Path, keep, out: Path) -> None:
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if keep(info.filename):
                dst.writestr(info, src.read(info), zipfile.ZIP_DEFLATED, 6)
    wheel.unlink()


def pack(out: Path) -> None:
    download = out / "download"
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM_ARGS, "-d"]
    subprocess.run([*pip, str(download), MOONCAKE, *NIXL], check=True)
    (mooncake,) = download.glob("mooncake_transfer_engine_cuda13-*.whl")
    (nixl_cu13,) = download.glob("nixl_cu13-*.whl")
    (nixl,) = download.glob("nixl-*.whl")
    _prune(mooncake, keep_mooncake, out / "mooncake-cuda13-pruned.zip")
    _prune(nixl_cu13, keep_nixl, out / "nixl-cu13-pruned.zip")
    nixl.replace(out / nixl.name)
    download.rmdir()
    debs = out / "deb"
    debs.mkdir(exist_ok=True)
    subprocess.run(["apt-get", "download", *DEBS], cwd=debs, check=True)
    sizes = [p.stat().st_size for p in out.rglob("*") if p.is_file()]
    print(f"packed into {out}: {len(sizes)} files, {sum(sizes) / 2**20:.1f} MiB")


def _loader_knows() -> set[str]:
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines()[1:] if line.strip()}


def link_missing_libraries(deb_dir: Path, deb_root: Path, lib_dir: Path) -> list[str]:
    """Unpack every .deb under `deb_root` and link into `lib_dir` each versioned soname
    (lib*.so.N) that the host's loader does not know; returns the linked names."""
    deb_root.mkdir(parents=True, exist_ok=True)
    lib_dir.mkdir(parents=True, exist_ok=True)
    for deb in sorted(deb_dir.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(deb_root)], check=True)
    known = _loader_knows()
    linked = []
    for lib in sorted(deb_root.glob("usr/lib/x86_64-linux-gnu/lib*.so.*")):
        soname = lib.name
        if soname.count(".so.") != 1 or not soname.split(".so.")[1].isdigit():
            continue  # only lib<name>.so.<major>, the name a NEEDED entry asks for
        if soname in known or (lib_dir / soname).exists():
            continue
        (lib_dir / soname).symlink_to(lib.resolve())
        linked.append(soname)
    return linked


def install(src: Path, site: Path) -> dict[str, str]:
    """Unpack the pruned wheels into `site`, the missing system libraries into `site/libs`;
    returns the environment a process that imports `mooncake.engine` needs (set it before it
    starts)."""
    unpack_wheels(src, site, "*-pruned.zip")
    unpack_wheels(src, site, "*.whl")
    lib_dir = site / "libs"
    linked = link_missing_libraries(src / "deb", site / "debs", lib_dir)
    print(f"installed into {site}; system libraries linked from .debs: {linked or 'none'}")
    cuda_libs = sorted({str(p) for entry in sys.path for p in Path(entry or ".").glob(CUDA_LIBS)})
    paths = [str(lib_dir), *cuda_libs, os.environ.get("LD_LIBRARY_PATH", "")]
    env = {
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p
        ),
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in paths if p),
    }
    unresolved = _unresolved(site / "mooncake" / "engine.so", env)
    print(f"engine.so libraries the loader cannot find: {unresolved or 'none'}")
    return env


def _unresolved(library: Path, env: dict[str, str]) -> list[str]:
    """NEEDED entries of `library` that `ldd` reports as not found under `env`."""
    try:
        out = subprocess.run(["ldd", str(library)], capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"(ldd failed: {exc})"]
    return [line.split()[0] for line in out.splitlines() if "not found" in line]


def install_and_print(src: Path, site: Path) -> None:
    for key, value in install(src, site).items():
        print(f"export {key}={value}")
