"""Expert parallelism's token flow through a MoE layer (`--ep-size`): tokens go to the ranks
that hold their experts and come back, by two all-to-alls over the node's tensor group.

Every rank enters the layer with every token (attention's output is all-reduced). Rank r:
1. takes its block of the tokens (`split_sizes` over the node's ranks, the first ranks taking
   one more; a rank may get none) and routes them: the router is replicated;
2. sends each (token, expert) pair's row to the rank of the expert's copy `token % copies`
   (engine/tp/expert_placement.py): the pairs sorted by physical slot, the count per slot sent
   first (an all-to-all of a few integers, read on the host), then the rows, by an uneven
   all_to_all_single (gloo has it on CPU, NCCL on GPU);
3. runs its slots over the rows it received, regrouped by slot: the grouped GEMMs of one rank
   (engine/models/expert_compute.py);
4. sends the outputs back by the reverse all-to-all, so they arrive in the order it sent the
   rows, and sums each token's top-k outputs weighted in fp32 in HF's order, as one rank does;
5. returns its tokens' rows in zeros of every token's shape: the decoder layer's all-reduce,
   which a TP MLP needs anyway (and which sums the shared experts' row-parallel partials),
   then puts every token's output on every rank, so no all-gather of the blocks is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.models.expert_compute import combine_pairs, expert_gemms
from engine.tp.expert_placement import ExpertSlots
from engine.tp.group import TPGroup
from engine.tp.partition import split_sizes

# The router: tokens [N, H] -> (weights [N, k] fp32, logical expert ids [N, k]).
Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class ExpertDispatch(nn.Module):
    """One rank's side of the module docstring's steps, over one layer's `placement`."""

    def __init__(self, placement: ExpertSlots, rank: int, group: TPGroup) -> None:
        super().__init__()
        self.rank = rank
        self.group = group
        self.num_ranks = placement.num_ranks
        self.slots_per_rank = placement.slots_per_rank
        copies = placement.copies()
        width = max(len(c) for c in copies)
        # copy_slots[e, c]: the physical slot of expert e's copy c (padded with its first).
        self.copy_slots: torch.Tensor
        self.num_copies: torch.Tensor
        padded = [list(c) + [c[0]] * (width - len(c)) for c in copies]
        self.register_buffer("copy_slots", torch.tensor(padded), persistent=False)
        self.register_buffer("num_copies", torch.tensor([len(c) for c in copies]), persistent=False)

    def forward(
        self, x: torch.Tensor, route: Router, w13: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' output of this rank's tokens, zero in the other rows."""
        blocks = split_sizes(x.shape[0], self.num_ranks)
        start = sum(blocks[: self.rank])
        mine = x[start : start + blocks[self.rank]]
        weights, ids = route(mine)
        top_k = ids.shape[1]
        slots = self.physical_slots(ids, start)
        order = slots.argsort(stable=True)  # by rank, then slot; in token order within one
        received, send, recv = self._exchange_counts(slots)
        rows = self.group.all_to_all_rows(mine[order // top_k], send, recv)
        # The rows from each rank come grouped by this rank's slot: regroup them by slot alone.
        slot_of_row = torch.arange(self.slots_per_rank).repeat(self.num_ranks)
        slot_of_row = slot_of_row.repeat_interleave(received.flatten())
        by_slot = slot_of_row.argsort(stable=True).to(x.device)
        out = torch.empty_like(rows)
        out[by_slot] = expert_gemms(rows[by_slot], received.sum(dim=0).tolist(), w13, w2)
        back = self.group.all_to_all_rows(out, recv, send)
        routed = x.new_zeros(x.shape)
        routed[start : start + mine.shape[0]] = combine_pairs(back, order, weights)
        return routed

    def physical_slots(self, ids: torch.Tensor, first_token: int) -> torch.Tensor:
        """The physical slot of each flattened (token, expert) pair: the expert's copy
        `token % copies`, the token counted in the whole batch."""
        flat = ids.flatten()
        token = torch.arange(ids.shape[0], device=ids.device) + first_token
        copy = token.repeat_interleave(ids.shape[1]) % self.num_copies[flat]
        return self.copy_slots[flat, copy]

    def _exchange_counts(self, slots: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """(rows this rank receives per [source rank, own slot], on the host; rows it sends to
        each rank; rows it receives from each rank): the layer's one host sync."""
        shape = (self.num_ranks, self.slots_per_rank)
        sent = torch.bincount(slots, minlength=shape[0] * shape[1])
        received = self.group.all_to_all_counts(sent)
        counts = torch.stack([sent, received]).view(2, *shape).cpu()
        return counts[1], counts[0].sum(dim=1).tolist(), counts[1].sum(dim=1).tolist()
