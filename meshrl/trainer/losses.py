"""The GRPO policy loss with off-policy corrections.

Per token t of sequence i, with r = pi_theta / pi_prox (the PPO ratio against the trainer's
own policy before this optimizer step) and rho = pi_prox / mu (the behaviour gap between
that policy and the sampler mu that produced the token):

    loss_it = -w_it * S_it + kl_coef * k3(pi_theta || pi_ref)_it - entropy_coef * H_it

The surrogate S depends on the clip's anchor, `cfg.clip_against`:

    versions  S = r * A, with its gradient stopped where the clip is active on R = pi_theta / mu,
              with the bounds compounded once per version between the token's sampling and
              this step: A > 0 and R > (1 + clip_high)^(k+1), or A < 0 and
              R < (1 - clip_low)^(k+1), for a token of lag k (weight updates since it was
              sampled: a step held by `trainer.pace` moves the version, not the weights)
    sampler   as versions with k taken as 0 for every token: one trust region for the whole lag
    proximal  S = min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

With one optimizer step per batch, pi_prox is the trainer's policy of this very forward, so
r = 1 in value: a clip on r never acts, and nothing stops a batch sampled a few versions ago
from pushing a token further the way the versions in between already pushed it (with `tis`,
a token whose probability rose since it was sampled is even pushed harder, up to is_cap).
The `versions` and `sampler` anchors measure the step from the policy that sampled the
token, across the whole staleness lag, as PPO's old policy; where they do not clip, the
gradient is the same as `proximal`'s (w * A * grad log pi_theta). `sampler`'s one trust
region spans all the lag's versions, so a stale token that the versions in between already
moved by a clip's width gets no more gradient, though each of those versions stayed in its
own region: on a sparse reward, where a batch's few rewarded samples are what the steps in
between pushed up, that held async learning back (benchmarks/README.md section 18).
`versions` gives each version of the lag its own region: still a bound on the whole drift,
which `proximal` is not.

A_it is the sequence's advantage A_i on every token, or a per-token advantage when the
batch has one (on-policy distillation, meshrl/distill.py).

w is the off-policy correction weight, a function of rho only and never differentiated:

    none       1
    tis        min(rho, C)                                  truncated IS
    mis_token  rho * 1[rho <= C]                            masked IS, per token
    mis_seq    rho_i * 1[rho_i <= C],  rho_i = prod_t rho_t masked IS, per sequence
    icepop     rho * 1[low <= rho <= high]                  IcePop band mask
    decoupled  rho                                          AReaL decoupled PPO (needs pi_prox)
    opsm       0 for the whole sequence when A_i < 0 and mean_t log(mu / pi_prox) > delta, else 1
               (per-token advantages: 0 for the tokens with A_it < 0 of such a sequence)

Tokens a correction drops still count in the aggregation's denominators (they add a zero),
so the denominators depend on `loss_mask` alone and a caller can compute them globally:
with `token_count` / `seq_count` taken over the whole batch (all micro-batches, all data
parallel ranks), the sum of the micro-batch losses is exactly the full-batch loss.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import torch

from meshrl.config import LossConfig

Tensor = torch.Tensor
Count = int | float | Tensor | None


# ---- correction weights: (log_rho [B,T], mask [B,T], adv [B,1] or [B,T], cfg) -> (weight, keep) -
# log_rho is 0 on padding, detached. `keep` marks tokens the correction leaves in the loss.
def _no_correction(log_rho: Tensor, mask: Tensor, adv: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    return torch.ones_like(log_rho), torch.ones_like(mask)


def _truncated_is(log_rho: Tensor, mask: Tensor, adv: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    return log_rho.exp().clamp(max=cfg.is_cap), torch.ones_like(mask)


def _masked_is_token(log_rho: Tensor, mask: Tensor, adv: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    rho = log_rho.exp()  # may be inf for huge gaps; those tokens are masked, never multiplied
    keep = rho <= cfg.is_cap
    return torch.where(keep, rho, 0.0), keep


def _masked_is_sequence(log_rho: Tensor, mask: Tensor, adv: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    rho_seq = log_rho.sum(dim=1, keepdim=True).exp()  # product over the sequence's tokens
    keep = (rho_seq <= cfg.is_cap).expand_as(mask)
    return torch.where(keep, rho_seq, 0.0), keep


def _icepop(log_rho: Tensor, mask: Tensor, adv: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    rho = log_rho.exp()
    keep = (rho >= cfg.icepop_low) & (rho <= cfg.icepop_high)
    return torch.where(keep, rho, 0.0), keep


def _decoupled(log_rho: Tensor, mask: Tensor, adv: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    return log_rho.exp(), torch.ones_like(mask)


def _off_policy_sequence_mask(log_rho: Tensor, mask: Tensor, adv: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    # Mean over the sequence's loss tokens of log(mu / pi_prox) = -log_rho.
    gap = (-log_rho).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    keep = ~((adv < 0) & (gap > cfg.opsm_delta))
    keep = keep.expand_as(mask)
    return keep.to(log_rho.dtype), keep


CORRECTIONS: dict[str, Callable[[Tensor, Tensor, Tensor, LossConfig], tuple[Tensor, Tensor]]] = {
    "none": _no_correction,
    "tis": _truncated_is,
    "mis_token": _masked_is_token,
    "mis_seq": _masked_is_sequence,
    "icepop": _icepop,
    "decoupled": _decoupled,
    "opsm": _off_policy_sequence_mask,
}


# ---- aggregation --------------------------------------------------------------------------------
def aggregate(per_token: Tensor, mask: Tensor, how: str, token_count: Count = None, seq_count: Count = None) -> Tensor:
    """Reduce a [B,T] per-token loss (already zero off `mask`) to a scalar.

    token_mean: sum / token_count. seq_mean_token_mean: sum_i (sum_t l_it / n_i) / seq_count,
    n_i = loss tokens of sequence i. seq_mean_token_sum: sum / seq_count (Dr.GRPO).
    Counts default to this call's loss tokens / sequences with a loss token; a count of 0
    divides by 1, so an empty batch gives a real 0 with a gradient graph.
    """
    if how == "token_mean":
        count = mask.sum() if token_count is None else token_count
        return per_token.sum() / _at_least_one(count, per_token.device)
    seq_sums = per_token.sum(dim=1)
    if how == "seq_mean_token_mean":
        seq_sums = seq_sums / mask.sum(dim=1).clamp(min=1)
    elif how != "seq_mean_token_sum":
        raise ValueError(f"unknown aggregation {how!r}: use token_mean, seq_mean_token_mean or seq_mean_token_sum")
    count = mask.any(dim=1).sum() if seq_count is None else seq_count
    return seq_sums.sum() / _at_least_one(count, per_token.device)


def _at_least_one(count: int | float | Tensor, device: torch.device) -> Tensor:
    return torch.as_tensor(count, dtype=torch.float32, device=device).clamp(min=1)


# ---- the loss -----------------------------------------------------------------------------------
def policy_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    cfg: LossConfig,
    *,
    prox_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    lags: Tensor | None = None,
    token_count: Count = None,
    seq_count: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO/PPO-clip loss with the off-policy correction `cfg.correction` (see module doc).

    Args:
      logprobs: [B,T] trainer log-probs of the tokens (with grad).
      sampler_logprobs: [B,T] log mu, the inference engine's log-probs of the same tokens.
      advantages: [B] per-sequence advantages, or [B,T] per-token ones (read on `loss_mask` only).
      loss_mask: [B,T] True on tokens that count in the loss.
      prox_logprobs: [B,T] the trainer's log-probs before this optimizer step (pi_old /
        pi_prox). None: `logprobs.detach()` (one optimizer step per batch: r = 1 in value,
        still carrying the policy gradient). Required by `decoupled`.
      ref_logprobs: [B,T] reference-policy log-probs; required when `cfg.kl_coef > 0`.
      entropy: [B,T] per-token entropy of pi_theta; its bonus applies when `cfg.entropy_coef > 0`.
      lags: [B,T] weight updates since each token was sampled (`episode.weight_lags`), for `clip_against: versions`.
        None: every token on-policy (lag 0).
      token_count / seq_count: global denominators for `aggregate` (see there).

    Returns (loss, metrics). Metrics are detached scalar tensors over this call, meant to be
    reduced across micro-batches and ranks: keys ending `_sum` by sum, keys ending `_max`
    by max (then `reduce_metrics`). tokens_sum, seqs_sum: loss tokens and sequences;
    loss_sum: this call's loss (a contribution, already normalised); clip_frac_sum: tokens
    where the PPO clip was active; is_weight_sum / is_weight_max: correction weights;
    masked_sum: loss tokens the correction dropped; mismatch_sum: sum |log mu - log pi_prox|;
    kl_sum (with ref_logprobs), entropy_sum (with entropy): per-token sums.
    """
    if cfg.correction == "decoupled" and prox_logprobs is None:
        raise ValueError("correction 'decoupled' needs prox_logprobs: the trainer's log-probs before this optimizer step")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs from the reference model")
    if tuple(advantages.shape) not in (tuple(logprobs.shape[:1]), tuple(logprobs.shape)):
        raise ValueError(f"advantages must be [B]={logprobs.shape[0]} or [B,T]={tuple(logprobs.shape)}, got {tuple(advantages.shape)}")

    mask = loss_mask.bool()
    lp = logprobs.float()
    prox = lp.detach() if prox_logprobs is None else prox_logprobs.detach().float()
    adv = advantages.detach().float()
    adv = adv[:, None] if adv.dim() == 1 else torch.where(mask, adv, 0.0)  # [B,1] or [B,T]; padding may hold anything
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)

    # PPO-clip surrogate. Log-ratios are zeroed off the mask *before* exp: padding can hold
    # anything (-inf, garbage), and an inf there would turn masked-out gradients into NaN.
    mu = sampler_logprobs.detach().float()
    ratio = torch.where(mask, lp - prox, zero).exp()
    if cfg.clip_against in ("sampler", "versions"):
        # The clip decides on pi_theta / mu (module doc): a clipped token keeps its value and
        # loses its gradient; an unclipped one has r's gradient, weighted by the correction.
        behaviour_ratio = torch.where(mask, lp.detach() - mu, zero).exp()  # may be inf: only compared
        spans = 1.0 if cfg.clip_against == "sampler" or lags is None else torch.where(mask, lags.float().clamp(min=0) + 1, 1.0)
        high, low = (1 + cfg.clip_high) ** spans, (1 - cfg.clip_low) ** spans
        clipped = ((adv > 0) & (behaviour_ratio > high)) | ((adv < 0) & (behaviour_ratio < low))
        surrogate = torch.where(clipped, ratio.detach() * adv, ratio * adv)
    else:
        clipped_ratio = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
        clipped = clipped_ratio * adv < ratio * adv

    # Off-policy correction from the behaviour gap rho = pi_prox / mu; never differentiated.
    log_rho = torch.where(mask, prox - mu, zero)
    weight, keep = CORRECTIONS[cfg.correction](log_rho, mask, adv, cfg)

    per_token = -weight * surrogate
    kl = None
    if ref_logprobs is not None:
        # clamped as verl's low_var_kl: one token far from the reference (its exp past float32)
        # would otherwise be the whole update, or inf
        log_ref_ratio = torch.where(mask, ref_logprobs.detach().float() - lp, zero).clamp(-20.0, 20.0)
        kl = (log_ref_ratio.exp() - log_ref_ratio - 1).clamp(max=10.0)  # k3: unbiased, always >= 0
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy.float()
    per_token = torch.where(mask, per_token, zero)
    loss = aggregate(per_token, mask, cfg.aggregation, token_count, seq_count)

    with torch.no_grad():

        def on_mask(x: Tensor) -> Tensor:  # where, not a product: padding may hold NaN/inf
            return torch.where(mask, x.float(), zero)

        metrics = {
            "tokens_sum": mask.sum().float(),
            "seqs_sum": mask.any(dim=1).sum().float(),
            "loss_sum": loss.detach().clone(),
            "clip_frac_sum": on_mask(clipped).sum(),
            "is_weight_sum": on_mask(weight).sum(),
            "is_weight_max": torch.cat([on_mask(weight).flatten(), zero[None]]).max(),  # weights >= 0; no host sync
            "masked_sum": on_mask(~keep).sum(),
            "mismatch_sum": on_mask(log_rho.abs()).sum(),
        }
        if kl is not None:
            metrics["kl_sum"] = on_mask(kl).sum()
        if entropy is not None:
            metrics["entropy_sum"] = on_mask(entropy.detach()).sum()
    return loss, metrics


# ---- metrics ------------------------------------------------------------------------------------
def merge_sums(metrics: Sequence[Mapping[str, Tensor | float]]) -> dict[str, float]:
    """Several micro-batches' (or ranks') metric dicts as one: `_sum` keys add up, `_max` keys
    take the max; any other key is refused."""
    totals: dict[str, float] = {}
    for m in metrics:
        for key, value in m.items():
            value = float(value)
            if key.endswith("_max"):
                totals[key] = max(totals.get(key, -math.inf), value)
            elif key.endswith("_sum"):
                totals[key] = totals.get(key, 0.0) + value
            else:
                raise ValueError(f"metric {key!r} must end in _sum or _max")
    return totals


_PER_TOKEN_MEANS = {
    "clip_frac": "clip_frac_sum",
    "is_weight_mean": "is_weight_sum",
    "masked_frac": "masked_sum",
    "mismatch": "mismatch_sum",
    "kl": "kl_sum",
    "entropy": "entropy_sum",
    "distill_reverse_kl": "distill_reverse_kl_sum",  # added by the trainer for distillation batches
    "sampling_mask_miss_frac": "sampling_mask_miss_sum",  # added by the trainer under top-k / top-p
    "routing_replay_changed_frac": "routing_replay_changed_sum",  # added by the trainer under MoE routing replay
    "routing_replay_covered_frac": "routing_replay_covered_sum",  # ... the trained tokens it had the sampler's routes for
}


def reduce_metrics(metrics: Sequence[Mapping[str, Tensor | float]]) -> dict[str, float]:
    """Combine `policy_loss` metrics of several micro-batches (or ranks) into floats.

    `_sum` keys add up and `_max` keys take the max; then per-token sums become means over
    tokens_sum (clip_frac, is_weight_mean, masked_frac, mismatch, kl, entropy,
    distill_reverse_kl, sampling_mask_miss_frac, routing_replay_changed_frac and _covered_frac), `_max` keys keep their name, and loss / tokens / seqs are the
    totals (each call's loss is already a normalised contribution, so their sum is the
    batch loss). Across ranks: all-reduce each
    `_sum` tensor with SUM and each `_max` with MAX first, then pass the one merged dict.
    """
    totals = merge_sums(metrics)
    tokens = totals.get("tokens_sum", 0.0)
    out = {name: totals[key] for name, key in (("loss", "loss_sum"), ("tokens", "tokens_sum"), ("seqs", "seqs_sum")) if key in totals}
    out.update({name: totals[key] / max(tokens, 1.0) for name, key in _PER_TOKEN_MEANS.items() if key in totals})
    out.update({key: value for key, value in totals.items() if key.endswith("_max")})
    return out
