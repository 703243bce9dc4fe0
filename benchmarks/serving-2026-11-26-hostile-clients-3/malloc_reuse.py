"""What glibc's defaults cost a burst of large-body copies (the figure in gateway/memory.py).

    python benchmarks/serving-2026-11-26-hostile-clients-3/malloc_reuse.py default|tuned

8 bodies x 16 pieces of 250 kB, each a fresh `bytes` copy (as uvloop and httptools make them),
freed, and `malloc_trim` every other burst (as the gateway hands memory back after a burst).
`tuned` sets what `gateway.memory.reuse_freed_memory` sets. Prints the best of 20 bursts and
the minor page faults per burst.
"""

import ctypes
import resource
import sys
import time

libc = ctypes.CDLL("libc.so.6")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
if sys.argv[1] == "tuned":
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)
piece = memoryview(b"x" * (256 << 10))


def burst() -> list[list[bytes]]:
    return [[bytes(piece[:250_000]) for _ in range(16)] for _ in range(8)]


best = float("inf")
faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for r in range(20):
    start = time.perf_counter()
    bodies = burst()
    del bodies
    if r % 2:
        libc.malloc_trim(0)
    best = min(best, time.perf_counter() - start)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before) / 20
print(
    f"{sys.argv[1]}: best burst (8 x 16 x 250 kB copies) {best * 1000:.1f} ms; "
    f"minor faults per burst {faults:.0f}"
)
