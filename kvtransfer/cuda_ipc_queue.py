"""The GPU side of a `cuda_ipc` write: per GPU, a copy queue (kvtransfer/cuda_ipc.py plans,
this queues).

A write's host time is what is left once its kernel copies at the copy's speed, so the queue
spends little: the row table is planned (by the caller, numpy) straight into a pinned buffer
taken from a few reused slots (`RowTables`), the engine's stream waits for the caller's (the
work that wrote the pages) through one reused event, the table is uploaded by one
asynchronous driver copy on that stream, and the kernel launches there through its compiled
form (`CopyLauncher`, no stream switch). The event recorded after the kernel completes the
write and frees the slot.

Ordering: a slot is taken only once the event after its last kernel has passed, so its host
buffer (read by the upload) and its device buffer (read by the kernel) never change under a
write in flight; the wait, the upload and the kernel are in this order on one stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtransfer.cuda_batch_copy import BatchCopier, PageDescriptors
from kvtransfer.cuda_ipc_kernel import MAX_GRID_ROWS, WORD_DTYPES, CopyLauncher
from kvtransfer.cuda_ipc_plan import CopyPlan

ROW_BYTES = 3 * 8  # one row of the kernel's table: three int64


@dataclass
class TableSlot:
    """A pinned host buffer and a device buffer for one kernel's row table, and the event
    after the last kernel that read it (its upload ran before that kernel)."""

    host: torch.Tensor  # pinned int64 [CAPACITY, 3]
    host_rows: np.ndarray  # the same memory, for numpy to plan into
    device: torch.Tensor  # int64 [CAPACITY, 3] on the GPU
    done: Any = None  # torch.cuda.Event

    def free(self) -> bool:
        return self.done is None or bool(self.done.query())


class RowTables:
    """Row tables to the GPU without allocating: `SLOTS` pairs of pinned host and device
    buffers, taken in turn. A slot is reused only once the event after its last kernel has
    passed, so neither the host buffer (read by the upload) nor the device one (read by the
    kernel) can change under a write in flight; with every slot busy, or a table over
    `CAPACITY` rows, a write takes fresh buffers (the handle keeps them until done)."""

    SLOTS = 4
    CAPACITY = 4096  # rows: a write of up to 4,096 ranges (8 GiB of 2 MiB pages)

    def __init__(self, device: torch.device) -> None:
        self.slots: list[TableSlot] = []
        for _ in range(self.SLOTS):
            host = torch.empty((self.CAPACITY, 3), dtype=torch.int64).pin_memory()
            device_rows = torch.empty((self.CAPACITY, 3), dtype=torch.int64, device=device)
            self.slots.append(TableSlot(host, host.numpy(), device_rows))
        self._next = 0

    def take(self) -> TableSlot | None:
        """A free slot (round robin), or None."""
        count = len(self.slots)
        for i in range(count):
            slot = self.slots[(self._next + i) % count]
            if slot.free():
                self._next = (self._next + i + 1) % count
                return slot
        return None


class CopyQueue:
    """One GPU's copies: the engine's stream there, its row tables, the event that orders
    the stream after the caller's, the kernel launcher and the driver (for the upload).
    Calls run with this GPU current."""

    def __init__(self, device: int, launcher: CopyLauncher, driver: Any) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.tables = RowTables(torch.device("cuda", device))
        self.ready = torch.cuda.Event()  # reused: a wait holds the record made before it
        self.launcher = launcher
        self.driver = driver  # kvtransfer/cuda_driver.py's CudaDriver

    def submit(
        self, plan: CopyPlan, src: int, dst: int, slot: TableSlot | None, keep: list[Any]
    ) -> Any:
        """Queue the plan's copy from `src` to `dst` (addresses of chunk 0); the event after
        its kernel. `slot`: the slot its rows were planned into; `keep` receives what must
        live until that event (fresh buffers when there was no slot)."""
        self.after_caller()  # first: its runtime calls make the device's context current
        table = self.upload(plan, slot, keep)
        return self.kernel(plan, (src, dst, table), slot)

    def upload(self, plan: CopyPlan, slot: TableSlot | None, keep: list[Any]) -> int:
        """The plan's rows copied to the device on the engine's stream (one asynchronous
        copy through the driver: torch's copy costs several times its host time); their
        device address. The driver copies in the thread's current context: the runtime
        calls of `after_caller` (or torch's device guard) have made it the device's."""
        n = plan.num_rows
        if slot is not None and n <= len(slot.host_rows):  # the plan went into the slot
            host, device = slot.host, slot.device
        else:  # no free slot, or a table too big: fresh buffers, kept until done
            host = torch.from_numpy(np.ascontiguousarray(plan.rows)).pin_memory()
            device = torch.empty_like(host, device=torch.device("cuda", self.device))
            keep += [host, device]
        address = device.data_ptr()
        self.driver.copy_to_device(address, host.data_ptr(), n * ROW_BYTES, self.stream.cuda_stream)
        return address

    def submit_batch(self, copier: BatchCopier, desc: PageDescriptors, overlap: bool) -> Any:
        """Queue a write's descriptors as one batched driver copy after the caller's stream;
        the event after it (no table, no kernel: kvtransfer/cuda_batch_copy.py)."""
        self.after_caller()  # its runtime calls make the device's context current
        copier.copy(desc, self.stream.cuda_stream, overlap)
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    def after_caller(self) -> None:
        """The engine's stream waits for the caller's (the work that wrote the pages)."""
        self.ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(self.ready)

    def kernel(self, plan: CopyPlan, addrs: tuple[int, int, int], slot: TableSlot | None) -> Any:
        """The copy on the engine's stream (a launch per `MAX_GRID_ROWS` rows), then the
        event that completes the write and frees the table's slot."""
        src, dst, table = addrs
        word = WORD_DTYPES[plan.word_bytes]
        stream, n = self.stream.cuda_stream, plan.num_rows
        for first in range(0, n, MAX_GRID_ROWS):
            grid = (plan.max_chunks, min(MAX_GRID_ROWS, n - first))
            part = (src, dst, table + first * ROW_BYTES)
            self.launcher.launch(stream, self.device, word, part, plan.chunk_words, grid)
        done = torch.cuda.Event()
        done.record(self.stream)
        if slot is not None:
            slot.done = done
        return done
