"""PPO with a learned critic, the pure part: GAE over multi-turn rows, the clipped value
loss, and value metrics that reduce across micro-batches and ranks.

Layout is the rollout batch's (meshrl/episode.py): row b is one episode, `mask` is its
`loss_mask` (the model's own tokens), rewards are `dense_reward` (a turn's reward at its
last model token). V_bt is the critic's value of the state before model token t, read at
position t-1's output (meshrl/trainer/critic.py `token_values`).

GAE runs in reverse over each row's model tokens as one sequence: an env span (a tool
result, the env's reply) between two model turns is skipped, so the next model token's
value and advantage flow back across it ("carrying across observation tokens", as verl's
multi-turn GAE does), and the observation itself is part of that next state. With t' the
row's next model token after t (none after the last: V = 0, A = 0 there):

    delta_t = r_t + gamma * V_t' - V_t
    A_t     = delta_t + gamma * lam * A_t'
    R_t     = A_t + V_t                      (the critic's regression target)

gamma = lam = 1 (verl's default) gives A_t = sum_{k >= t} r_k - V_t and R_t = sum_{k >= t} r_k.

The policy's advantages and the critic's returns may take lambdas of their own (VC-PPO's and
VAPO's decoupled GAE): returns with lambda 1 are the critic's unbiased Monte-Carlo targets,
while a lower lambda for the advantages trades their variance for the critic's bias. VAPO's
length-adaptive lambda gives each row its own, lam_b = 1 - 1 / (alpha * l_b) with l_b its
model tokens (at least 0): a long answer sums more of its own rewards, a short one leans on
the critic.

Value loss (verl's / TRL's clipped form), per model token, with V_old the values the
advantages were computed from and c = `clip`:

    V_clip = V_old + clip(V - V_old, -c, c)
    l_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

aggregated as the policy loss is (`losses.aggregate`, global denominators allowed). Where the
clipped term is the larger, its gradient flows through V_clip: zero once V has left the
band [V_old - c, V_old + c]. `value_clip_frac` counts those tokens.

Explained variance over the model tokens, 1 - Var(R - V) / Var(R), is computed from sums
(count, sum R, sum R^2, sum (R - V), sum (R - V)^2), so micro-batches and ranks add their
sums and `reduce_value_metrics` gives the whole batch's figure.

Padding and env positions may hold anything (NaN, inf, garbage from a forward over pad
tokens): every input is read through `torch.where` on the mask, never multiplied by it, so
nothing off the mask reaches a result or a gradient (a product 0 * NaN is what turned
verl's value losses into NaN, verl #498). A non-finite value or reward on the mask is an
error, not a silent NaN advantage.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from tensordict import TensorDict

from meshrl.episode import FINISH_REASONS
from meshrl.trainer.losses import Count, aggregate, merge_sums

Tensor = torch.Tensor


def _on_mask(x: Tensor, mask: Tensor) -> Tensor:
    """`x` as float32 with 0 off `mask` (where, not a product: padding may hold NaN/inf)."""
    return torch.where(mask, x.float(), torch.zeros((), dtype=torch.float32, device=x.device))


def _check_finite(name: str, x: Tensor, mask: Tensor) -> None:
    bad = mask & ~torch.isfinite(x)
    if bool(bad.any()):
        raise ValueError(f"{name}: {int(bad.sum())} non-finite entries on model tokens (a diverged critic or a broken reward)")


@torch.no_grad()
def gae(values: Tensor, rewards: Tensor, mask: Tensor, gamma: float = 1.0, lam: float | Tensor = 1.0) -> tuple[Tensor, Tensor]:
    """(advantages, returns), both [B, T] float32 and 0 off `mask` (see the module docstring).

    values, rewards: [B, T], read on `mask` only. `lam`: one lambda, or each row's ([B]).
    Each row's model tokens are first gathered to the left (env tokens and padding drop out,
    their order kept), so the reverse loop runs over the longest row's model tokens, not over
    T, and nothing off the mask is ever read. gamma = lam = 1 takes the closed form (a reverse
    cumulative sum) instead of the loop.
    """
    if values.shape != rewards.shape or values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"values, rewards and mask must share one [B, T] shape, got {tuple(values.shape)}, {tuple(rewards.shape)}, {tuple(mask.shape)}")
    mask = mask.bool()
    _check_finite("values", values, mask)
    _check_finite("rewards", rewards, mask)
    B, T = mask.shape
    # stable sort on "not a model token": model tokens first, in their order
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    n = mask.sum(dim=1)
    L = int(n.max()) if B else 0
    order = order[:, :L]
    valid = torch.arange(L, device=mask.device)[None, :] < n[:, None]  # [B, L], trailing False
    v = torch.where(valid, values.float().gather(1, order), 0.0)
    r = torch.where(valid, rewards.float().gather(1, order), 0.0)
    lam = torch.as_tensor(lam, dtype=torch.float32, device=mask.device).expand(B)
    if gamma == 1.0 and bool((lam == 1.0).all()):
        ret = r.flip(1).cumsum(1).flip(1)
        adv = ret - v
    else:
        adv = torch.zeros_like(v)
        next_value = torch.zeros(B, dtype=torch.float32, device=v.device)
        last = torch.zeros_like(next_value)
        # past a row's last model token `valid` is False: V = 0, A = 0 there, nothing carried
        for t in range(L - 1, -1, -1):
            delta = r[:, t] + gamma * next_value - v[:, t]
            last = torch.where(valid[:, t], delta + gamma * lam * last, 0.0)
            next_value = v[:, t]
            adv[:, t] = last
        ret = adv + v
    adv, ret = torch.where(valid, adv, 0.0), torch.where(valid, ret, 0.0)
    advantages = torch.zeros(B, T, dtype=torch.float32, device=mask.device).scatter(1, order, adv)
    returns = torch.zeros_like(advantages).scatter(1, order, ret)
    return _on_mask(advantages, mask), _on_mask(returns, mask)


@torch.no_grad()
def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over `mask` (unbiased variance, as verl's masked_whiten),
    0 off the mask. Fewer than two entries: only centred."""
    mask = mask.bool()
    n = mask.sum()
    vals = _on_mask(x, mask).double()
    mean = vals.sum() / n.clamp(min=1)
    centred = torch.where(mask, vals - mean, 0.0)
    if int(n) < 2:
        return centred.float()
    var = centred.pow(2).sum() / (n - 1)
    return torch.where(mask, centred * torch.rsqrt(var + eps), 0.0).float()


@torch.no_grad()
def length_lambdas(mask: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive lambda of each row ([B]): 1 - 1 / (alpha * its model tokens), at least 0."""
    tokens = mask.bool().sum(dim=1).clamp(min=1).double()
    return (1.0 - 1.0 / (alpha * tokens)).clamp(min=0.0).float()


@torch.no_grad()
def ppo_advantages(
    batch: TensorDict,
    values: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    value_lam: float | None = None,
    adaptive_lam: float = 0.0,
) -> Tensor:
    """GAE on a rollout batch: writes `token_advantage` [B, T] (the per-token advantage the
    policy loss trains on instead of `advantage`) and returns the [B, T] returns, the
    critic's targets. In place on `batch`.

    `values`: [B, T] the critic's values of this batch (`CriticTrainer.values`). `whiten`:
    advantages centred and scaled over the batch's model tokens (verl's default for GAE);
    returns are never whitened. A failed episode (finish_reason `failed`) leaves
    `loss_mask`, as `assign_advantages` does: its reward of 0 says nothing about the policy,
    and the critic does not train on it either. Process rewards (`process_reward`, a PRM's
    or a process scorer's weighted step scores at each step's last token) add to the turns'
    rewards. `value_lam` (None: `lam`): the returns' own lambda; `adaptive_lam` (> 0): the
    advantages' lambda is each row's `length_lambdas` instead of `lam` (module docstring).
    """
    failed = batch["finish_reason"] == FINISH_REASONS["failed"]
    mask = batch["loss_mask"].bool() & ~failed[:, None]
    batch["loss_mask"] = mask
    rewards = batch["dense_reward"] + batch["process_reward"] if "process_reward" in batch.keys() else batch["dense_reward"]
    policy_lam = length_lambdas(mask, adaptive_lam) if adaptive_lam > 0 else lam
    advantages, returns = gae(values, rewards, mask, gamma, policy_lam)
    value_lam = lam if value_lam is None else value_lam
    if adaptive_lam > 0 or value_lam != lam:  # decoupled: the critic's targets from a lambda of their own
        returns = gae(values, rewards, mask, gamma, value_lam)[1]
    if whiten:
        advantages = masked_whiten(advantages, mask)
    batch["token_advantage"] = advantages
    return returns


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = 0.5,
    aggregation: str = "token_mean",
    *,
    token_count: Count = None,
    seq_count: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl's clipped value loss (module docstring) and its metric sums.

    values: [B, T] the critic's values now (with grad); old_values: [B, T] the values the
    returns were built from (detached); returns: [B, T] GAE's returns; mask: the loss mask.
    clip None (or inf): the plain 0.5 * (V - R)^2. token_count / seq_count: global
    denominators for `aggregate`, so micro-batch losses sum to the batch loss.

    Metrics (detached; `_sum` keys add across micro-batches and ranks, `_max` keys take the
    max; then `reduce_value_metrics`): value_tokens_sum, value_loss_sum (this call's
    normalised contribution), value_clip_sum (tokens where the clipped term was the larger),
    value_sum, return_sum, return_sq_sum, value_error_sum, value_error_sq_sum (R - V), in
    float64 so that variances from them keep their digits, and value_abs_max.
    """
    mask = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    v = torch.where(mask, values.float(), zero)
    old = _on_mask(old_values.detach(), mask)
    ret = _on_mask(returns.detach(), mask)
    unclipped = (v - ret).pow(2)
    if clip is None or math.isinf(clip):
        per_token, clipped = 0.5 * unclipped, torch.zeros_like(mask)
    else:
        v_clip = old + (v - old).clamp(-clip, clip)
        clipped_loss = (v_clip - ret).pow(2)
        per_token = 0.5 * torch.maximum(unclipped, clipped_loss)
        clipped = clipped_loss > unclipped
    per_token = torch.where(mask, per_token, zero)
    loss = aggregate(per_token, mask, aggregation, token_count, seq_count)
    with torch.no_grad():
        metrics = value_metric_sums(v.detach(), ret, mask)
        metrics["value_loss_sum"] = loss.detach().double().clone()
        metrics["value_clip_sum"] = (clipped & mask).sum().double()
    return loss, metrics


@torch.no_grad()
def value_metric_sums(values: Tensor, returns: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The sums behind value_mean, return_mean and explained_variance over `mask` (float64)."""
    mask = mask.bool()
    v, r = _on_mask(values, mask).double(), _on_mask(returns, mask).double()
    err = r - v
    return {
        "value_tokens_sum": mask.sum().double(),
        "value_sum": v.sum(),
        "return_sum": r.sum(),
        "return_sq_sum": r.pow(2).sum(),
        "value_error_sum": err.sum(),
        "value_error_sq_sum": err.pow(2).sum(),
        "value_abs_max": torch.cat([v.abs().flatten(), v.new_zeros(1)]).max(),
    }


def reduce_value_metrics(metrics: Sequence[Mapping[str, Tensor | float]], eps: float = 1e-8) -> dict[str, float]:
    """Combine `value_loss` / `value_metric_sums` dicts of several micro-batches (or ranks).

    Returns value_loss (the batch loss: contributions add), value_clip_frac, value_mean,
    return_mean, explained_variance = 1 - Var(R - V) / (Var(R) + eps) (population variances;
    verl's vf_explained_var has the same eps form, so constant returns read as a large
    negative number, not a division by zero), value_tokens, and value_abs_max. Across ranks:
    all-reduce each `_sum` with SUM and each `_max` with MAX first, then pass the one dict.
    """
    totals = merge_sums(metrics)
    n = totals.get("value_tokens_sum", 0.0)
    out: dict[str, float] = {"value_tokens": n}
    if "value_loss_sum" in totals:
        out["value_loss"] = totals["value_loss_sum"]
    if "value_clip_sum" in totals:
        out["value_clip_frac"] = totals["value_clip_sum"] / max(n, 1.0)
    if "value_abs_max" in totals:
        out["value_abs_max"] = totals["value_abs_max"]
    if n > 0 and "return_sum" in totals:
        mean_r, mean_e = totals["return_sum"] / n, totals["value_error_sum"] / n
        var_r = max(totals["return_sq_sum"] / n - mean_r**2, 0.0)
        var_e = max(totals["value_error_sq_sum"] / n - mean_e**2, 0.0)
        out.update(value_mean=totals["value_sum"] / n, return_mean=mean_r, explained_variance=1.0 - var_e / (var_r + eps))
    return out
