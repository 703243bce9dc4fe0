"""Triton kernels under the interpreter, in a child process, the same on any host.

`TRITON_INTERPRET=1` is read when a kernel is decorated, so each script runs in a child of its
own. Two things made these tests pass on the CPU machine and fail on a GPU host:
- the child saw the GPU: the interpreter tests mean CPU tensors, and a visible CUDA device only
  changes what a default picks. The child gets `CUDA_VISIBLE_DEVICES=""`.
- Triton 3.6 and earlier convert an interpreted scalar (a one-element array) to an index with
  `int(array)`, which numpy 2.4 refuses for arrays of one dimension ("only 0-dimensional arrays
  can be converted to Python scalars", triton-lang/triton#9171): every kernel whose loop bound
  is a tensor (`range(start, end, BLOCK)`) failed. `mend_index` gives the interpreter's tensors
  the `__index__` that later Triton has (`int(data.squeeze())`); the child applies it before
  any kernel runs. On a Triton that has it already, it changes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# The first lines of every interpreted script.
PRELUDE = "import tests.triton_interpreter; tests.triton_interpreter.mend_index()\n"


def mend_index() -> None:
    """Make an interpreted scalar usable as an index under numpy >= 2.4 (see the docstring)."""
    from triton.runtime import interpreter  # type: ignore[import-untyped]

    patch_tensor = interpreter._patch_lang_tensor

    def patch_then_mend(tensor: Any, *rest: Any) -> None:
        patch_tensor(tensor, *rest)
        # set after the interpreter's own patch; its scope restores the class on exit
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())

    interpreter._patch_lang_tensor = patch_then_mend


def interpreter_env() -> dict[str, str]:
    """The environment of an interpreted child: no GPU, this checkout first on the path."""
    return {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(REPO),
    }


def interpret(script: str, *args: str, timeout: float = 300) -> str:
    """Run `script` (indented as in a test module) under the interpreter; its stdout."""
    return run_child(["-c", PRELUDE + textwrap.dedent(script), *args], timeout)


def run_child(argv: list[str], timeout: float) -> str:
    done = subprocess.run(
        [sys.executable, *argv],
        env=interpreter_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout
