"""The paged KV store and the request-to-token table.

Layout: one tensor `[num_pages, num_kv_heads, num_layers, 2, page_size, head_dim]`. A page holds
K and V of all layers for `page_size` consecutive tokens, so a run of contiguous pages is one
contiguous byte range: a KV transfer needs one descriptor per page run, not one per layer. Inside
a page the KV heads are outermost, so any slice of the heads of one page is contiguous too: a
prefill rank that owns KV heads {0, 1} writes them into the right head offset of a decode rank
that owns {0, 1, 2} with one descriptor per page, never one per token (with tokens outside the
heads, a head slice would be strided per layer and token). With tensor parallelism each rank's
buffer holds only its own KV heads; page ids are the same on every rank.

A token location (`loc`) is `page * page_size + offset`; `req_to_token[slot, i]` is the location of
token i of the request in `slot`.

Staging pages (engine/memory/staging.py): with `staging_pages > 0` the same allocation holds that
many more pages after the pool's `num_pages`, page ids `num_pages ..`. No allocator hands them
out and no attention kernel reads them (`buffer` is the pool alone); they are registered with the
transfer engine together with the pool (`storage`), so a KV write addresses them by page id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def head_page_bytes(self) -> int:
        """Bytes of one KV head's part of a page (all layers, K and V)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.head_dim * elem

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one layer's K and V of one KV head's part of a page: layers [a, b) of a
        head are the `(b - a) * layer_page_bytes` bytes at `a * layer_page_bytes` into it."""
        return self.head_page_bytes // self.num_layers

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over this buffer's KV heads."""
        return self.head_page_bytes * self.num_kv_heads


class PagedKVCache:
    def __init__(
        self, layout: KVLayout, num_pages: int, device: torch.device, staging_pages: int = 0
    ) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.staging_pages = staging_pages
        self.storage = torch.zeros(  # pool pages, then staging pages: one registered region
            num_pages + staging_pages,
            layout.num_kv_heads,
            layout.num_layers,
            2,
            layout.page_size,
            layout.head_dim,
            dtype=layout.dtype,
            device=device,
        )
        self.buffer = self.storage[:num_pages]  # the pool: what attention reads and writes
        self.staging = self.storage[num_pages:]  # [staging_pages, ...], page id num_pages + i

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def k_view(self, layer: int) -> torch.Tensor:
        """[num_pages, page_size, kv_heads, head_dim], a strided view into the buffer."""
        return self.buffer[:, :, layer, 0].transpose(1, 2)

    def v_view(self, layer: int) -> torch.Tensor:
        return self.buffer[:, :, layer, 1].transpose(1, 2)

    def split(self, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Locations -> (pages, offsets): computed once per batch, used by every layer."""
        return locs // self.page_size, locs % self.page_size

    def write(
        self, layer: int, where: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store the new tokens' K and V at `where` (from `split`)."""
        self.k_view(layer)[where] = k.to(self.layout.dtype)
        self.v_view(layer)[where] = v.to(self.layout.dtype)

    def gather(self, layer: int, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a request's context: `locs` [..., T] are the KV locations of positions
        0..T-1 (a row of `req_to_token`) -> [..., T, kv_heads, head_dim] each.

        Copies whole pages, not single tokens: position i sits at offset i % page_size of the
        page of position i - i % page_size, so the first location of each page run names it.
        """
        ps = self.page_size
        length = locs.shape[-1]
        pages = (locs[..., ::ps] // ps).reshape(-1)
        lead = locs.shape[:-1]
        shape = (*lead, -1, self.layout.num_kv_heads, self.layout.head_dim)
        k = self.k_view(layer).index_select(0, pages).reshape(shape)[..., :length, :, :]
        v = self.v_view(layer).index_select(0, pages).reshape(shape)[..., :length, :, :]
        return k, v


class ReqToTokenPool:
    """Fixed table of request slots; each row maps token index -> KV location."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device) -> None:
        self.table = torch.zeros(max_requests, max_context, dtype=torch.int64, device=device)
        self.max_context = max_context
        self._free_slots = list(range(max_requests - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def alloc_slot(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

    def free_slot(self, slot: int) -> None:
        if slot in self._free_slots:
            raise AssertionError(f"request slot {slot} freed twice")
        self._free_slots.append(slot)
