"""Reference attention in plain PyTorch (CPU and GPU).

Single-token requests (decodes) run together as one padded batch; multi-token extends run one
request at a time with a causal mask offset by the cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch


@dataclass
class _PaddedDecode:
    rows: torch.Tensor  # [Bd] token rows of the single-token requests
    locs: torch.Tensor  # [Bd, T] KV locations, padded with the scratch location 0
    mask: torch.Tensor  # [Bd, 1, 1, T] True where a key is real


@dataclass
class _Extend:
    start: int  # first token row
    length: int
    locs: torch.Tensor  # [seq_len] KV locations of the whole context
    mask: torch.Tensor | None  # [length, seq_len] causal mask with prefix; None when no prefix


@dataclass
class TorchNativeMetadata:
    decode: _PaddedDecode | None
    extends: list[_Extend]


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def init_metadata(self, batch: ForwardBatch) -> None:
        table = self.req_to_token.table
        device = table.device
        decode_reqs, extends, row = [], [], 0
        for i, (slot, seq, ext) in enumerate(
            zip(batch.req_slots, batch.seq_lens, batch.extend_lens, strict=True)
        ):
            if ext == 1:
                decode_reqs.append(i)
            else:
                prefix = seq - ext
                mask = None
                if prefix:
                    q_pos = torch.arange(prefix, seq, device=device).unsqueeze(1)
                    mask = torch.arange(seq, device=device).unsqueeze(0) <= q_pos
                extends.append(_Extend(row, ext, table[slot, :seq], mask))
            row += ext
        batch.attn_metadata = TorchNativeMetadata(self._padded(batch, decode_reqs), extends)

    def _padded(self, batch: ForwardBatch, reqs: list[int]) -> _PaddedDecode | None:
        if not reqs:
            return None
        table = self.req_to_token.table
        starts = torch.tensor(batch.extend_lens).cumsum(0) - torch.tensor(batch.extend_lens)
        lens = torch.tensor([batch.seq_lens[i] for i in reqs], device=table.device)
        width = int(lens.max())
        slots = torch.tensor([batch.req_slots[i] for i in reqs], device=table.device)
        mask = torch.arange(width, device=table.device).unsqueeze(0) < lens.unsqueeze(1)
        locs = torch.where(mask, table[slots, :width], 0)
        rows = starts[reqs].to(table.device)
        return _PaddedDecode(rows, locs, mask[:, None, None, :])

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.kv_cache.write(layer, batch.out_cache_loc, k, v)
        md: TorchNativeMetadata = batch.attn_metadata
        out = torch.empty_like(q)
        if md.decode is not None:
            keys, values = self.kv_cache.gather(layer, md.decode.locs)
            qd = q[md.decode.rows].unsqueeze(2)  # [Bd, Hq, 1, D]
            o = F.scaled_dot_product_attention(
                qd,
                keys.transpose(1, 2).to(q.dtype),
                values.transpose(1, 2).to(q.dtype),
                attn_mask=md.decode.mask,
                enable_gqa=True,
            )
            out[md.decode.rows] = o.squeeze(2)
        for ext in md.extends:
            keys, values = self.kv_cache.gather(layer, ext.locs)
            qe = q[ext.start : ext.start + ext.length].transpose(0, 1)  # [Hq, L, D]
            o = F.scaled_dot_product_attention(
                qe,
                keys.transpose(0, 1).to(q.dtype),
                values.transpose(0, 1).to(q.dtype),
                attn_mask=ext.mask,
                is_causal=ext.mask is None,
                enable_gqa=True,
            )
            out[ext.start : ext.start + ext.length] = o.transpose(0, 1)
        return out
