"""Token-budget micro-batches: rows packed back to back, no padding trained.

With `trainer.micro_batch_tokens` > 0 the trainer cuts its share of a batch into
micro-batches of at most that many tokens (a row longer than the budget trains alone), and
the model runs each one as a single packed sequence: the rows' real tokens concatenated,
positions restarting at 0 on every row, and attention kept inside each row by TorchTitan's
per-document metadata (`create_varlen_metadata_for_document`). Only the model's forward is
packed: its log-probs are put back in the batch's [rows, T] layout, so every loss, its
global denominators and the per-token data (masks, versions, advantages) are untouched.

Ranks get whole groups balanced by tokens rather than by rows, and every rank runs the same
number of micro-batches (the collectives stay in step): a rank with fewer runs empty ones.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from meshrl.episode import PAD_VERSION, group_slices


def row_lengths(td: TensorDict) -> torch.Tensor:
    """[B] tokens each row really holds (rows are right-padded; an episode ends on its last token)."""
    used = td["versions"] != PAD_VERSION
    T = used.shape[1]
    last = torch.where(used, torch.arange(T, device=used.device), -1).max(dim=1).values  # on the rows' device (a GPU critic's micro-batch)
    return last + 1


def rank_rows_by_tokens(td: TensorDict, rank: int, world: int) -> list[int]:
    """Rows data-parallel `rank` trains: whole groups, dealt so that ranks hold about equal
    tokens (largest group first to the rank with the fewest so far); deterministic, so every
    rank computes every rank's share alike."""
    groups = group_slices(td)
    lengths = row_lengths(td)
    sizes = [int(lengths[s].sum()) for s in groups]
    load, share = [0] * world, [[] for _ in range(world)]
    for g in sorted(range(len(groups)), key=lambda g: (-sizes[g], g)):
        r = min(range(world), key=lambda r: (load[r], r))
        load[r] += sizes[g]
        share[r].append(g)
    return [i for g in sorted(share[rank]) for i in range(groups[g].start, groups[g].stop)]


def token_micro_batches(rows: list[int], lengths: torch.Tensor, budget: int) -> list[list[int]]:
    """`rows` cut, in order, into micro-batches of at most `budget` tokens; a row longer than
    the budget alone in its own (never cut)."""
    out: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in rows:
        n = int(lengths[i])
        if current and used + n > budget:
            out.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        out.append(current)
    return out


def pack(values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T, ...] right-padded rows -> ([1, N, ...] packed values, [1, N] positions restarting
    at 0 on each row, [B, T] bool of the real positions), N = lengths.sum(). A row of no tokens
    (an episode failed before its first model turn) keeps its first position, never scored, so
    that no row, and no pack, is empty (attention cannot run on none)."""
    B, T = values.shape[:2]
    lengths = lengths.clamp(min=1)
    real = torch.arange(T, device=values.device)[None, :] < lengths.to(values.device)[:, None]
    positions = torch.arange(T, device=values.device).expand(B, T)
    return values[real][None], positions[real][None], real


def unpack(packed: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[1, N, ...] packed values -> [B, T, ...] in the rows' layout, zeros on padding (differentiable)."""
    shape = (*real.shape, *packed.shape[2:])
    mask = real.reshape(*real.shape, *([1] * (packed.dim() - 2))).expand(shape)
    return packed.new_zeros(shape).masked_scatter(mask, packed[0])


def rank_rows(td: TensorDict, rank: int, world: int) -> list[int]:
    """Rows of `td` that data-parallel `rank` trains on: a contiguous share of whole groups."""
    groups = group_slices(td)
    per, extra = divmod(len(groups), world)
    start = rank * per + min(rank, extra)
    mine = groups[start : start + per + (1 if rank < extra else 0)]
    return [i for s in mine for i in range(s.start, s.stop)]


def micro_batch_count(td: TensorDict, world: int, micro_batch_size: int) -> int:
    """Micro-batches every rank runs: the most any rank needs (collectives must stay in step)."""
    return max(1, max(math.ceil(len(rank_rows(td, r, world)) / micro_batch_size) for r in range(world)))


def micro_batch_plans(td: TensorDict, world: int, micro_batch_size: int, micro_batch_tokens: int = 0) -> list[list[list[int]]]:
    """Per data-parallel rank, the row indices of each micro-batch it runs, as many on every
    rank (a rank with fewer gets empty ones: it still runs the collectives).
    `micro_batch_tokens` > 0: groups dealt to ranks by tokens and rows packed up to that budget
    (below); 0: `micro_batch_size` rows each, padded."""
    if micro_batch_tokens > 0:
        lengths = row_lengths(td)
        plans = [token_micro_batches(rank_rows_by_tokens(td, r, world), lengths, micro_batch_tokens) for r in range(world)]
        n = max(1, max(map(len, plans)))
        return [plan + [[] for _ in range(n - len(plan))] for plan in plans]
    n = micro_batch_count(td, world, micro_batch_size)
    return [[rows[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(n)] for rows in (rank_rows(td, r, world) for r in range(world))]
