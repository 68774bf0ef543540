"""The rollout batch format and its helpers, against direct computations."""

import math
import statistics

import pytest
import torch

from meshrl import rollout
from meshrl.rollout import Completion


def completions():
    return [
        Completion([5, 6, 7], [8, 9], [-0.1, -0.2], [3, 4], "stop", group_id=0, sample_id=0, reward=1.0),
        Completion([5, 6], [8, 9, 10, 11], [-0.3, -0.4, -0.5, -0.6], [4, 4, 4, 5], "length", 0, 1, reward=0.0),
        Completion([1], [2], [-1.0], [5], "abort", 1, 2, reward=2.0),
        Completion([1], [], [], [], "failed", 1, 3, reward=0.0),
    ]


def test_from_completions_layout():
    td = rollout.from_completions(completions())
    assert td.batch_size == torch.Size([4])
    assert td["prompt_ids"].shape == (4, 3) and td["response_ids"].shape == (4, 4)
    assert td["prompt_mask"].sum(1).tolist() == [3, 2, 1, 1]
    assert td["response_mask"].sum(1).tolist() == [2, 4, 1, 0]
    assert td["versions"][0].tolist() == [3, 4, -1, -1]
    assert td["sampler_logprobs"][1].tolist() == pytest.approx([-0.3, -0.4, -0.5, -0.6])
    assert td["finish_reason"].tolist() == [0, 1, 2, 3]
    assert rollout.group_slices(td) == [slice(0, 2), slice(2, 4)]


def test_mismatched_lengths_rejected():
    with pytest.raises(ValueError, match="logprobs"):
        Completion([1], [2, 3], [-1.0], [0, 0], "stop", 0, 0)


def test_optional_routed_experts_and_sampling_mask():
    cs = completions()[:2]
    cs[0].routed_experts = torch.tensor([[[0, 1]], [[2, 3]]])  # R=2, L=1, K=2
    cs[1].routed_experts = torch.tensor([[[1, 0]]] * 4)
    cs[0].sampling_kept = [3, 4]
    td = rollout.from_completions(cs)
    assert td["routed_experts"].shape == (2, 4, 1, 2)
    assert td["routed_experts"][0, 2].tolist() == [[-1, -1]]
    assert td["sampling_kept"][0].tolist() == [3, 4, 0, 0]
    packed = rollout.pack_for_trainer(td)
    assert packed["routed_experts"][0, 3].tolist() == [[0, 1]]  # first response token sits at position 3


@pytest.mark.parametrize("mode", ["grpo", "grpo_no_std", "rloo"])
def test_group_advantages_against_direct_formula(mode):
    rewards = [1.0, 0.0, 3.0, 2.0, 2.0, 5.0, 5.0]
    groups = [0, 0, 0, 1, 1, 2, 2]
    adv = rollout.group_advantages(torch.tensor(rewards), torch.tensor(groups), mode).tolist()
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


def test_staleness_per_token_and_sequence():
    td = rollout.from_completions(completions())
    lag = rollout.staleness(td, current_version=5)
    assert lag[0].tolist() == [2, 1, 0, 0]
    assert lag[1].tolist() == [1, 1, 1, 0]
    assert rollout.sequence_staleness(td, 5).tolist() == [2, 1, 0, 0]


def test_pack_for_trainer_and_back():
    td = rollout.from_completions(completions())
    td = rollout.assign_advantages(td, "grpo")
    packed = rollout.pack_for_trainer(td)
    assert packed["tokens"][0].tolist() == [5, 6, 7, 8, 9, 0]
    assert packed["tokens"][1].tolist() == [5, 6, 8, 9, 10, 11]
    assert packed["loss_mask"][1].tolist() == [False, False, True, True, True, True]
    assert packed["versions"][0].tolist() == [-1, -1, -1, 3, 4, -1]
    assert packed["response_start"].tolist() == [3, 2, 1, 1]
    assert torch.equal(rollout.unpack_token_values(packed["sampler_logprobs"], td), td["sampler_logprobs"])


def test_concat_pads_to_widest():
    a = rollout.from_completions(completions()[:1])
    b = rollout.from_completions(completions()[1:2])
    both = rollout.concat([a, b])
    assert both["response_ids"].shape == (2, 4)
    assert both["versions"][0].tolist() == [3, 4, -1, -1]
    assert both["prompt_mask"][1].tolist() == [True, True, False]
