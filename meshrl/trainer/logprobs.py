"""Per-token log-probs (and entropies) of model tokens under the trainer's model.

Layout is the rollout batch's (meshrl/episode.py): row b is one episode's tokens, the
logits at t-1 predict token t, and `score_mask[b, t]` marks the tokens to score (the
model's own tokens).

Sampling-mask replay: with top-k or top-p the sampler draws from the logits at the
temperature truncated to a kept set and renormalised, and reports that log-prob. The same
truncation is applied here (`truncate`, vLLM's PyTorch rule: top-k first, then top-p over
what is left, keeping at least the most likely token), so trainer and sampler score the
same distribution. The kept set is recomputed from the trainer's logits; a sampled token
outside it (the two models' logits differ enough to move the edge) keeps its full-vocabulary
log-prob, is counted in `misses`, and its gap shows as mismatch for the IS correction.

Memory: the decoder runs once to hidden states; the LM head then runs only on the scored
positions, `chunk_size` tokens at a time, each chunk under activation checkpointing, so
the float32 [tokens x vocab] logits exist one chunk at a time, in forward and in backward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshrl.trainer.context_parallel import CPRows
from meshrl.trainer.head import head_logits
from meshrl.trainer.packing import pack, unpack
from meshrl.trainer.parallelize import full_tensor
from meshrl.trainer.routing import replay_routing


def kept_set(logits: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor | None:
    """[N, V] bool: the tokens vLLM's sampler keeps from `logits` (already at the temperature)
    with `top_k` (-1: off) and `top_p` (1: off); None when nothing is truncated. Ties at the
    top-k edge are kept, and top-p drops the least likely tokens whose cumulative mass is at
    most 1 - top_p, never the most likely one, as in vLLM's `apply_top_k_top_p_pytorch`."""
    if top_k <= 0 and top_p >= 1.0:
        return None
    with torch.no_grad():
        ordered, order = logits.float().sort(dim=-1)  # ascending
        drop = torch.zeros_like(ordered, dtype=torch.bool)
        if 0 < top_k < ordered.shape[-1]:
            drop = ordered < ordered[:, -top_k, None]  # (a slice to -top_k + 1 is empty at top_k 1)
        if top_p < 1.0:
            mass = ordered.masked_fill(drop, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
            drop |= mass <= 1 - top_p
            drop[:, -1] = False
        return torch.empty_like(drop).scatter_(-1, order, ~drop)


def _chunk_logprobs(
    lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, top_k: int = -1, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = full_tensor(head_logits(lm_head, hidden)).float() / temperature  # vocab-sharded under TP: gathered (top-k/p, entropy)
    keep = kept_set(logits, top_k, top_p)
    full = F.log_softmax(logits, dim=-1)
    logp, misses = full, full.new_zeros(())
    if keep is not None:
        logp = F.log_softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
        inside = keep.gather(-1, targets[:, None]).squeeze(-1)
        misses = (~inside).sum().float()
    token_logp = logp.gather(-1, targets[:, None]).squeeze(-1)
    if keep is not None:
        token_logp = torch.where(inside, token_logp, full.gather(-1, targets[:, None]).squeeze(-1))
    entropy = -(logp.exp() * logp.masked_fill(logp.isinf(), 0.0)).sum(-1) if with_entropy else token_logp.new_zeros(())
    return token_logp, entropy, misses


def hidden_states(model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder's final-norm output [B, T, D] (TorchTitan's `_skip_lm_head` switch).

    With `lengths` ([B] real tokens per right-padded row) the rows run packed as one sequence
    (meshrl/trainer/packing.py) and come back in the [B, T] layout, zeros on padding.
    `positions` [B, T]: each token's position (a context-parallel shard's), else 0..T-1."""
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    model._skip_lm_head = True
    try:
        # under TP the final norm's output is a replicated DTensor: its local tensor is the whole
        if lengths is None:
            return full_tensor(model(tokens, positions))
        flat, positions, real = pack(tokens, lengths)
        documents = create_varlen_metadata_for_document(positions.cpu(), include_host_offsets=True)
        return unpack(full_tensor(model(flat, positions, documents)), real)
    finally:
        model._skip_lm_head = False


def token_logprobs(
    model: nn.Module,
    tokens: torch.Tensor,
    score_mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    chunk_size: int = 1024,
    top_k: int = -1,
    top_p: float = 1.0,
    misses: list | None = None,
    routed_experts: torch.Tensor | None = None,
    replay_changed: list | None = None,
    lengths: torch.Tensor | None = None,
    keep_replay: contextlib.ExitStack | None = None,
    cp_mesh=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of `tokens[b, t]` given `tokens[b, :t]` at `temperature`, truncated to
    the sampler's kept set by `top_k` / `top_p` (see the module docstring), where `score_mask`.

    Returns (logprobs, entropy or None), both [B, T] float32 and 0 outside `score_mask`
    (position 0 is never scored: nothing predicts it). Differentiable when grad is enabled.
    `misses`, a list, gets the count of scored tokens outside their kept set appended.
    `routed_experts` [B, T, L, K] (by input position, -1 = none): MoE routing replay for the
    decoder forward (meshrl/trainer/routing.py); None routes live. `replay_changed`, a list,
    gets the [B, T] positions where replay overrode the live routing (`replay_routing`).
    `lengths` [B]: the real tokens of each right-padded row; the decoder then runs the rows
    packed, with no padding (`hidden_states`), for the same result. `keep_replay`: an ExitStack
    the routing replay is entered into instead of closing with the forward, for a caller whose
    backward recomputes checkpointed blocks (their routers must replay again); the
    `replay_changed` flags arrive when the caller closes it. `cp_mesh`: the context-parallel
    mesh of a model parallelized with CP; each proc runs its share of the rows' positions
    (meshrl/trainer/context_parallel.py), and every proc gets the whole result.
    """
    mask = score_mask.clone()
    mask[:, 0] = False
    # MoE routing replay covers the decoder only: the LM head (recomputed in backward) has no router.
    changed: list | None = None if replay_changed is None else []
    if lengths is not None and routed_experts is not None:
        routed_experts = pack(routed_experts, lengths)[0]  # the experts follow their tokens

    def report_changed() -> None:
        if changed:
            real = None if lengths is None else pack(tokens, lengths)[2]
            replay_changed.append(changed[0] if real is None else torch.zeros_like(real).masked_scatter(real, changed[0][0]))

    cp = None if cp_mesh is None else CPRows(cp_mesh, tokens, mask)
    run = (lambda: hidden_states(model, tokens, lengths)) if cp is None else (lambda: hidden_states(model, cp.tokens, positions=cp.positions))
    if keep_replay is None:
        with replay_routing(model, routed_experts, changed):
            h = run()
        report_changed()
    else:  # the caller closes it after backward, whose checkpoint recomputation must replay too
        keep_replay.callback(report_changed)
        keep_replay.enter_context(replay_routing(model, routed_experts, changed))
        h = run()
    if cp is None:
        h_sel = h[:, :-1][mask[:, 1:]]  # [N, D]: hidden state at t-1 for each scored token t
        targets, placed = tokens[mask], mask
    else:  # this proc's positions, each with the token it predicts
        h_sel, targets, placed = h[cp.scored], cp.targets[cp.scored], cp.scored
    lm_head = model.lm_head
    lps, ents, missed = [], [], []
    recompute = torch.is_grad_enabled()
    for start in range(0, h_sel.shape[0], chunk_size):
        args = (lm_head, h_sel[start : start + chunk_size], targets[start : start + chunk_size], temperature, with_entropy, top_k, top_p)
        lp, ent, miss = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if recompute else _chunk_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
        missed.append(miss.detach())
    if misses is not None:
        missed_sum = torch.stack(missed).sum() if missed else torch.zeros((), device=tokens.device)
        misses.append(missed_sum if cp is None else cp.sum(missed_sum))
    zeros = torch.zeros(placed.shape, dtype=torch.float32, device=tokens.device)
    if not lps:
        # Nothing to score: still touch the LM head with weight 0, so every parameter gets a
        # gradient and FSDP's reduce-scatters stay in step with the other ranks.
        lp, _, _ = _chunk_logprobs(lm_head, h[:1, 0], tokens[:1, 0], temperature, False)
        logprobs, entropy = zeros + 0.0 * lp.sum(), (zeros if with_entropy else None)
    else:
        logprobs = zeros.masked_scatter(placed, torch.cat(lps))
        entropy = zeros.masked_scatter(placed, torch.cat(ents)) if with_entropy else None
    if cp is not None:
        logprobs, entropy = cp.gather(logprobs), (cp.gather(entropy) if with_entropy else None)
    return logprobs, entropy
