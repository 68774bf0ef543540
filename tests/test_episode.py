"""Episodes and the rollout batch format (meshrl/episode.py), against direct computations."""

import math
import statistics

import pytest
import torch

from meshrl import episode
from meshrl.episode import FINISH_REASONS, PAD_VERSION, Episode, Turn


def model(ids, logprobs, versions, reward=0.0, experts=None):
    return Turn("model", list(ids), list(logprobs), list(versions), reward=reward, routed_experts=experts)


def env(ids):
    return Turn("env", list(ids))


def episodes():
    """Four episodes of two groups: multi-turn, single-turn cut by length, aborted, failed."""
    return [
        # prompt 3, model 2, env 2 (a tool result), model 1: two rewarded turns
        Episode(
            0, 0, [env([5, 6, 7]), model([8, 9], [-0.1, -0.2], [3, 4], reward=0.25), env([20, 21]), model([10], [-0.7], [4], reward=0.5)], "stop", tool_calls=1
        ),
        Episode(0, 1, [env([5, 6]), model([8, 9, 10, 11], [-0.3, -0.4, -0.5, -0.6], [4, 4, 4, 5])], "length"),
        Episode(1, 2, [env([1]), model([2], [-1.0], [5], reward=2.0)], "abort"),
        # its second env call failed: the turn reward it had earned does not count
        Episode(1, 3, [env([1]), model([3, 4], [-0.2, -0.3], [5, 5], reward=0.75), env([30])], "failed"),
    ]


def test_episode_properties():
    a, b, c, d = episodes()
    assert a.token_ids == [5, 6, 7, 8, 9, 20, 21, 10] and len(a) == 8
    assert len(a.model_turns) == 2 and a.prompt_len == 3 and a.env_tokens == 2
    assert a.reward == 0.75  # the sum of its turns' rewards
    assert b.env_tokens == 0 and b.prompt_len == 2
    assert d.reward == 0.0 and d.env_tokens == 1  # failed: reward 0 whatever its turns earned
    assert Episode(0, 0, [env([1, 2])]).prompt_len == 2 and Episode(0, 0).token_ids == []


def test_pack_layout():
    td = episode.pack(episodes())
    assert td.batch_size == torch.Size([4])
    assert td["tokens"].shape == (4, 8)
    assert td["tokens"][0].tolist() == [5, 6, 7, 8, 9, 20, 21, 10]
    assert td["tokens"][1].tolist() == [5, 6, 8, 9, 10, 11, 0, 0]
    # env tokens (prompt, tool result, padding) never count in the loss and carry no version
    assert td["loss_mask"][0].tolist() == [False, False, False, True, True, False, False, True]
    assert td["loss_mask"][3].tolist() == [False, True, True, False, False, False, False, False]
    assert td["versions"][0].tolist() == [PAD_VERSION] * 3 + [3, 4] + [PAD_VERSION] * 2 + [4]
    assert td["versions"][1].tolist() == [PAD_VERSION] * 2 + [4, 4, 4, 5] + [PAD_VERSION] * 2
    assert ((td["versions"] == PAD_VERSION) == ~td["loss_mask"]).all()
    # model tokens keep their exact ids and log-probs; everything else is 0
    assert td["sampler_logprobs"][0].tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.7])
    assert td["sampler_logprobs"][1].tolist() == pytest.approx([0, 0, -0.3, -0.4, -0.5, -0.6, 0, 0])
    for row, ep in enumerate(episodes()):
        assert td["tokens"][row, : len(ep)].tolist() == ep.token_ids
        got = td["tokens"][row][td["loss_mask"][row]].tolist()
        assert got == [t for turn in ep.model_turns for t in turn.token_ids]
    # a turn's reward sits on its last model token; the episode reward is their sum
    assert td["dense_reward"][0].tolist() == [0, 0, 0, 0, 0.25, 0, 0, 0.5]
    assert td["reward"].tolist() == [0.75, 0.0, 2.0, 0.0]
    # a failed episode has reward 0, and so does every one of its turns
    assert td["dense_reward"][3].tolist() == [0.0] * 8
    torch.testing.assert_close(td["dense_reward"].sum(1), td["reward"])
    assert td["finish_reason"].tolist() == [FINISH_REASONS[r] for r in ("stop", "length", "abort", "failed")] == [0, 1, 2, 3]
    assert td["prompt_len"].tolist() == [3, 2, 1, 1]
    assert td["model_turns"].tolist() == [2, 1, 1, 1]
    assert td["group_id"].tolist() == [0, 0, 1, 1] and td["sample_id"].tolist() == [0, 1, 2, 3]
    assert td["advantage"].tolist() == [0.0] * 4
    assert "routed_experts" not in td.keys()
    assert episode.group_slices(td) == [slice(0, 2), slice(2, 4)]
    with pytest.raises(ValueError):
        episode.pack([])


def test_mismatched_lengths_rejected():
    with pytest.raises(ValueError, match="log-probs"):
        Turn("model", [2, 3], [-1.0], [0, 0])
    with pytest.raises(ValueError, match="versions"):
        Turn("model", [2, 3], [-1.0, -1.0], [0])
    Turn("env", [1, 2, 3])  # env turns carry ids alone


def test_optional_routed_experts():
    eps = episodes()[:2]
    eps[0].turns[1].routed_experts = torch.tensor([[[0, 1]], [[2, 3]]])  # 2 tokens, L=1, K=2
    eps[0].turns[3].routed_experts = torch.tensor([[[3, 2]]])
    eps[1].turns[1].routed_experts = torch.tensor([[[1, 0]]] * 4)
    td = episode.pack(eps)
    assert td["routed_experts"].shape == (2, 8, 1, 2) and td["routed_experts"].dtype == torch.int32
    assert td["routed_experts"][0, 3].tolist() == [[0, 1]]  # the first model token sits at position 3
    assert td["routed_experts"][0, 7].tolist() == [[3, 2]]
    assert td["routed_experts"][0, 5].tolist() == [[-1, -1]]  # env token
    assert td["routed_experts"][1, 2:6].tolist() == [[[1, 0]]] * 4
    assert td["routed_experts"][1, 6].tolist() == [[-1, -1]]  # padding
    eps[1].turns[1].routed_experts = torch.zeros(4, 2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="routed_experts"):
        episode.pack(eps)


@pytest.mark.parametrize("mode", ["grpo", "grpo_no_std", "rloo"])
def test_group_advantages_against_direct_formula(mode):
    rewards = [1.0, 0.0, 3.0, 2.0, 2.0, 5.0, 5.0]
    groups = [0, 0, 0, 1, 1, 2, 2]
    adv = episode.group_advantages(torch.tensor(rewards), torch.tensor(groups), mode).tolist()
    for i, (r, g) in enumerate(zip(rewards, groups)):
        members = [rr for rr, gg in zip(rewards, groups) if gg == g]
        mean = sum(members) / len(members)
        if mode == "grpo":
            std = statistics.stdev(members)
            want = (r - mean) / (std + 1e-6)
        elif mode == "grpo_no_std":
            want = r - mean
        else:
            want = r - (sum(members) - r) / (len(members) - 1)
        assert adv[i] == pytest.approx(want, abs=1e-5)
    # a group with zero reward variance gets zero advantage, never NaN
    assert adv[5] == 0.0 and adv[6] == 0.0 and all(math.isfinite(a) for a in adv)


def test_assign_advantages_fills_the_batch_and_leaves_failed_episodes_out():
    td = episode.assign_advantages(episode.pack(episodes()), "grpo_no_std")
    # group 1 is the aborted episode and the failed one: the failure is not a sample of the
    # policy, so the aborted episode is alone in its group (advantage 0)
    assert td["advantage"].tolist() == pytest.approx([0.375, -0.375, 0.0, 0.0])
    assert td["loss_mask"][:3].any(dim=1).all() and not td["loss_mask"][3].any()
    rloo = episode.assign_advantages(episode.pack(episodes()), "rloo")  # one episode left: 0, not an error
    assert rloo["advantage"][2:].tolist() == [0.0, 0.0] and rloo["advantage"][0] > 0


def test_staleness_per_token():
    td = episode.pack(episodes())
    lag = episode.staleness(td, current_version=5)
    assert lag[0].tolist() == [0, 0, 0, 2, 1, 0, 0, 1]  # env tokens have no lag
    assert lag[1].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert lag.amax(dim=1).tolist() == [2, 1, 0, 0]  # each episode's oldest model token


def test_a_game_group_whose_episodes_failed_before_any_turn_concats_with_played_ones():
    """A game's reset raising for a group's record fails every episode before any thread: that
    group packs without `model`, and the batch it joins still forms, its rows the policy's."""
    played = Episode(0, 0, [], "stop", threads=[Episode(0, 0, [env([5]), model([8], [-0.1], [3])], "stop", model=1)])
    failed = Episode(1, 4, [env([1])], "failed")
    a, b = episode.pack([played]), episode.pack([failed])
    assert "model" in a.keys() and "model" not in b.keys()
    both = episode.concat([a, b])
    assert both["model"].tolist() == [1, 0] and both["finish_reason"][1] == FINISH_REASONS["failed"]


def test_self_plays_roles_take_their_baselines_apart():
    """One model playing proposer and solver (task:propose with `models: []`): its rows were one
    baseline group, so a proposal rewarded as well as a proposal can be (0.2, under the solver's
    up to 1) trained as a bad one. Each role's threads are measured against their own."""

    def game(solver_rewards, proposer=0.2, sample=0):
        proposal = Episode(0, sample * 8, [env([1]), model([5], [-0.1], [0], reward=proposer)], role="proposer")
        solves = [Episode(0, sample * 8 + 1 + i, [env([2]), model([6], [-0.1], [0], reward=r)], role="solver") for i, r in enumerate(solver_rewards)]
        return Episode(0, sample, [], threads=[proposal, *solves])

    td = episode.assign_advantages(episode.pack([game([1, 1, 0, 1]), game([0, 1, 1, 1], sample=1)]), "grpo")
    proposers = td["role"] == episode.role_key("proposer")
    assert proposers.sum() == 2 and td["advantage"][proposers].tolist() == [0.0, 0.0]  # tied among proposers
    solvers = td["advantage"][~proposers]
    assert solvers.sum().abs() < 1e-5 and (solvers[td["reward"][~proposers] == 1] > 0).all()
    # a group whose proposers tie and whose solvers tie carries no signal, whatever the two roles' gap
    assert episode.without_signal(episode.pack([game([1, 1, 1, 1]), game([1, 1, 1, 1], sample=1)]))
    assert not episode.without_signal(episode.pack([game([1, 1, 1, 1]), game([1, 1, 1, 1], proposer=0.6, sample=1)]))
    # a group without roles (every env's, a game's before them) is read as one role
    old = episode.pack([game([1, 1, 0, 1])]).exclude("role")
    assert episode.concat([old, td])["role"][:5].tolist() == [0] * 5


def test_concat_pads_to_widest():
    a = episode.pack(episodes()[2:3])  # 2 tokens
    b = episode.pack(episodes()[:1])  # 8 tokens
    assert a["tokens"].shape == (1, 2)
    both = episode.concat([a, b])
    assert both["tokens"].shape == (2, 8) and both.batch_size == torch.Size([2])
    assert both["tokens"][0].tolist() == [1, 2, 0, 0, 0, 0, 0, 0]
    assert both["versions"][0].tolist() == [PAD_VERSION, 5] + [PAD_VERSION] * 6
    assert both["loss_mask"][0].tolist() == [False, True] + [False] * 6
    assert both["tokens"][1].tolist() == b["tokens"][0].tolist()
    assert both["reward"].tolist() == [2.0, 0.75]
    with_experts = episodes()[2:3]
    with_experts[0].turns[1].routed_experts = torch.tensor([[[1, 2]]])
    with pytest.raises(ValueError, match="different keys"):
        episode.concat([episode.pack(with_experts), b.clone().set("extra", torch.zeros(1))])


def test_a_group_with_no_model_turn_joins_a_batch_whose_turns_carry_routing_and_a_teachers_scores():
    """Every prompt of a group too long for a turn (or every reset failed): its rows carry no
    MoE routing and no teacher's scores. The batch still forms (the trainer's step had failed
    and its groups were lost): routed live (-1), a teacher's 0 on no loss token. A group whose
    model tokens lack a teacher's scores still cannot join one that has them."""
    played = episodes()[2:3]
    played[0].turns[1].routed_experts = torch.tensor([[[1, 2]]])
    played[0].turns[1].teacher_logprobs = [-0.3]
    none = Episode(1, 4, [env([1, 2, 3])], "length")
    a, b = episode.pack(played), episode.pack([none])
    assert {"routed_experts", "teacher_logprobs"} <= set(a.keys()) and not {"routed_experts", "teacher_logprobs"} & set(b.keys())
    both = episode.concat([a, b])
    assert both["routed_experts"].shape == (2, 3, 1, 2) and (both["routed_experts"][1] == -1).all()
    assert both["teacher_logprobs"][1].tolist() == [0.0] * 3 and not both["loss_mask"][1].any()
    with pytest.raises(ValueError, match="different keys"):
        episode.concat([a, episode.pack(episodes()[:1])])  # model tokens, and no teacher's scores


def test_trim_cuts_columns_no_model_token_uses():
    eps = episodes()
    td = episode.pack([eps[2], eps[3]])  # the failed episode ends on an env token
    assert td["tokens"].shape == (2, 4)
    trimmed = episode.trim(td)
    assert trimmed["tokens"].shape == (2, 3)
    assert trimmed["tokens"].tolist() == [[1, 2, 0], [1, 3, 4]]
    for key in ("loss_mask", "sampler_logprobs", "versions", "dense_reward"):
        assert torch.equal(trimmed[key], td[key][:, :3]), key
    for key in ("reward", "group_id", "prompt_len"):
        assert torch.equal(trimmed[key], td[key]), key
    # a batch of wide and narrow rows: a micro-batch of the narrow ones is cut to their width
    wide = episode.pack(eps)
    assert episode.trim(wide[torch.tensor([2, 3])])["tokens"].shape == (2, 3)
    assert episode.trim(wide)["tokens"].shape == wide["tokens"].shape
    # no model token at all: one column is kept
    assert episode.trim(episode.pack([Episode(0, 0, [env([1, 2])], "failed")]))["tokens"].shape == (1, 1)
