"""Context parallel rows: one row's positions split over the `cp` procs of a TorchTitan mesh.

TorchTitan's CP (`context_parallel_degree`, applied by the family's parallelize function)
turns each layer's SDPA into ring attention over the `cp` mesh; the caller shards the
inputs along the sequence. meshrl shards with TorchTitan's `cp_shard` and its head-tail
load balancer (each proc gets an early and a late stretch of the row, so the causal work is
even), after moving each scored token's target to the position that predicts it: every proc
then scores the tokens its own positions predict, with no neighbour's hidden state needed.

The per-token log-probs (small: one float per position) are gathered back into the batch's
layout on every proc, so the loss, its global denominators and every metric are computed as
without CP. Every proc of a CP group computes the same loss from the same gathered tensor,
so the gather's backward hands each proc the gradient of its own positions only; FSDP then
sums the procs' parameter gradients (meshrl turns its averaging off), which adds the
positions' contributions up to the whole row's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _GatherPositions(torch.autograd.Function):
    """[B, n] per proc -> [B, cp x n] on every proc, in mesh order; backward: the own slice."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, rank: int, world: int) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.span = (rank * local.shape[1], (rank + 1) * local.shape[1])
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, end = ctx.span
        return grad[:, start:end], None, None, None


class CPRows:
    """One micro-batch's rows sharded over the `cp` mesh (on construction: this proc's
    tokens, positions, targets and scored flags), and its per-position results put back in
    the batch's layout (`gather`)."""

    def __init__(self, cp_mesh, tokens: torch.Tensor, score_mask: torch.Tensor):
        from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer
        from torchtitan.distributed.context_parallel import cp_shard

        self.mesh, self.T = cp_mesh, tokens.shape[1]
        cp = cp_mesh.size()
        padded = self.T + (-self.T % (2 * cp))  # head-tail balancing cuts the row into 2 x cp equal stretches
        pad = padded - self.T
        B = tokens.shape[0]
        # position t predicts token t + 1: its target and whether that token is scored move to t
        targets = F.pad(tokens[:, 1:], (0, pad + 1))
        scored = F.pad(score_mask[:, 1:], (0, pad + 1))
        # the padding's positions repeat the last one: RoPE's table holds model.max_seq_len, which padded may pass
        # (nothing real attends to padding: the ring's causality is by index)
        positions = torch.arange(padded, device=tokens.device).clamp(max=max(self.T - 1, 0)).expand(B, padded).contiguous()
        (self.tokens, self.positions, self.targets, self.scored), _ = cp_shard(cp_mesh, (F.pad(tokens, (0, pad)), positions, targets, scored), None, "headtail")
        self.restore = _HeadTailLoadBalancer(padded, cp, tokens.device)._generate_indices(restore=True)[0].to(tokens.device)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[B, padded / cp] values at this proc's positions -> [B, T] at the predicted tokens'
        positions (0 at position 0), differentiable."""
        mesh = self.mesh
        whole = _GatherPositions.apply(local, mesh.get_group(), mesh.get_local_rank(), mesh.size())
        by_position = whole.index_select(1, self.restore)
        return F.pad(by_position[:, : self.T - 1], (1, 0))

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """A count summed over the CP group (no gradient)."""
        value = value.detach().clone()
        dist.all_reduce(value, group=self.mesh.get_group())
        return value
