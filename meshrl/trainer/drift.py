"""How far the policy being trained is from the policies that sampled its batch: the trainer's
drift metrics (`mismatch_fresh`, `kl_prev_version`, `kl_sampler`, the importance-ratio
quantiles), from sums over micro-batches and ranks."""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict


def drift_sums(logprobs: torch.Tensor, packed: TensorDict, lag: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-micro-batch sums behind `drift_metrics` (summed across micro-batches and ranks).

    log rho = log pi_theta - log mu per loss token. Tokens of lag 0 were sampled by the very
    weights being trained: their gap is the engine's own (numerics, a prefix cached under older
    weights in keep mode), with no policy movement in it. Tokens of lag 1 were sampled by the
    weights of the update before, so k3(rho) = rho - 1 - log rho over them estimates
    KL(pi_prev || pi_theta). `lag`: weight updates since each token (episode.weight_lags)."""
    mask = packed["loss_mask"]
    log_rho = torch.where(mask, logprobs.float() - packed["sampler_logprobs"].float(), 0.0)
    k3 = torch.where(mask, log_rho.clamp(max=30.0).exp() - 1 - log_rho, 0.0)
    fresh, previous = mask & (lag == 0), mask & (lag == 1)
    return {
        "fresh_tokens_sum": fresh.sum().float(),
        "fresh_mismatch_sum": torch.where(fresh, log_rho.abs(), 0.0).sum(),
        "previous_tokens_sum": previous.sum().float(),
        "kl_previous_sum": torch.where(previous, k3, 0.0).sum(),
        "kl_sampler_sum": k3.sum(),
    }


def drift_metrics(merged: dict[str, torch.Tensor], gaps: torch.Tensor) -> dict[str, float]:
    """How far the policy being trained is from the policies that sampled its batch.

    - mismatch_fresh: mean |log mu - log pi_theta| over tokens sampled by the current version
      (the engine's gap alone; `mismatch` adds the policy's movement across the lag).
    - kl_prev_version: KL(pi_{v-1} || pi_v), the last optimizer step's size, estimated (k3) on
      the tokens the previous version sampled; absent when there are none (synchronous runs).
    - kl_sampler: KL(mu || pi_theta) (k3) over every loss token, the whole lag included.
    - is_ratio_p1 / p50 / p99 and logprob_gap_p99: quantiles of rho = pi_theta / mu and of
      |log rho| over this rank's loss tokens (rank 0's share of the batch with several ranks)."""
    tokens = max(float(merged.get("tokens_sum", 0.0)), 1.0)
    out = {"kl_sampler": float(merged["kl_sampler_sum"]) / tokens}
    if float(merged["fresh_tokens_sum"]) > 0:
        out["mismatch_fresh"] = float(merged["fresh_mismatch_sum"]) / float(merged["fresh_tokens_sum"])
    if float(merged["previous_tokens_sum"]) > 0:
        out["kl_prev_version"] = float(merged["kl_previous_sum"]) / float(merged["previous_tokens_sum"])
    if gaps.numel():
        q = quantiles(gaps, [0.01, 0.5, 0.99])
        out.update(is_ratio_p1=math.exp(q[0]), is_ratio_p50=math.exp(q[1]), is_ratio_p99=math.exp(q[2]), logprob_gap_p99=quantiles(gaps.abs(), [0.99])[0])
    return out


def quantiles(x: torch.Tensor, qs: list[float]) -> list[float]:
    """torch.quantile's linear interpolation, by sorting: torch.quantile refuses inputs past
    2^24 elements, which a rank's loss tokens of long reasoning traces exceed."""
    s = x.double().sort().values
    out = []
    for q in qs:
        pos = q * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        out.append(float(s[lo] + (s[hi] - s[lo]) * (pos - lo)))
    return out
