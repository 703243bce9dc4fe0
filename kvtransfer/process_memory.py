"""Writes into another process's CPU memory on this host: `process_vm_writev` (Linux).

The `cuda_ipc` backend moves the KV pool with the GPU, but the nodes' aux slots (the first
token, kvtransfer/aux.py) are numpy arrays in CPU memory; one slot is ~200 bytes, so one system
call per write copies them, as UCX's cma transport does for NIXL between two local processes.
The kernel allows it between processes of one user when Yama's `ptrace_scope` is 0, or 1 and the
target has named its writers (`allow_peer_writes`: the receiving process calls it, as the
prefill and decode nodes are siblings, not ancestors); `ptrace_scope` 2 or 3 forbids it. A
refused write names the errno.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Sequence

MAX_IOVECS = 1024  # IOV_MAX on Linux


class IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class ProcessMemoryError(OSError):
    """A write into another process failed (gone, not permitted, or a bad address)."""


def _libc_writev() -> object:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_writev
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong,
                   ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
    return fn


_writev = _libc_writev()
PR_SET_PTRACER = 0x59616D61  # linux/prctl.h (Yama)
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1)


def allow_peer_writes() -> bool:
    """Let other processes of this user write into this one under Yama `ptrace_scope` 1
    (`prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`); False where Yama is absent or refuses."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)) == 0


def write_process_memory(pid: int, ranges: Sequence[tuple[int, int, int]]) -> None:
    """Copy (local address, remote address, length) ranges into process `pid`, completely."""
    if _writev is None:
        raise ProcessMemoryError("process_vm_writev needs Linux")
    for start in range(0, len(ranges), MAX_IOVECS):
        chunk = ranges[start : start + MAX_IOVECS]
        local = (IoVec * len(chunk))(*(IoVec(src, n) for src, _, n in chunk))
        remote = (IoVec * len(chunk))(*(IoVec(dst, n) for _, dst, n in chunk))
        want = sum(n for _, _, n in chunk)
        done = _writev(pid, local, len(chunk), remote, len(chunk), 0)  # type: ignore[operator]
        if done != want:
            err = ctypes.get_errno() if done < 0 else 0
            why = os.strerror(err) if err else f"{done} of {want} bytes written"
            if err == errno.EPERM:
                why += " (Yama ptrace_scope above 1? see /proc/sys/kernel/yama/ptrace_scope)"
            raise ProcessMemoryError(err, f"process_vm_writev into pid {pid}: {why}")
