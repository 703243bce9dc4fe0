"""Moves a request's KV pages between the allocator, the radix cache and the request.

All page ownership changes of requests happen here, so the accounting in `memory/` has a single
caller to audit: `reserve` before a forward, `release` when a request finishes, is aborted or is
retracted.

Single-entry table writes (a decode step's one new token per request) are queued and written by
`flush_table` in one indexed store: one by one they cost a kernel launch each, ~1 ms of host time
per step at batch 64 on a GPU. The model runner flushes before it builds a batch from the table.
"""

from __future__ import annotations

import torch

from engine.memory import OutOfPagesError, PageAllocator, RadixCache, ReqToTokenPool
from engine.request import Req


class KVManager:
    def __init__(
        self,
        allocator: PageAllocator,
        req_to_token: ReqToTokenPool,
        page_size: int,
        radix: RadixCache | None,
    ) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.page_size = page_size
        self.radix = radix
        self._pending: dict[tuple[int, int], int] = {}  # (slot, position) -> location, unwritten

    @property
    def available_pages(self) -> int:
        """Pages a reservation could get: free now plus what eviction could free."""
        evictable = self.radix.evictable_pages if self.radix else 0
        return self.allocator.num_free + evictable

    def pages_for(self, req: Req, new_tokens: int) -> int:
        needed = -(-(req.kv_len + new_tokens) // self.page_size)
        return max(0, needed - len(req.pages))

    def attach_prefix(self, req: Req) -> None:
        """On admission: reuse the longest cached prefix.

        Never the whole sequence: the last token must run through the model to give logits.
        Nothing for a request that wants prompt logprobs: its every position must run.
        """
        if self.radix is None or req.kv_len or req.params.prompt_logprobs is not None:
            return
        match = self.radix.match_prefix(req.all_ids[:-1])
        if not match.pages:
            return
        self.radix.lock(match.node)
        req.prefix_node = match.node
        req.pages = list(match.pages)
        req.num_prefix_pages = len(match.pages)
        req.kv_len = len(match.pages) * self.page_size
        self._write_table(req, 0, req.kv_len)

    def reserve(self, req: Req, new_tokens: int) -> bool:
        """Room for `new_tokens` more KV entries; False (and nothing changed) if memory is short."""
        need = self.pages_for(req, new_tokens)
        if need > self.allocator.num_free and self.radix is not None:
            self.radix.evict(need - self.allocator.num_free)
        try:
            req.pages.extend(self.allocator.allocate(need))
        except OutOfPagesError:
            return False
        self._write_table(req, req.kv_len, req.kv_len + new_tokens)
        return True

    def reserve_decodes(self, reqs: list[Req]) -> bool:
        """One more KV entry for each of `reqs` (a decode step's), all or nothing: False (and
        nothing changed) if memory is short. One allocation for the step, not one per request."""
        ps = self.page_size
        needy = [r for r in reqs if r.kv_len >= len(r.pages) * ps]  # the last page is full
        short = len(needy) - self.allocator.num_free
        if short > 0 and self.radix is not None:
            self.radix.evict(short)
        if len(needy) > self.allocator.num_free:
            return False
        for req, page in zip(needy, self.allocator.allocate(len(needy)), strict=True):
            req.pages.append(page)
        for req in reqs:
            assert req.slot is not None
            start = req.kv_len
            self._pending[(req.slot, start)] = req.pages[start // ps] * ps + start % ps
        return True

    def decode_locations(self, reqs: list[Req], take: bool) -> list[int]:
        """The KV location of each request's next token (reserved already). `take`: the
        caller writes their table entries itself (a step-prep CUDA graph, engine/step_prep.py),
        so they leave the queue that `flush_table` writes."""
        ps = self.page_size
        locs = []
        for req in reqs:
            position = req.kv_len
            if take:
                self._pending.pop((req.slot, position), None)  # type: ignore[arg-type]
            locs.append(req.pages[position // ps] * ps + position % ps)
        return locs

    def _write_table(self, req: Req, start: int, end: int) -> None:
        assert req.slot is not None
        if end <= start:
            return
        ps = self.page_size
        if end - start == 1:  # a decode step: queued for the step's one store (flush_table)
            self._pending[(req.slot, start)] = req.pages[start // ps] * ps + start % ps
            return
        table = self.req_to_token.table
        pos = torch.arange(start, end, device=table.device)
        pages = torch.tensor(req.pages, dtype=torch.int64).to(table.device, non_blocking=True)
        table[req.slot, start:end] = pages[pos // ps] * ps + pos % ps

    def flush_table(self) -> None:
        """Write the queued single entries into the table, all in one indexed store."""
        if not self._pending:
            return
        table = self.req_to_token.table
        slots, positions = zip(*self._pending, strict=True)
        packed = torch.tensor([slots, positions, list(self._pending.values())], dtype=torch.int64)
        packed = packed.to(table.device, non_blocking=True)  # a blocking copy waits for the GPU
        table[packed[0], packed[1]] = packed[2]
        self._pending.clear()

    def release(self, req: Req, cache: bool) -> None:
        """Give back every page of `req`; with `cache`, full pages join the radix cache."""
        if req.slot is not None and self._pending:  # a retracted request's queued entries
            self._pending = {key: loc for key, loc in self._pending.items() if key[0] != req.slot}
        own_from = req.num_prefix_pages
        if cache and self.radix is not None:
            full = req.kv_len // self.page_size
            tokens = req.all_ids[: full * self.page_size]
            self.radix.insert(tokens, req.pages[:full], owned_from=own_from)
            self.allocator.free(req.pages[full:])
        else:
            self.allocator.free(req.pages[own_from:])
        if req.prefix_node is not None and self.radix is not None:
            self.radix.unlock(req.prefix_node)
        req.pages, req.num_prefix_pages, req.prefix_node, req.kv_len = [], 0, None, 0
        if req.slot is not None:
            self.req_to_token.free_slot(req.slot)
            req.slot = None
