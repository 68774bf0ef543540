"""Causal attention over packed rows (meshrl/trainer/packing.py) with plain SDPA.

TorchTitan attends within packed documents with flex attention (no backward on CPU) or
varlen (flash attention, GPU only), and its SDPA module refuses attention masks. So meshrl's
models use `DocumentSDPA`: TorchTitan's SDPA, which, given TorchTitan's `VarlenMetadata` for
one packed row, runs causal SDPA on each document's part alone: the padded path's
attention, with no mask and no cross-document term.

Documents of similar length are attended together as one padded batch (right-padded, so
causal attention never reads the padding), which keeps the kernel calls few when a row
packs many short documents; a long document is never padded to another's length by much
(`PAD_SLACK`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_SLACK = 1.25
"""A batch of documents is padded to its longest; its attention work (n x longest^2) stays
within this factor of the documents' own (sum of length^2)."""


def length_buckets(sizes: list[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """Document indices grouped by length (shortest first): each group's padded attention work
    n * max^2 within `slack` of its own sum of length^2."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    buckets: list[list[int]] = []
    own = 0
    for i in order:
        n = sizes[i]
        if buckets and (len(buckets[-1]) + 1) * n * n <= slack * (own + n * n):
            buckets[-1].append(i)
            own += n * n
        else:
            buckets.append([i])
            own = n * n
    return buckets


def _document_sdpa_class():
    from torchtitan.models.common.attention import ScaledDotProductAttention, VarlenMetadata

    class DocumentSDPA(ScaledDotProductAttention):
        @dataclass(kw_only=True, slots=True)
        class Config(ScaledDotProductAttention.Config):
            pass

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, **kwargs):
            if not isinstance(attention_masks, VarlenMetadata):
                return super().forward(q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks, **kwargs)
            bounds = attention_masks.cu_seq_q_host or tuple(attention_masks.cu_seq_q.tolist())
            starts, sizes = bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:])]
            N = q_BLNH.shape[1]
            # one packed row (B = 1); an extra zero position at index N stands for padding.
            # index_select both ways: its backward adds rows, where indexing's writes them one by one
            q, k, v = (torch.cat([t[0], t.new_zeros(1, *t.shape[2:])]) for t in (q_BLNH, k_BLNH, v_BLNH))
            outs, placed = [], []
            for bucket in length_buckets(sizes):
                longest = max(sizes[d] for d in bucket)
                offsets = torch.arange(longest)
                idx = torch.stack([torch.where(offsets < sizes[d], starts[d] + offsets, N) for d in bucket]).flatten().to(q.device)
                out = super().forward(
                    *(t.index_select(0, idx).view(len(bucket), longest, *t.shape[1:]) for t in (q, k, v)), **kwargs
                )  # causal: [n, longest, heads, head dim]
                real = (idx < N).nonzero().squeeze(1)
                outs.append(out.reshape(-1, *out.shape[2:]).index_select(0, real))
                placed.append(idx[real])
            order = torch.cat(placed).argsort()
            return torch.cat(outs).index_select(0, order)[None]

    return DocumentSDPA


_CLASS = None


def document_sdpa():
    """The DocumentSDPA module class (built on first use: TorchTitan is imported then)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _document_sdpa_class()
    return _CLASS
