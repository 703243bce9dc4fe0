"""How a GPU script sets up the host it runs on: carried wheels, import paths, the environment.

The GPU hosts have no package index and the project only as a checkout (no console scripts), so:

- `add_site_arg` gives a script its `--site DIR` flag: where carried wheels are unpacked (default:
  a fresh temporary folder), never a fixed path;
- `unpack_wheels` unzips every wheel of a folder into the site (pure Python or manylinux wheels
  need no installer) and restores the mode bits of the shared libraries;
- `use_site` puts the site first on this process's import path (the one place a script changes
  it: the carried grpc / protobuf must win over the image's) and the site, then the checkout, on
  PYTHONPATH for the processes it starts, with any other variables the installed wheels need;
- `console_wrappers` writes `bootstrap-server`, `prefill-server` and `decode-server` scripts
  that run `python -m <module>` with this interpreter;
- `gpu_defaults` sets what every GPU process of ours expects unless told otherwise: no NVLink
  multicast in NCCL, PyTorch or NVSHMEM (the lent machines do not allow it).

Standard library only: a script calls these before anything imports grpc or the stubs, which the
site may replace.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_MODULES = {
    "bootstrap-server": "bootstrap.server",
    "prefill-server": "prefill_node.server",
    "decode-server": "decode_node.server",
}
# NVLink multicast off everywhere (NCCL, PyTorch's symmetric memory, NVSHMEM): the lent
# multi-GPU hosts are shared, and a program using multicast can take their GPUs out of service.
GPU_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def add_site_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--site",
        type=Path,
        default=None,
        help="folder to unpack carried wheels into (default: a new temporary folder)",
    )


def site_dir(site: Path | None) -> Path:
    """`site`, or a new temporary folder when the flag was not given."""
    return site if site is not None else Path(tempfile.mkdtemp(prefix="pdserve-site-"))


def unpack_wheels(wheels: Path, site: Path, pattern: str = "*.whl") -> list[str]:
    """Unzip each wheel (or pruned zip) matching `pattern` in `wheels` into `site`."""
    site.mkdir(parents=True, exist_ok=True)
    names = []
    for wheel in sorted(wheels.glob(pattern)):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        names.append(wheel.name)
    for so in site.rglob("*.so*"):
        so.chmod(0o755)  # zipfile drops the mode bits
    return names


def use_site(site: Path | None, env: Mapping[str, str] | None = None) -> None:
    """The site (if any) first on the import path here; the site and the checkout first on the
    children's PYTHONPATH (this process runs from the checkout: `python -m scripts...`)."""
    os.environ.update(env or {})
    paths = [str(site)] if site is not None else []
    paths += [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    if site is not None and str(site) not in sys.path:
        sys.path.insert(0, str(site))


def console_wrappers(bin_dir: Path) -> dict[str, str]:
    """The node servers' console scripts for this interpreter, as small shell wrappers."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    found = {}
    for name, module in SERVER_MODULES.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
        path.chmod(0o755)
        found[name] = str(path)
    return found


def gpu_defaults() -> None:
    """GPU_DEFAULTS into this process's environment (children inherit it), unless already set."""
    for key, value in GPU_DEFAULTS.items():
        os.environ.setdefault(key, value)
