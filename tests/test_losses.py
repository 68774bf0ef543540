"""The GRPO loss family against an independent loop-based reference (value and gradient)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshrl.config import LossConfig
from meshrl.episode import group_advantages
from meshrl.trainer.losses import policy_loss, reduce_metrics

CORRECTIONS = ["none", "tis", "mis_token", "mis_seq", "icepop", "decoupled", "opsm"]
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


# ---- reference: plain Python floats, one token at a time, analytic gradient ---------------------
def reference(lp, mu, adv, mask, cfg, prox_logprobs=None, ref_logprobs=None, entropy=None, lags=None, token_count=None, seq_count=None):
    """Return (loss, dloss/dlp as nested lists) computed token by token in float64."""
    lp, mu, adv, mask = lp.tolist(), mu.tolist(), adv.tolist(), mask.tolist()
    prox = lp if prox_logprobs is None else prox_logprobs.tolist()
    ref = None if ref_logprobs is None else ref_logprobs.tolist()
    ent = None if entropy is None else entropy.tolist()
    B, T = len(lp), len(lp[0])
    lo, hi, C = 1 - cfg.clip_low, 1 + cfg.clip_high, cfg.is_cap

    n_tok = [sum(1 for t in range(T) if mask[i][t]) for i in range(B)]
    if token_count is None:
        token_count = sum(n_tok)
    if seq_count is None:
        seq_count = sum(1 for n in n_tok if n > 0)

    total, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        toks = [t for t in range(T) if mask[i][t]]
        A = adv[i]
        seq_log_rho = sum(prox[i][t] - mu[i][t] for t in toks)
        seq_gap = (sum(mu[i][t] - prox[i][t] for t in toks) / len(toks)) if toks else 0.0
        for t in toks:
            r = math.exp(lp[i][t] - prox[i][t])
            rho = math.exp(prox[i][t] - mu[i][t])
            if cfg.correction == "none":
                w = 1.0
            elif cfg.correction == "tis":
                w = min(rho, C)
            elif cfg.correction == "mis_token":
                w = rho if rho <= C else 0.0
            elif cfg.correction == "mis_seq":
                rho_seq = math.exp(seq_log_rho)
                w = rho_seq if rho_seq <= C else 0.0
            elif cfg.correction == "icepop":
                w = rho if cfg.icepop_low <= rho <= cfg.icepop_high else 0.0
            elif cfg.correction == "decoupled":
                w = rho
            elif cfg.correction == "opsm":
                w = 0.0 if (A < 0 and seq_gap > cfg.opsm_delta) else 1.0
            if cfg.clip_against in ("sampler", "versions"):
                R = math.exp(lp[i][t] - mu[i][t]) if lp[i][t] - mu[i][t] < 700 else math.inf  # pi_theta / mu
                n = 1 if cfg.clip_against == "sampler" or lags is None else int(lags[i][t]) + 1  # one trust region per version of the lag
                l = -w * r * A
                g = 0.0 if (A > 0 and R > hi**n) or (A < 0 and R < lo**n) else -w * r * A
            else:
                unclipped, clipped = r * A, min(max(r, lo), hi) * A
                if unclipped <= clipped:
                    l, g = -w * unclipped, -w * r * A  # d r / d lp = r
                else:
                    l, g = -w * clipped, 0.0  # the clipped branch is constant in lp
            if ref is not None and cfg.kl_coef > 0:
                d = ref[i][t] - lp[i][t]
                l += cfg.kl_coef * (math.exp(d) - d - 1)
                g += cfg.kl_coef * (1 - math.exp(d))
            if ent is not None and cfg.entropy_coef > 0:
                l -= cfg.entropy_coef * ent[i][t]
            if cfg.aggregation == "token_mean":
                scale = 1 / max(token_count, 1)
            elif cfg.aggregation == "seq_mean_token_mean":
                scale = 1 / (len(toks) * max(seq_count, 1))
            else:
                scale = 1 / max(seq_count, 1)
            total += l * scale
            grad[i][t] = g * scale
    return total, grad


def run_loss(lp, mu, adv, mask, cfg, **kw):
    lp = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, mu, adv, mask, cfg, **kw)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def hand_made():
    """Four sequences, five tokens; row 3 has no loss tokens; padding holds garbage."""
    lp = torch.tensor(
        [
            [-1.0, -0.5, -2.0, -0.1, -0.7],
            [-0.3, -1.2, -0.9, -0.4, -1.5],
            [-2.5, -0.2, -0.6, -1.1, -0.8],
            [-0.4, -0.4, -0.4, -0.4, -0.4],
        ]
    )
    # r = exp(lp - prox): 0.74 (below 1 - 0.2), 1.42 (above 1 + 0.28), 1.25, 0.82 ...
    prox = lp + torch.tensor(
        [
            [0.0, 0.3, -0.35, 0.1, -0.22],
            [0.05, -0.35, 0.3, 0.0, 0.0],
            [0.0, 0.3, -0.35, 0.2, -0.1],
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    # log rho = prox - mu: rho 2.7 (over C), 0.41 (under IcePop's 0.5), 6.05 (over 5) ...
    log_rho = torch.tensor(
        [
            [0.0, 1.0, -0.9, 0.2, 1.8],
            [0.1, -0.1, 0.05, 0.0, 0.0],
            [0.0, -0.2, -0.1, -0.3, 0.4],
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    mu = prox - log_rho
    mask = torch.tensor(
        [
            [True, True, True, True, True],
            [True, True, True, False, False],
            [False, True, True, True, True],
            [False, False, False, False, False],
        ]
    )
    mu[1, 3:] = float("-inf")  # padding garbage must not leak into loss or gradient
    mu[2, 0] = 80.0
    adv = torch.tensor([1.0, -0.5, -1.5, 0.7])
    ref = lp + torch.tensor([[0.1, -0.2, 0.0, 0.3, -0.1]] * 4)
    ent = torch.tensor([[0.5, 1.0, 1.5, 2.0, 2.5]] * 4)
    return lp, mu, adv, mask, prox, ref, ent


def assert_matches(lp, mu, adv, mask, cfg, **kw):
    loss, grad, metrics = run_loss(lp, mu, adv, mask, cfg, **kw)
    ref_loss, ref_grad = reference(lp, mu, adv, mask, cfg, **kw)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float32), rtol=1e-4, atol=1e-6)
    return loss, grad, metrics


# ---- value and gradient per correction and aggregation ------------------------------------------
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_matches_reference(correction, aggregation):
    lp, mu, adv, mask, prox, ref, ent = hand_made()
    cfg = LossConfig(correction=correction, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01)
    loss, grad, _ = assert_matches(lp, mu, adv, mask, cfg, prox_logprobs=prox, ref_logprobs=ref, entropy=ent)
    assert grad.abs().sum() > 0
    assert (grad[~mask] == 0).all()
    if correction != "decoupled":  # without prox: r = 1 in value, gradient -w * A per token
        cfg = dataclasses.replace(cfg, kl_coef=0.0, entropy_coef=0.0)
        assert_matches(lp, mu, adv, mask, cfg)


def test_corrections_drop_the_expected_tokens():
    lp, mu, adv, mask, prox, _, _ = hand_made()
    dropped = {}
    for correction in CORRECTIONS:
        _, grad, metrics = run_loss(lp, mu, adv, mask, LossConfig(correction=correction), prox_logprobs=prox)
        dropped[correction] = int(metrics["masked_sum"])
    # mis_token: rho 2.7 and 6.05 in row 0, none elsewhere; icepop: 0.41 and 6.05; mis_seq:
    # row 0's product is exp(2.1) > 2; opsm: row 2 (A < 0, mean log(mu/pi) = 0.05 > delta).
    assert dropped == {"none": 0, "tis": 0, "mis_token": 2, "mis_seq": 5, "icepop": 2, "decoupled": 0, "opsm": 4}


def test_metrics_match_loops():
    lp, mu, adv, mask, prox, ref, ent = hand_made()
    cfg = LossConfig(correction="tis", kl_coef=0.1)
    _, _, m = run_loss(lp, mu, adv, mask, cfg, prox_logprobs=prox, ref_logprobs=ref, entropy=ent)
    tokens = clipped = 0
    mismatch = kl = entropy = weight_sum = 0.0
    for i in range(4):
        for t in range(5):
            if not mask[i, t]:
                continue
            tokens += 1
            R, A = math.exp(lp[i, t] - mu[i, t]), adv[i].item()  # the clip's ratio: against the sampler
            clipped += (A > 0 and R > 1.28) or (A < 0 and R < 0.8)
            mismatch += abs(mu[i, t].item() - prox[i, t].item())
            weight_sum += min(math.exp(prox[i, t] - mu[i, t]), 2.0)
            d = (ref[i, t] - lp[i, t]).item()
            kl += math.exp(d) - d - 1
            entropy += ent[i, t].item()
    assert (m["tokens_sum"], m["seqs_sum"], m["clip_frac_sum"], m["masked_sum"]) == (tokens, 3, clipped, 0)
    assert clipped == 5  # pi_theta / mu = 2.01 and 7.54 with A > 0 (row 0); 0.78, 0.61 and 0.61 with A < 0 (rows 1, 2)
    # Anchored on pi_prox instead, the clip sees r = 1.42 with A > 0 (row 0), r = 0.74 with A < 0 (rows 1, 2).
    _, _, m_prox = run_loss(lp, mu, adv, mask, dataclasses.replace(cfg, clip_against="proximal"), prox_logprobs=prox, ref_logprobs=ref)
    assert m_prox["clip_frac_sum"] == 3
    assert m["is_weight_max"] == 2.0
    for key, value in (("mismatch_sum", mismatch), ("is_weight_sum", weight_sum), ("kl_sum", kl), ("entropy_sum", entropy)):
        assert m[key].item() == pytest.approx(value, rel=1e-5), key
    out = reduce_metrics([m])
    assert out["clip_frac"] == pytest.approx(clipped / tokens) and out["mismatch"] == pytest.approx(mismatch / tokens)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    data=st.data(),
    B=st.integers(1, 4),
    T=st.integers(1, 6),
    correction=st.sampled_from(CORRECTIONS),
    aggregation=st.sampled_from(AGGREGATIONS),
    clip_low=st.floats(0.05, 0.3),
    clip_high=st.floats(0.05, 0.5),
    with_prox=st.booleans(),
    clip_against=st.sampled_from(["sampler", "versions", "proximal"]),
)
def test_matches_reference_random(data, B, T, correction, aggregation, clip_low, clip_high, with_prox, clip_against):
    def tensor(lo, hi):
        values = data.draw(st.lists(st.floats(lo, hi, width=32), min_size=B * T, max_size=B * T))
        return torch.tensor(values, dtype=torch.float32).view(B, T)

    lp = tensor(-4.0, 0.0)
    prox = lp + tensor(-0.5, 0.5) if with_prox or correction == "decoupled" else None
    mu = (lp if prox is None else prox) + tensor(-1.5, 1.5)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).view(B, T)
    adv = torch.tensor(data.draw(st.lists(st.floats(-2, 2, width=32), min_size=B, max_size=B)))
    lags = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=B * T, max_size=B * T))).view(B, T)
    cfg = LossConfig(correction=correction, aggregation=aggregation, clip_low=clip_low, clip_high=clip_high, clip_against=clip_against)
    assert_matches(lp, mu, adv, mask, cfg, prox_logprobs=prox, lags=lags)


# ---- edge cases --------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_all_tokens_masked_gives_zero(correction, aggregation):
    lp, mu, adv, _, prox, ref, ent = hand_made()
    mu[0, 0] = float("-inf")
    mask = torch.zeros_like(lp, dtype=torch.bool)
    cfg = LossConfig(correction=correction, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01)
    loss, grad, metrics = run_loss(lp, mu, adv, mask, cfg, prox_logprobs=prox, ref_logprobs=ref, entropy=ent)
    assert loss.item() == 0.0
    assert torch.isfinite(grad).all() and (grad == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    assert metrics["tokens_sum"] == 0 and metrics["seqs_sum"] == 0


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_padding_garbage_does_not_leak(correction):
    # Off the mask: log-ratios that overflow exp, -inf sampler log-probs and NaN entropy must
    # change neither the loss nor the gradient (no inf * 0 = NaN through a multiplied mask).
    lp, mu, adv, mask, prox, ref, ent = hand_made()
    cfg = LossConfig(correction=correction, aggregation="seq_mean_token_mean", kl_coef=0.1, entropy_coef=0.01)
    clean = run_loss(lp, mu, adv, mask, cfg, prox_logprobs=prox, ref_logprobs=ref, entropy=ent)
    lp, mu, prox, ref, ent = lp.clone(), mu.clone(), prox.clone(), ref.clone(), ent.clone()
    lp[~mask], prox[~mask], mu[~mask], ref[~mask], ent[~mask] = 100.0, -100.0, float("-inf"), 200.0, float("nan")
    dirty = run_loss(lp, mu, adv, mask, cfg, prox_logprobs=prox, ref_logprobs=ref, entropy=ent)
    assert dirty[0].item() == clean[0].item()
    assert torch.equal(dirty[1], clean[1])
    assert all(torch.isfinite(v) for v in dirty[2].values())


def test_zero_reward_variance_gives_zero_gradient():
    reward = torch.tensor([1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(reward, torch.tensor([7, 7, 7, 7]), "grpo")
    assert (adv == 0).all()
    # rewards a float32 mean does not give back (a 0.2 format bonus on 1.0): their rounding,
    # divided by its own std, was an advantage of about 0.1 on every episode of the group
    for value, n in ((1.2, 8), (0.9, 16), (1.1, 16), (12.9, 16)):
        for mode in ("grpo", "grpo_no_std", "rloo"):
            tied = group_advantages(torch.full((n,), value), torch.zeros(n, dtype=torch.long), mode)
            assert (tied == 0).all(), (value, n, mode, tied[0])
    mixed = group_advantages(torch.tensor([1.2, 1.2, 0.2, 0.2, 0.9, 0.9]), torch.tensor([0, 0, 0, 0, 1, 1]), "grpo")
    assert torch.allclose(mixed[:4], torch.tensor([0.866, 0.866, -0.866, -0.866]), atol=1e-3) and (mixed[4:] == 0).all()
    lp, mu, _, mask, prox, _, _ = hand_made()
    for correction in CORRECTIONS:
        loss, grad, _ = run_loss(lp, mu, adv, mask, LossConfig(correction=correction), prox_logprobs=prox)
        assert loss.item() == 0.0 and (grad == 0).all()


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_extreme_behaviour_ratios(correction):
    # Row 0: rho = 1e6 and 1e-6 on two tokens. Row 1: eight tokens of rho = 1e30 each, whose
    # product overflows float32 (sequence rho must mask, not produce inf * 0 = NaN).
    lp = torch.full((2, 8), -1.0)
    log_rho = torch.zeros(2, 8)
    log_rho[0, 0], log_rho[0, 1] = math.log(1e6), math.log(1e-6)
    log_rho[1, :] = math.log(1e30) if correction in ("mis_seq", "tis") else 0.0
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :2] = True
    mask[1, :] = True
    adv = torch.tensor([1.0, -1.0])
    cfg = LossConfig(correction=correction)
    loss, grad, m = assert_matches(lp, lp - log_rho, adv, mask, cfg, prox_logprobs=lp.clone())
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    expected_max = {"none": 1.0, "tis": 2.0, "mis_token": 1.0, "icepop": 1.0, "decoupled": 1e6, "opsm": 1.0}
    if correction == "mis_seq":
        # row 0: product 1e6 * 1e-6 = 1 kept; row 1: 1e240 dropped
        assert m["masked_sum"] == 8 and m["is_weight_max"] == pytest.approx(1.0, rel=1e-4)
    else:
        assert m["is_weight_max"].item() == pytest.approx(expected_max[correction], rel=1e-4)
    if correction == "mis_token":
        assert m["masked_sum"] == 1  # 1e6 masked, 1e-6 kept with weight 1e-6
    if correction == "icepop":
        assert m["masked_sum"] == 2  # both outside [0.5, 5]


def test_extreme_ppo_ratios_are_finite_and_clipped():
    lp = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    prox = torch.tensor([[-math.log(1e6), math.log(1e6)], [-math.log(1e6), math.log(1e6)]])  # r = 1e6, 1e-6
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    cfg = LossConfig(correction="none")
    loss, grad, m = assert_matches(lp, prox, adv, mask, cfg, prox_logprobs=prox)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    # A > 0: r = 1e6 clipped (no gradient), r = 1e-6 unclipped. A < 0: the reverse.
    assert grad[0, 0] == 0 and grad[0, 1] != 0 and grad[1, 0] != 0 and grad[1, 1] == 0
    assert m["clip_frac_sum"] == 2


def test_one_step_per_batch_clips_against_the_sampler():
    """Issue 34: with one optimizer step per batch (no prox_logprobs) the ratio to the
    trainer's own policy is 1, so a clip on it never acts and a stale batch keeps pushing
    tokens the versions since its sampling already pushed (TIS even doubles them). The clip
    must measure pi_theta / mu: a token whose probability already rose 1.5x since it was
    sampled (A > 0) or fell to 0.7x (A < 0) gets no gradient; one within the band does."""
    mu = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    R = torch.tensor([[1.5, 1.1, 0.7], [0.7, 0.9, 1.5]])  # pi_theta / mu
    lp = mu + R.log()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 3, dtype=torch.bool)
    cfg = LossConfig(correction="tis", clip_against="sampler")
    _, grad, m = assert_matches(lp, mu, adv, mask, cfg)
    assert grad[0, 0] == 0 and grad[1, 0] == 0  # moved past the band in the advantage's direction: clipped
    assert grad[0, 1] < 0 and grad[1, 1] > 0  # within the band: pushed, weight min(rho, C)
    assert grad[0, 2] < 0 and grad[1, 2] > 0  # moved against the advantage: still pushed back
    assert grad[1, 2].item() == pytest.approx(1.5 / 6)  # -w * A / tokens, w = min(rho, C) = 1.5
    assert m["clip_frac_sum"] == 2
    # The former anchor (the trainer's own policy) clips nothing and pushes every token.
    _, grad_prox, m_prox = run_loss(lp, mu, adv, mask, dataclasses.replace(cfg, clip_against="proximal"))
    assert m_prox["clip_frac_sum"] == 0 and (grad_prox != 0).all()


def test_the_versions_anchor_gives_each_version_of_the_lag_its_own_trust_region():
    """`clip_against: versions`: the same ratio to the sampler, with the bounds compounded once
    per version since the token was sampled. A token that rose 1.5x (A > 0) is clipped when on
    policy (1.5 > 1.28) but not two versions stale (1.28^3 = 2.1), one at 3x is clipped at
    both; a token that fell to 0.7x (A < 0) is clipped on policy (0.7 < 0.8), not one version
    stale (0.8^2 = 0.64). On-policy tokens clip exactly as `sampler` does, and so does every
    token when no lags are given."""
    mu = torch.full((2, 3), -1.0)
    R = torch.tensor([[1.5, 1.5, 3.0], [0.7, 0.7, 0.5]])  # pi_theta / mu
    lags = torch.tensor([[0, 2, 2], [0, 1, 1]])
    lp = mu + R.log()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 3, dtype=torch.bool)
    cfg = LossConfig(correction="tis", clip_against="versions")
    _, grad, m = assert_matches(lp, mu, adv, mask, cfg, lags=lags)
    assert grad[0, 0] == 0 and grad[0, 1] < 0 and grad[0, 2] == 0
    assert grad[1, 0] == 0 and grad[1, 1] > 0 and grad[1, 2] == 0
    assert m["clip_frac_sum"] == 4
    _, grad_sampler, _ = run_loss(lp, mu, adv, mask, dataclasses.replace(cfg, clip_against="sampler"))
    assert (grad_sampler[:, 0] == grad[:, 0]).all() and (grad_sampler == 0).all()
    _, grad_no_lags, _ = run_loss(lp, mu, adv, mask, cfg)
    assert (grad_no_lags == grad_sampler).all()
    assert LossConfig().clip_against == "versions"  # the default since it closed the sparse task's async gap


def test_clip_higher_is_asymmetric():
    cfg = LossConfig(correction="none", clip_low=0.2, clip_high=0.28)
    ratios = torch.tensor([[1.25, 1.3], [0.82, 0.78]])
    prox = torch.zeros(2, 2)
    lp = ratios.log()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    _, grad, m = assert_matches(lp, prox, adv, mask, cfg, prox_logprobs=prox)
    # A > 0: 1.25 within 1 + 0.28 keeps its gradient, 1.3 is clipped. A < 0: 0.82 within
    # 1 - 0.2 keeps it, 0.78 is clipped. A symmetric 0.2 clip would have clipped 1.25 too.
    assert grad[0, 0] < 0 and grad[0, 1] == 0 and grad[1, 0] > 0 and grad[1, 1] == 0
    assert m["clip_frac_sum"] == 2
    _, grad_sym, _ = run_loss(lp, prox, adv, mask, dataclasses.replace(cfg, clip_high=0.2), prox_logprobs=prox)
    assert grad_sym[0, 0] == 0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("correction", CORRECTIONS)
def test_micro_batches_with_global_counts_equal_full_batch(correction, aggregation):
    lp, mu, adv, mask, prox, ref, ent = hand_made()
    cfg = LossConfig(correction=correction, aggregation=aggregation, kl_coef=0.05, entropy_coef=0.01)
    kw = dict(prox_logprobs=prox, ref_logprobs=ref, entropy=ent)
    full_loss, full_grad, full_metrics = run_loss(lp, mu, adv, mask, cfg, **kw)

    token_count, seq_count = int(mask.sum()), int(mask.any(1).sum())
    leaf = lp.clone().requires_grad_(True)
    total, parts = 0.0, []
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
        loss, metrics = policy_loss(
            leaf[rows], mu[rows], adv[rows], mask[rows], cfg,
            prox_logprobs=prox[rows], ref_logprobs=ref[rows], entropy=ent[rows],
            token_count=token_count, seq_count=seq_count,
        )  # fmt: skip
        loss.backward()
        total += loss.item()
        parts.append(metrics)
    assert total == pytest.approx(full_loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(leaf.grad, full_grad)
    assert reduce_metrics(parts) == pytest.approx(reduce_metrics([full_metrics]), rel=1e-5, abs=1e-7)


def test_zero_variance_groups_read_per_token_advantages_where_the_batch_has_them():
    """Under GAE a group of equal rewards still trains (return less the critic's value), and
    the metric said it carried no gradient."""
    from tensordict import TensorDict

    from meshrl.trainer.policy import zero_variance_share

    batch = TensorDict(
        {
            "group_id": torch.tensor([0, 0, 1, 1]),
            "reward": torch.tensor([1.0, 1.0, 0.0, 1.0]),
            "finish_reason": torch.zeros(4, dtype=torch.int64),
            "loss_mask": torch.tensor([[False, True]] * 4),
        },
        batch_size=[4],
    )
    assert zero_variance_share(batch) == 0.5  # by rewards: group 0 ties
    batch["token_advantage"] = torch.tensor([[9.0, 0.3], [9.0, -0.1], [0.0, -0.5], [0.0, 0.5]])
    assert zero_variance_share(batch) == 0.0  # group 0 trains on its values
    batch["token_advantage"][2:, 1] = 0.0
    batch["token_advantage"][3, 0] = 5.0  # off the mask: not trained
    assert zero_variance_share(batch) == 0.5  # group 1's trained tokens are all 0


def test_the_kl_term_is_clamped_as_verls_low_var_kl():
    """One token far below the reference (log ratio 100: exp past float32) made the loss inf and
    every gradient NaN; at 22 its gradient was 1e7, the whole update after the clip."""
    lp = torch.tensor([[-101.0, -1.0]], requires_grad=True)
    ref, mu = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-101.0, -1.0]])
    mask, adv = torch.tensor([[True, True]]), torch.tensor([0.0])
    loss, _ = policy_loss(lp, mu, adv, mask, LossConfig(kl_coef=0.1), ref_logprobs=ref)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all()
    assert loss.item() == pytest.approx(0.1 * 10.0 / 2)  # the clamped k3 of 10, over the 2 tokens


def test_missing_inputs_raise():
    lp, mu, adv, mask, _, _, _ = hand_made()
    with pytest.raises(ValueError, match="prox_logprobs"):
        policy_loss(lp, mu, adv, mask, LossConfig(correction="decoupled"))
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, mu, adv, mask, LossConfig(kl_coef=0.1))


def test_reduce_metrics():
    a = {"tokens_sum": torch.tensor(3.0), "loss_sum": torch.tensor(0.5), "clip_frac_sum": torch.tensor(1.0),
         "is_weight_sum": torch.tensor(3.0), "is_weight_max": torch.tensor(1.5)}  # fmt: skip
    b = {"tokens_sum": torch.tensor(5.0), "loss_sum": torch.tensor(-0.2), "clip_frac_sum": torch.tensor(3.0),
         "is_weight_sum": torch.tensor(5.0), "is_weight_max": torch.tensor(2.0)}  # fmt: skip
    out = reduce_metrics([a, b])
    assert out["tokens"] == 8 and out["loss"] == pytest.approx(0.3)
    assert out["clip_frac"] == pytest.approx(0.5) and out["is_weight_mean"] == pytest.approx(1.0)
    assert out["is_weight_max"] == 2.0
    with pytest.raises(ValueError):
        reduce_metrics([{"loss": 1.0}])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    lp, mu, adv, mask, prox, ref, ent = hand_made()
    cfg = LossConfig(correction="mis_seq", aggregation="seq_mean_token_mean", kl_coef=0.1, entropy_coef=0.01)
    cpu = run_loss(lp, mu, adv, mask, cfg, prox_logprobs=prox, ref_logprobs=ref, entropy=ent, token_count=12)
    on = [x.cuda() for x in (lp, mu, adv, mask, prox, ref, ent)]
    gpu = run_loss(*on[:4], cfg, prox_logprobs=on[4], ref_logprobs=on[5], entropy=on[6], token_count=12)
    torch.testing.assert_close(gpu[0].cpu(), cpu[0])
    torch.testing.assert_close(gpu[1].cpu(), cpu[1])
