"""On-policy distillation: a teacher scores the student's own episodes, token by token.

The student samples episodes exactly as in RL. A teacher model (a generator replica started
on the teacher's checkpoint, never updated: `GeneratorActor.setup(..., teacher=True)`,
then `score_many`) gives the log-prob of every token of each finished episode given the
tokens before it. Each model token t then gets its own advantage

    A_t = kl_weight * (log pi_teacher(x_t) - log mu(x_t)) + reward_weight * A_group

where mu is the student's sampler (the log-prob recorded when the token was drawn) and
A_group the task reward's group advantage (`assign_advantages`). The first term is the
negative per-token reverse KL estimate: sampling from mu and pushing log pi_student up
where the teacher likes the token more than the student did minimises KL(student ||
teacher) along the student's own trajectories, with no reward needed. The usual policy
loss (meshrl/trainer/losses.py) trains on A_t, with its off-policy corrections for the
student's sampler-trainer gap unchanged.

The reverse-KL term uses the sampler's log-prob, not the trainer's: it is what the token
was drawn with, so its per-token estimate is unbiased for the sampled trajectory, and it
is known before the batch reaches the trainer. Both sides are at generator.temperature:
the sampler draws there, and a teacher replica scores there (see
`VLLMEngine.set_logit_temperature`).

Flow in a rollout worker, per group:

    rows = [r for e in episodes for r in e.rows if r.model == 0]      # a game's: the policy's threads
    scores = await teacher.score_many.call_one([r.token_ids for r in rows])
    for r, s in zip(rows, scores): attach_teacher_logprobs(r, s)       # str: a failed score
    group = assign_distill_advantages(pack(episodes), kl_weight, reward_weight, mode)

In a game (docs/coevolve.md) the student is the policy: the teacher scores the policy's
threads, and the other models' rows train on their group advantages as without a teacher.

The trainer reports `trainer/distill_reverse_kl`, the token mean of log mu - log pi_teacher
over each trained batch: an estimate of KL(student || teacher) along the student's samples.
"""

from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDict

from meshrl.episode import FINISH_REASONS, Episode, assign_advantages, row_models


def attach_teacher_logprobs(episode: Episode, scores: Sequence[float]) -> Episode:
    """Give each model turn of `episode` its slice of `scores`, the teacher's log-prob of
    every token of `episode.token_ids` (position 0 unused: nothing predicts it). In place."""
    if len(scores) != len(episode):
        raise ValueError(f"episode {episode.sample_id}: {len(episode)} tokens but {len(scores)} teacher scores")
    at = 0
    for turn in episode.turns:
        n = len(turn.token_ids)
        if turn.role == "model":
            turn.teacher_logprobs = [float(x) for x in scores[at : at + n]]
        at += n
    return episode


def assign_distill_advantages(td: TensorDict, kl_weight: float, reward_weight: float, mode: str | Sequence[str]) -> TensorDict:
    """Fill `advantage` (the task's group advantage, as `assign_advantages`) and the
    per-token `token_advantage` [B, T] the loss then trains on (in place; returns td):

        token_advantage = kl_weight * (teacher_logprobs - sampler_logprobs) + reward_weight * advantage

    on loss tokens, 0 elsewhere. A failed episode leaves the loss as in `assign_advantages`.
    In a game the teacher distills the policy alone: the rows of the other models keep their
    group advantage, `token_advantage = advantage`. A batch with no `teacher_logprobs` is
    accepted only when every row of the policy failed (none was worth scoring): it gets
    zeros, so that it concatenates with scored batches."""
    failed = td["finish_reason"] == FINISH_REASONS["failed"]
    student = row_models(td) == 0
    if "teacher_logprobs" not in td.keys():
        if not bool((failed | ~student).all()):
            raise ValueError("assign_distill_advantages needs teacher_logprobs: attach the teacher's scores before pack")
        td["teacher_logprobs"] = torch.zeros_like(td["sampler_logprobs"])
    assign_advantages(td, mode)
    mask = td["loss_mask"]
    gap = td["teacher_logprobs"] - td["sampler_logprobs"]
    distilled = kl_weight * gap + reward_weight * td["advantage"][:, None]
    per_token = torch.where(student[:, None], distilled, td["advantage"][:, None].expand_as(distilled))
    td["token_advantage"] = torch.where(mask, per_token, torch.zeros_like(per_token)).to(torch.float32)
    return td
