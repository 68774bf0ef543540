"""PPO with a learned critic, the pure part: GAE over multi-turn rows, the clipped value
loss and its metrics (meshrl/trainer/values.py), the value model and CriticTrainer
(meshrl/trainer/critic.py). CPU, tiny model, no Monarch or vLLM."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from meshrl.config import LossConfig, ModelConfig
from meshrl.episode import FINISH_REASONS, Episode, Turn, pack
from meshrl.trainer import checkpoint as ckpt
from meshrl.trainer.critic import CriticTrainer, build_value_model, export_value_model_hf, token_values
from meshrl.trainer.losses import policy_loss
from meshrl.trainer.model import build_model
from meshrl.trainer.packing import row_lengths
from meshrl.trainer.values import gae, length_lambdas, masked_whiten, ppo_advantages, reduce_value_metrics, value_loss, value_metric_sums

NAN, INF = float("nan"), float("inf")


# ---- GAE --------------------------------------------------------------------------------
def reference_gae(values, rewards, mask, gamma, lam):
    """Textbook GAE in plain Python over each row's model tokens, env tokens skipped."""
    B, T = mask.shape
    adv, ret = torch.zeros(B, T), torch.zeros(B, T)
    for b in range(B):
        pos = [t for t in range(T) if mask[b, t]]
        last, next_value = 0.0, 0.0
        for t in reversed(pos):
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            last = delta + gamma * lam * last
            next_value = float(values[b, t])
            adv[b, t], ret[b, t] = last, last + float(values[b, t])
    return adv, ret


def multi_turn_example():
    """Row 0: prompt [0, 1], model [2, 3], env [4, 5] (a tool result), model [6, 7], padding
    [8, 9]. Row 1: prompt [0], model [1..4], padding. Off the mask: garbage, NaN and inf."""
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 2:4] = mask[0, 6:8] = True
    mask[1, 1:5] = True
    values = torch.full((2, 10), 100.0)  # env tokens' values are never read
    values[0, 2:4] = torch.tensor([0.2, 0.4])
    values[0, 6:8] = torch.tensor([0.5, 0.7])
    values[1, 1:5] = torch.tensor([0.1, -0.3, 0.6, 0.9])
    values[0, 8], values[0, 9], values[1, 6] = NAN, INF, -INF
    rewards = torch.zeros(2, 10)
    rewards[0, 3], rewards[0, 7], rewards[1, 4] = 0.25, 1.0, 2.0  # each turn's reward at its last token
    rewards[0, 9], rewards[1, 8] = NAN, INF
    return values, rewards, mask


def test_gae_skips_env_spans_by_hand_and_by_reference():
    values, rewards, mask = multi_turn_example()
    g, l = 0.9, 0.8
    adv, ret = gae(values, rewards, mask, gamma=g, lam=l)
    # row 0 by hand: model tokens 2, 3 | env 4, 5 | 6, 7; V_2..V_7 = .2 .4 | .5 .7
    a7 = 1.0 - 0.7
    a6 = 0.0 + g * 0.7 - 0.5 + g * l * a7
    a3 = 0.25 + g * 0.5 - 0.4 + g * l * a6  # the next state is token 6's: across the env span
    a2 = 0.0 + g * 0.4 - 0.2 + g * l * a3
    expect = torch.tensor([a2, a3, a6, a7])
    assert torch.allclose(adv[0, [2, 3, 6, 7]], expect, atol=1e-6)
    assert torch.allclose(ret[0, [2, 3, 6, 7]], expect + torch.tensor([0.2, 0.4, 0.5, 0.7]), atol=1e-6)
    ref_adv, ref_ret = reference_gae(values, rewards, mask, g, l)
    assert torch.allclose(adv, ref_adv, atol=1e-6) and torch.allclose(ret, ref_ret, atol=1e-6)
    # off the mask: exactly 0, whatever the inputs held there
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_ignores_what_lies_off_the_mask():
    values, rewards, mask = multi_turn_example()
    adv, ret = gae(values, rewards, mask, 0.95, 0.9)
    g = torch.Generator().manual_seed(0)
    noisy_v = torch.where(mask, values, torch.randn(2, 10, generator=g) * 1e6)
    noisy_r = torch.where(mask, rewards, torch.randn(2, 10, generator=g) * 1e6)
    adv2, ret2 = gae(noisy_v, noisy_r, mask, 0.95, 0.9)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    values, rewards, mask = multi_turn_example()
    adv, ret = gae(values, rewards, mask)  # gamma = lam = 1: the closed form
    to_go = torch.tensor([1.25, 1.25, 1.0, 1.0])
    assert torch.allclose(ret[0, [2, 3, 6, 7]], to_go)
    assert torch.allclose(adv[0, [2, 3, 6, 7]], to_go - values[0, [2, 3, 6, 7]])
    assert torch.allclose(ret[1, 1:5], torch.full((4,), 2.0))
    ref_adv, ref_ret = reference_gae(values, rewards, mask, 1.0, 1.0)
    assert torch.allclose(adv, ref_adv, atol=1e-6) and torch.allclose(ret, ref_ret, atol=1e-6)


def test_gae_takes_a_lambda_per_row():
    values, rewards, mask = multi_turn_example()
    adv, ret = gae(values, rewards, mask, 0.9, torch.tensor([0.8, 0.3]))
    for row, lam in ((0, 0.8), (1, 0.3)):
        ref_adv, ref_ret = reference_gae(values, rewards, mask, 0.9, lam)
        assert torch.allclose(adv[row], ref_adv[row], atol=1e-6) and torch.allclose(ret[row], ref_ret[row], atol=1e-6)


def test_decoupled_and_length_adaptive_lambdas_vapos():
    """The critic's returns from `value_lam` (VC-PPO, VAPO: 1, the sums of rewards to come),
    the policy's advantages from `lam`, or with `adaptive_lam` from each row's own
    1 - 1 / (alpha * its model tokens): a row of 4 model tokens and one of 10."""

    def batch():
        rows = [[Turn("env", [1] * 2), Turn("model", [5] * n, [-1.0] * n, [0] * n, reward=r)] for n, r in ((4, 1.0), (10, 0.5))]
        return pack([Episode(0, i, turns) for i, turns in enumerate(rows)])

    b = batch()
    mask = b["loss_mask"]
    values = torch.where(mask, torch.linspace(0.0, 0.9, mask.shape[1]).expand_as(mask), NAN)
    to_go = gae(values, b["dense_reward"], mask, 1.0, 1.0)[1]
    returns = ppo_advantages(b, values, lam=0.5, value_lam=1.0, whiten=False)
    assert torch.allclose(returns, to_go) and torch.allclose(to_go[0][mask[0]], torch.ones(4))
    assert torch.allclose(b["token_advantage"], gae(values, b["dense_reward"], mask, 1.0, 0.5)[0])
    b = batch()
    returns = ppo_advantages(b, values, whiten=False, adaptive_lam=0.5)  # lambdas 1 - 1/2 and 1 - 1/5
    assert torch.allclose(returns, to_go)
    for row, lam in ((0, 0.5), (1, 0.8)):
        assert torch.allclose(b["token_advantage"][row], reference_gae(values, b["dense_reward"], mask, 1.0, lam)[0][row], atol=1e-6)
    assert length_lambdas(mask, 0.05).tolist() == [0.0, 0.0]  # VAPO's alpha on answers this short: the critic alone (TD(0))


def test_gae_refuses_non_finite_values_on_model_tokens():
    values, rewards, mask = multi_turn_example()
    values[0, 3] = NAN
    with pytest.raises(ValueError, match="values: 1 non-finite"):
        gae(values, rewards, mask)


def test_masked_whiten_over_model_tokens_only():
    values, _, mask = multi_turn_example()
    w = masked_whiten(values, mask)
    on = w[mask].double()
    assert abs(float(on.mean())) < 1e-6 and abs(float(on.std()) - 1.0) < 1e-4
    assert (w[~mask] == 0).all()


# ---- value loss ---------------------------------------------------------------------------
def test_value_loss_clips_as_verl_defines():
    """Four tokens with V_old = 0 and clip 0.5, plus a NaN-padded fifth position:
    a: V = 1 (outside the band), R = 3: the clipped term (0.5 - 3)^2 is larger -> no gradient;
    b: V = 1, R = -1: the unclipped term (1 + 1)^2 is larger -> gradient V - R = 2;
    c: V = 0.2 (inside), R = 1: both terms equal -> gradient V - R = -0.8;
    d: V = -1, R = -3: clipped (-0.5 + 3)^2 larger -> no gradient."""
    v = torch.tensor([[1.0, 1.0, 0.2, -1.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0, INF]])
    ret = torch.tensor([[3.0, -1.0, 1.0, -3.0, NAN]])
    mask = torch.tensor([[True, True, True, True, False]])
    loss, m = value_loss(v, old, ret, mask, clip=0.5)
    expect = 0.5 * (2.5**2 + 2.0**2 + 0.8**2 + 2.5**2) / 4
    assert math.isclose(loss.item(), expect, rel_tol=1e-6)
    loss.backward()
    assert torch.allclose(v.grad, torch.tensor([[0.0, 2.0, -0.8, 0.0, 0.0]]) / 4)
    out = reduce_value_metrics([m])
    assert out["value_clip_frac"] == 0.5 and out["value_tokens"] == 4
    # unclipped: every token pulls toward its return
    v.grad = None
    loss, _ = value_loss(v, old, ret, mask, clip=None)
    loss.backward()
    assert torch.allclose(v.grad, torch.tensor([[-2.0, 2.0, -0.8, 2.0, 0.0]]) / 4)


def test_value_loss_micro_batches_sum_to_the_batch_loss():
    g = torch.Generator().manual_seed(1)
    v, old, ret = (torch.randn(6, 8, generator=g) for _ in range(3))
    mask = torch.rand(6, 8, generator=g) < 0.6
    whole, _ = value_loss(v, old, ret, mask, clip=0.2)
    n = int(mask.sum())
    parts = sum(float(value_loss(v[s], old[s], ret[s], mask[s], clip=0.2, token_count=n)[0]) for s in (slice(0, 2), slice(2, 6)))
    assert math.isclose(float(whole), parts, rel_tol=1e-6)


# ---- explained variance -------------------------------------------------------------------
def ev_of(values, returns, mask):
    return reduce_value_metrics([value_metric_sums(values, returns, mask)])["explained_variance"]


def test_explained_variance_bounds_and_reduction():
    g = torch.Generator().manual_seed(2)
    ret = torch.randn(8, 12, generator=g) * 3 + 5
    mask = torch.rand(8, 12, generator=g) < 0.7
    garbage = torch.where(mask, ret, NAN)  # padding holding NaN changes nothing
    assert ev_of(garbage, ret, mask) == pytest.approx(1.0)
    mean = ret[mask].mean()
    assert ev_of(torch.full_like(ret, float(mean)), ret, mask) == pytest.approx(0.0, abs=1e-6)
    v = ret + torch.randn(8, 12, generator=g)
    direct = 1 - float((ret - v)[mask].var(unbiased=False) / ret[mask].var(unbiased=False))
    whole = ev_of(v, ret, mask)
    halves = reduce_value_metrics([value_metric_sums(v[:4], ret[:4], mask[:4]), value_metric_sums(v[4:], ret[4:], mask[4:])])
    assert whole == pytest.approx(direct, abs=1e-6)
    assert halves["explained_variance"] == pytest.approx(whole, abs=1e-9)
    assert halves["return_mean"] == pytest.approx(float(ret[mask].mean()), abs=1e-5)


# ---- advantages on a rollout batch ------------------------------------------------------------
def test_ppo_advantages_write_token_advantage_the_policy_loss_reads():
    batch = pack([Episode(0, i, [Turn("env", [1] * 2), Turn("model", [5] * 4, [-1.0] * 4, [0] * 4, reward=1.0)]) for i in range(2)])
    batch["finish_reason"][1] = FINISH_REASONS["failed"]
    vals = torch.where(batch["loss_mask"], torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]), NAN)
    returns = ppo_advantages(batch, vals, gamma=1.0, lam=1.0, whiten=False)
    assert not batch["loss_mask"][1].any()  # a failed episode leaves the loss
    assert torch.allclose(returns[0, 2:], torch.ones(4))
    assert torch.allclose(batch["token_advantage"][0, 2:], 1 - torch.tensor([0.3, 0.4, 0.5, 0.6]))
    assert (batch["token_advantage"][1] == 0).all()
    # the policy loss takes [B, T] advantages: the gradient on each token is -A_t / tokens
    lp = torch.zeros(2, 6, requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(2, 6), batch["token_advantage"], batch["loss_mask"], LossConfig())
    loss.backward()
    assert torch.allclose(lp.grad[0, 2:], -batch["token_advantage"][0, 2:] / 4)
    whitened = ppo_advantages(
        pack([Episode(0, i, [Turn("env", [1]), Turn("model", [5] * 3, [0.0] * 3, [0] * 3, reward=float(i))]) for i in range(3)]), torch.zeros(3, 4)
    )
    assert whitened.shape == (3, 4)


# ---- the value model ------------------------------------------------------------------------
def toy_batch(seed: int, rows: int = 16):
    """Two model turns with a tool result between them. Token 1 of the prompt is a key;
    the key sets the two turns' rewards, so the return depends on the tokens (the key) and on
    the turn (the env span before the second turn)."""
    rewards = {5: (0.0, 0.0), 6: (0.0, 1.0), 7: (0.5, 0.0), 8: (0.5, 1.0)}
    rng = random.Random(seed)
    episodes = []
    for i in range(rows):
        key = 5 + i % 4
        n1, n2 = rng.randrange(3, 7), rng.randrange(3, 7)

        def rand(n):
            return [rng.randrange(20, 100) for _ in range(n)]

        episodes.append(
            Episode(
                i // 2,
                i,
                [
                    Turn("env", [1, key] + rand(rng.randrange(1, 4))),
                    Turn("model", rand(n1), [0.0] * n1, [0] * n1, reward=rewards[key][0]),
                    Turn("env", [3, 4]),
                    Turn("model", rand(n2), [0.0] * n2, [0] * n2, reward=rewards[key][1]),
                ],
            )
        )
    return pack(episodes)


def test_value_model_reads_the_state_before_each_token():
    model, _ = build_value_model(ModelConfig(), seed=3)
    with torch.no_grad():
        model.lm_head.weight.normal_()
        model.lm_head.bias.fill_(0.5)
    batch = toy_batch(0, rows=4)
    mask = batch["loss_mask"]
    with torch.no_grad():
        v = token_values(model, batch)
        full = model(batch["tokens"])  # [B, T, 1]: the head replaced the LM head
        packed = token_values(model, batch, packed=True)
        other_pad = batch.clone()
        beyond = torch.arange(batch["tokens"].shape[1])[None, :] >= row_lengths(batch)[:, None]
        assert beyond.any()
        other_pad["tokens"] = torch.where(beyond, 77, batch["tokens"])  # another pad token after each row's end
        v_pad = token_values(model, other_pad)
    assert full.shape == (*batch["tokens"].shape, 1)
    assert torch.allclose(v[:, 1:][mask[:, 1:]], full[:, :-1, 0][mask[:, 1:]], atol=1e-6)
    assert (v[:, 0] == 0).all() and (v[~mask] == 0).all()
    assert torch.allclose(v, packed, atol=1e-5) and torch.allclose(v, v_pad, atol=1e-6)
    fresh, _ = build_value_model(ModelConfig(), seed=3)
    assert (token_values(fresh, batch) == 0).all()  # a zero head: V = 0 until it learns


def test_value_model_starts_from_the_policy_but_its_head(tmp_path):
    policy, specs = build_model(ModelConfig(), seed=7)
    for source in (policy.state_dict(), ckpt.export_hf(policy, specs, tmp_path / "hf")):
        critic, _ = build_value_model(ModelConfig(), seed=0, init_from=source)
        theirs = policy.state_dict()
        for name, p in critic.named_parameters():
            if name.startswith("lm_head."):
                assert p.shape[0] == 1 and (p == 0).all()
            else:
                assert torch.equal(p, theirs[name]), name
    with pytest.raises(KeyError, match="lacks weights"):
        build_value_model(ModelConfig(), init_from={"tok_embeddings.weight": policy.tok_embeddings.weight})


# ---- the critic trainer ------------------------------------------------------------------------
def test_critic_learns_values_that_depend_on_the_tokens():
    """Explained variance of the critic's values against GAE's returns, on the batch it trains
    on and on a held-out batch of the same rule, after 25 steps at lr 1e-3 (a fresh critic: 0).
    Measured with these batches over critic seeds 0-4: 0.928-0.942 trained on, 0.588-0.753
    held out; with the batches' seeds varied too: 0.918-0.971 and 0.443-0.628. With the
    head's gradient zeroed, or the returns zeroed, the critic stays at 0 and this test fails."""
    critic = CriticTrainer(ModelConfig(), lr=1e-3, seed=0, micro_batch_size=16)
    train, held = toy_batch(100), toy_batch(200)

    def ev(batch):
        v = critic.values(batch)
        return ev_of(v, gae(v, batch["dense_reward"], batch["loss_mask"])[1], batch["loss_mask"])

    assert ev(train) == pytest.approx(0.0, abs=1e-6)
    for _ in range(25):
        returns, old = critic.advantages(train)
        m = critic.train_step(train, returns, old)
    assert m["version"] == 25 and m["value_nonfinite"] == 0
    assert ev(train) > 0.75
    assert ev(held) > 0.25


def test_critic_micro_batches_match_one_batch_and_state_round_trips():
    batch = toy_batch(1, rows=6)
    critics = [CriticTrainer(ModelConfig(), lr=1e-2, seed=4, micro_batch_size=mbs, micro_batch_tokens=mbt) for mbs, mbt in ((6, 0), (2, 0), (16, 30))]
    returns, old = critics[0].advantages(batch)
    # one step: value_loss 0 at a zero head is flat in the trunk; a second sees every weight move
    metrics = [[c.train_step(batch, returns, old) for _ in range(2)][-1] for c in critics]
    for m in metrics[1:]:
        assert m["value_loss"] == pytest.approx(metrics[0]["value_loss"], rel=1e-5)
        assert m["explained_variance"] == pytest.approx(metrics[0]["explained_variance"], abs=1e-5)
    for c in critics[1:]:
        for a, b in zip(critics[0].model.parameters(), c.model.parameters()):
            assert torch.allclose(a, b, atol=1e-5)
    # state_dict: a fresh trainer loaded from it takes the very next step the original takes
    state = copy.deepcopy(critics[0].state_dict())
    resumed = CriticTrainer(ModelConfig(), lr=1e-2, seed=9, micro_batch_size=6)
    resumed.load_state_dict(state)
    a, b = critics[0].train_step(batch, returns, old), resumed.train_step(batch, returns, old)
    assert a["version"] == b["version"] == 3 and a["value_loss"] == pytest.approx(b["value_loss"], rel=1e-6)
    for p, q in zip(critics[0].model.parameters(), resumed.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_critic_takes_the_policys_activation_checkpointing(mode, tmp_path):
    """Long rows fit the policy under trainer.activation_checkpoint, and the critic (the policy's
    size) kept every activation: it is checkpointed as the policy, with the same values, the
    same step, and its weights' names unchanged, started from a checkpoint too."""
    batch = toy_batch(1, rows=4)
    plain, wrapped = (CriticTrainer(ModelConfig(), lr=1e-2, seed=4, micro_batch_size=4, activation_checkpoint=m) for m in ("none", mode))
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.model.named_parameters())
    assert list(wrapped.model.state_dict()) == list(plain.model.state_dict())
    returns, old = plain.advantages(batch)
    for _ in range(2):
        a, b = plain.train_step(batch, returns, old), wrapped.train_step(batch, returns, old)
        assert a["value_loss"] == pytest.approx(b["value_loss"], rel=1e-6)
    torch.testing.assert_close(plain.values(batch), wrapped.values(batch))
    path = export_value_model_hf(wrapped.model, wrapped.specs, tmp_path / "critic")
    again = CriticTrainer(ModelConfig(), init_from=path, activation_checkpoint=mode)
    torch.testing.assert_close(again.values(batch), wrapped.values(batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_critic_exports_a_token_classification_model_transformers_loads(tmp_path, family):
    """hf/final-critic: transformers' AutoModelForTokenClassification loads the exported critic
    (one label, the form verl's and TRL's critics take), and its logit at position t is the
    critic's value at t + 1 (the state before that token) on every model token."""
    from tests.conftest import check_exported_critic

    critic = CriticTrainer(ModelConfig(family=family), lr=1e-2, seed=4, micro_batch_size=6)
    batch = toy_batch(1, rows=6)
    for _ in range(2):  # the head moves off zero
        returns, old = critic.advantages(batch)
        critic.train_step(batch, returns, old)
    check_exported_critic(critic.export_hf(str(tmp_path / "critic")), critic.values(batch), batch)


def test_critic_makes_no_update_on_a_batch_with_nothing_to_learn_from():
    """A batch whose every episode failed (or a game's model with no row of its own): AdamW,
    stepped on the zero gradient, still moved every weight along its old momentum."""
    batch = toy_batch(2, rows=4)
    critic = CriticTrainer(ModelConfig(), lr=1e-2, seed=0, micro_batch_size=4)
    for _ in range(2):  # momentum of its own
        critic.train_step(batch, *critic.advantages(batch))
    empty = batch.clone()
    empty["loss_mask"] = torch.zeros_like(empty["loss_mask"])
    before = [p.detach().clone() for p in critic.model.parameters()]
    m = critic.train_step(empty, *critic.advantages(empty))
    assert m["version"] == 3 and m["value_nonfinite"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, critic.model.parameters()))


def test_critic_skips_a_non_finite_step():
    batch = toy_batch(2, rows=4)
    critic = CriticTrainer(ModelConfig(), lr=1e-2, seed=0, micro_batch_size=4)
    returns, old = critic.advantages(batch)
    before = [p.detach().clone() for p in critic.model.parameters()]
    bad = returns.clone()
    bad[batch["loss_mask"].nonzero()[0].tolist()] = NAN
    m = critic.train_step(batch, bad, old)
    assert m["value_nonfinite"] == 1 and m["version"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, critic.model.parameters()))
    assert critic.train_step(batch, returns, old)["value_nonfinite"] == 0
