"""Per-token log-probs (and entropies) of model tokens under the trainer's model.

Layout is the rollout batch's (meshrl/episode.py): row b is one episode's tokens, the
logits at t-1 predict token t, and `score_mask[b, t]` marks the tokens to score (the
model's own tokens).

Memory: the decoder runs once to hidden states; the LM head then runs only on the scored
positions, `chunk_size` tokens at a time, each chunk under activation checkpointing, so
the float32 [tokens x vocab] logits exist one chunk at a time, in forward and in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float() / temperature
    logp = F.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else token_logp.new_zeros(())
    return token_logp, entropy


def hidden_states(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder's final-norm output [B, T, D] (TorchTitan's `_skip_lm_head` switch)."""
    model._skip_lm_head = True
    try:
        return model(tokens)
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, T] of `tokens[b, t]` given `tokens[b, :t]` at `temperature`, where `score_mask`.

    Returns (logprobs, entropy or None), both [B, T] float32 and 0 outside `score_mask`
    (position 0 is never scored: nothing predicts it). Differentiable when grad is enabled.
    """
    B, T = tokens.shape
    mask = score_mask.clone()
    mask[:, 0] = False
    h = hidden_states(model, tokens)
    h_sel = h[:, :-1][mask[:, 1:]]  # [N, D]: hidden state at t-1 for each scored token t
    targets = tokens[mask]
    lm_head = model.lm_head
    lps, ents = [], []
    recompute = torch.is_grad_enabled()
    for start in range(0, h_sel.shape[0], chunk_size):
        args = (lm_head, h_sel[start:start + chunk_size], targets[start:start + chunk_size], temperature, with_entropy)
        lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if recompute else _chunk_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
    zeros = torch.zeros(B, T, dtype=torch.float32, device=tokens.device)
    if not lps:
        # Nothing to score: still touch the LM head with weight 0, so every parameter gets a
        # gradient and FSDP's reduce-scatters stay in step with the other ranks.
        lp, _ = _chunk_logprobs(lm_head, h[:1, 0], tokens[:1, 0], temperature, False)
        return zeros + 0.0 * lp.sum(), (zeros if with_entropy else None)
    logprobs = zeros.masked_scatter(mask, torch.cat(lps))
    entropy = zeros.masked_scatter(mask, torch.cat(ents)) if with_entropy else None
    return logprobs, entropy
