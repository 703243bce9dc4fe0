"""The few CUDA driver calls the `cuda_ipc` backend needs, through ctypes on libcuda.so.1.

torch exports IPC handles only of its own storages (`_share_cuda_`), but a transfer engine is
given addresses (`MemoryRegion`), as NIXL and Mooncake are. So the receiver asks the driver for
the allocation holding its pool (`cuMemGetAddressRange`) and that allocation's handle
(`cuIpcGetMemHandle`); the sender maps it (`cuIpcOpenMemHandle` with lazy peer access: the
mapping also works from another GPU of the host where peer access exists) into the context of
the GPU that runs the copy kernel. Every call runs inside that device's primary context (the
one torch uses), pushed and popped around it, so the calling thread's state does not matter;
except the per-write upload of a copy's row table (`copy_to_device`), which runs in the
thread's current context (the copy queue's runtime calls just before have made it the
device's) to keep a write's host time small.

Memory from PyTorch's expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`)
is not a cudaMalloc allocation and has no IPC handle; the error says so.

The batched copy (`cuMemcpyBatchAsync`, CUDA 12.8+) is optional: `batch_copier` is bound
where the driver has it (kvtransfer/cuda_batch_copy.py), else None with the reason in
`batch_missing`.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

from kvtransfer.base import TransferError
from kvtransfer.cuda_batch_copy import BatchCopier, bind_batch_copy
from kvtransfer.cuda_ipc_plan import BACKEND_FLAG

IPC_HANDLE_BYTES = 64
LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
CUdeviceptr = ctypes.c_uint64
CUcontext = ctypes.c_void_p


class IpcMemHandle(ctypes.Structure):
    """CUipcMemHandle (64 opaque bytes), passed by value to cuIpcOpenMemHandle. Eight
    scalar words rather than a byte array: ctypes has mishandled arrays inside structures
    passed by value (bpo-22273); scalars side-step it."""

    _fields_ = [(f"word{i}", ctypes.c_uint64) for i in range(IPC_HANDLE_BYTES // 8)]


# name -> (exported symbols, newest first; argument types). The _v2 symbols are the ones
# cuda.h maps the plain names to (64-bit sizes); the plain ones are the fallback.
_SIGNATURES: dict[str, tuple[tuple[str, ...], list[type]]] = {
    "init": (("cuInit",), [ctypes.c_uint]),
    "driver_version": (("cuDriverGetVersion",), [ctypes.POINTER(ctypes.c_int)]),
    "device_get": (("cuDeviceGet",), [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
    "primary_retain": (("cuDevicePrimaryCtxRetain",), [ctypes.POINTER(CUcontext), ctypes.c_int]),
    "push": (("cuCtxPushCurrent_v2", "cuCtxPushCurrent"), [CUcontext]),
    "pop": (("cuCtxPopCurrent_v2", "cuCtxPopCurrent"), [ctypes.POINTER(CUcontext)]),
    "address_range": (
        ("cuMemGetAddressRange_v2", "cuMemGetAddressRange"),
        [ctypes.POINTER(CUdeviceptr), ctypes.POINTER(ctypes.c_size_t), CUdeviceptr],
    ),
    "ipc_get": (("cuIpcGetMemHandle",), [ctypes.POINTER(IpcMemHandle), CUdeviceptr]),
    "ipc_open": (
        ("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"),
        [ctypes.POINTER(CUdeviceptr), IpcMemHandle, ctypes.c_uint],
    ),
    "ipc_close": (("cuIpcCloseMemHandle",), [CUdeviceptr]),
    "htod_async": (
        ("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"),
        [CUdeviceptr, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
    ),
    "error_string": (
        ("cuGetErrorString",),
        [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    ),
}


class CudaDriver:
    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise TransferError(
                f"{BACKEND_FLAG} needs the NVIDIA driver (libcuda.so.1 could not be loaded: "
                f"{exc}); on a host without GPUs use --transfer-backend nixl or mooncake"
            ) from exc
        self._fn = {name: self._bind(lib, symbols, args) for name, (symbols, args)
                    in _SIGNATURES.items()}  # fmt: skip
        self._check(self._fn["init"](0), "cuInit")
        self._contexts: dict[int, CUcontext] = {}
        version = ctypes.c_int()
        self._check(self._fn["driver_version"](ctypes.byref(version)), "cuDriverGetVersion")
        self.version = version.value  # 12080 for CUDA 12.8
        self.batch_copier: BatchCopier | None
        self.batch_copier, self.batch_missing = bind_batch_copy(lib, self.version, self._describe)

    @staticmethod
    def _bind(lib: ctypes.CDLL, symbols: tuple[str, ...], args: list[type]) -> Any:
        for symbol in symbols:
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.argtypes = args
                fn.restype = ctypes.c_int
                return fn
        raise TransferError(f"{BACKEND_FLAG}: libcuda.so.1 lacks {symbols[0]} (driver too old?)")

    def _describe(self, rc: int) -> str:
        text = ctypes.c_char_p()
        if self._fn["error_string"](rc, ctypes.byref(text)) == 0 and text.value:
            return f"CUDA error {rc}, {text.value.decode()}"
        return f"CUDA error {rc}"

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise TransferError(f"{BACKEND_FLAG}: {what} failed ({self._describe(rc)})")

    @contextlib.contextmanager
    def context(self, device: int) -> Iterator[None]:
        """`device`'s primary context current on this thread inside the block."""
        ctx = self._contexts.get(device)
        if ctx is None:
            dev = ctypes.c_int()
            self._check(self._fn["device_get"](ctypes.byref(dev), device), f"cuDeviceGet({device})")
            ctx = CUcontext()
            self._check(self._fn["primary_retain"](ctypes.byref(ctx), dev), "primary context")
            self._contexts[device] = ctx
        self._check(self._fn["push"](ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._check(self._fn["pop"](ctypes.byref(CUcontext())), "cuCtxPopCurrent")

    def export(self, addr: int, device: int) -> tuple[bytes, int]:
        """(IPC handle of the allocation holding `addr`, offset of `addr` inside it)."""
        base, size = CUdeviceptr(), ctypes.c_size_t()
        handle = IpcMemHandle()
        with self.context(device):
            self._check(
                self._fn["address_range"](ctypes.byref(base), ctypes.byref(size), addr),
                f"cuMemGetAddressRange({addr:#x})",
            )
            rc = self._fn["ipc_get"](ctypes.byref(handle), base)
        if rc != 0:
            raise TransferError(
                f"{BACKEND_FLAG}: no CUDA IPC handle for the allocation at {base.value:#x} on "
                f"cuda:{device} ({self._describe(rc)}); the pool must be cudaMalloc memory: "
                "unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF"
            )
        return bytes(handle), addr - base.value

    def open(self, handle: bytes, device: int) -> int:
        """Map a peer's allocation into `device`'s context; its address there."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise TransferError(f"{BACKEND_FLAG}: an IPC handle has 64 bytes, got {len(handle)}")
        ptr = CUdeviceptr()
        with self.context(device):
            self._check(
                self._fn["ipc_open"](
                    ctypes.byref(ptr),
                    IpcMemHandle.from_buffer_copy(handle),
                    LAZY_ENABLE_PEER_ACCESS,
                ),
                f"cuIpcOpenMemHandle on cuda:{device} (peer access between the two GPUs?)",
            )
        return int(ptr.value)

    def close(self, addr: int, device: int) -> None:
        with self.context(device):
            self._check(self._fn["ipc_close"](addr), "cuIpcCloseMemHandle")

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of `nbytes` from host memory `src` (pinned, for it to be
        asynchronous) to device memory `dst` on `stream` (a CUstream handle) of the current
        context (the one of the stream's device: torch's, made current by its calls)."""
        rc = self._fn["htod_async"](dst, src, nbytes, stream)
        if rc != 0:
            raise TransferError(
                f"{BACKEND_FLAG}: cuMemcpyHtoDAsync of {nbytes} bytes to {dst:#x} failed "
                f"({self._describe(rc)})"
            )
