"""KV memory: page allocator, paged KV store, request-to-token table, radix prefix cache."""

from engine.memory.allocator import IntegrityError, OutOfPagesError, PageAllocator, PageState
from engine.memory.kv_cache import KVLayout, PagedKVCache, ReqToTokenPool
from engine.memory.radix_cache import PrefixMatch, RadixCache, RadixNode
from engine.memory.staging import PageStager, StagingArea, StagingSpan, count_runs

__all__ = [
    "IntegrityError",
    "KVLayout",
    "OutOfPagesError",
    "PageAllocator",
    "PageStager",
    "PageState",
    "PagedKVCache",
    "PrefixMatch",
    "RadixCache",
    "RadixNode",
    "ReqToTokenPool",
    "StagingArea",
    "StagingSpan",
    "count_runs",
]
