"""Reference attention in plain PyTorch (CPU and GPU).

Single-token requests (decodes) run together as one padded batch (no mask when every context
has the same length); multi-token extends run one request at a time with a causal mask offset by
the cached prefix. Extends without a cached prefix attend over their own new K/V directly
instead of reading them back from the cache, consecutive ones of equal length as one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch


@dataclass
class _PaddedDecode:
    rows: torch.Tensor | None  # [Bd] token rows of the single-token requests; None: all rows
    locs: torch.Tensor  # [Bd, T] KV locations, padded with the scratch location 0
    mask: torch.Tensor | None  # [Bd, 1, 1, T] True where a key is real; None: no padding


@dataclass
class _Extend:
    """One request extending a cached prefix: attends over its whole context from the cache."""

    start: int  # first token row
    length: int
    locs: torch.Tensor  # [seq_len] KV locations of the whole context
    mask: torch.Tensor  # [length, seq_len] causal mask offset by the prefix


@dataclass
class _FreshRun:
    """`count` consecutive requests with no cached prefix and the same length: their new K/V
    are their whole context, so they attend over them directly, as one causal batch."""

    start: int  # first token row
    length: int
    count: int = 1

    @property
    def end(self) -> int:
        return self.start + self.count * self.length


@dataclass
class TorchNativeMetadata:
    write_at: tuple[torch.Tensor, torch.Tensor]  # (pages, offsets) of the new tokens
    decode: _PaddedDecode | None
    extends: list[_Extend]
    fresh: list[_FreshRun]


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def init_metadata(self, batch: ForwardBatch) -> None:
        table = self.req_to_token.table
        device = table.device
        decode_reqs: list[int] = []
        extends: list[_Extend] = []
        fresh: list[_FreshRun] = []
        row = 0
        for i, (slot, seq, ext) in enumerate(
            zip(batch.req_slots, batch.seq_lens, batch.extend_lens, strict=True)
        ):
            prefix = seq - ext
            if ext == 1:
                decode_reqs.append(i)
            elif prefix:
                q_pos = torch.arange(prefix, seq, device=device).unsqueeze(1)
                mask = torch.arange(seq, device=device).unsqueeze(0) <= q_pos
                extends.append(_Extend(row, ext, table[slot, :seq], mask))
            elif fresh and fresh[-1].end == row and fresh[-1].length == ext:
                fresh[-1].count += 1
            else:
                fresh.append(_FreshRun(row, ext))
            row += ext
        batch.attn_metadata = TorchNativeMetadata(
            self.kv_cache.split(batch.out_cache_loc),
            self._padded(batch, decode_reqs),
            extends,
            fresh,
        )

    def _padded(self, batch: ForwardBatch, reqs: list[int]) -> _PaddedDecode | None:
        if not reqs:
            return None
        table = self.req_to_token.table
        seq_lens = [batch.seq_lens[i] for i in reqs]
        width = max(seq_lens)
        slots = torch.tensor([batch.req_slots[i] for i in reqs], device=table.device)
        rows = None
        if len(reqs) < batch.batch_size:
            starts = torch.tensor(batch.extend_lens).cumsum(0) - torch.tensor(batch.extend_lens)
            rows = starts[reqs].to(table.device)
        if min(seq_lens) == width:
            return _PaddedDecode(rows, table[slots, :width], None)
        lens = torch.tensor(seq_lens, device=table.device)
        mask = torch.arange(width, device=table.device).unsqueeze(0) < lens.unsqueeze(1)
        locs = torch.where(mask, table[slots, :width], 0)
        return _PaddedDecode(rows, locs, mask[:, None, None, :])

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        md: TorchNativeMetadata = batch.attn_metadata
        self.kv_cache.write(layer, md.write_at, k, v)
        decode = md.decode
        if decode is not None and decode.rows is None:  # every request decodes one token
            return self._decode(q, layer, decode)
        out = torch.empty_like(q)
        if decode is not None:
            out[decode.rows] = self._decode(q[decode.rows], layer, decode)
        for ext in md.extends:
            rows = slice(ext.start, ext.start + ext.length)
            keys, values = self.kv_cache.gather(layer, ext.locs)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),  # [Hq, L, D]
                keys.transpose(0, 1).to(q.dtype),
                values.transpose(0, 1).to(q.dtype),
                attn_mask=ext.mask,
                enable_gqa=True,
            )
            out[rows] = o.transpose(0, 1)
        for run in md.fresh:
            rows = slice(run.start, run.end)
            per_req = (run.count, run.length, -1, q.shape[-1])  # [n, L, H, D] -> [n, H, L, D]
            o = F.scaled_dot_product_attention(
                q[rows].view(per_req).transpose(1, 2),
                k[rows].view(per_req).transpose(1, 2),
                v[rows].view(per_req).transpose(1, 2),
                is_causal=True,
                enable_gqa=True,
            )
            out[rows] = o.transpose(1, 2).reshape(-1, *q.shape[1:])
        return out

    def _decode(self, q: torch.Tensor, layer: int, decode: _PaddedDecode) -> torch.Tensor:
        """q: [Bd, Hq, D] of the single-token requests -> [Bd, Hq, D]."""
        keys, values = self.kv_cache.gather(layer, decode.locs)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [Bd, Hq, 1, D]
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=decode.mask,
            enable_gqa=True,
        )
        return o.squeeze(2)
