"""Rewards for single-turn tasks: reward functions and reward models behind one signature.

A reward function is any Python callable `(prompt: str, response: str, sample: dict) ->
float`, sync or async, given by import path (`scoring.reward_fn`) or passed in code.
`sample` carries the reference answer and the task's extra fields. A `reasoning_gym:`
source is scored by its task's own verifier (meshrl/verifiers.py). A reward model
(`scoring.reward_model`, a local Hugging Face sequence-classification checkpoint) is
wrapped into the same signature. The run's reward becomes the `SingleTurnEnv` every
episode plays (meshrl/rollout/env.py), which bounds each call by `scoring.timeout_s`: a
call that raises or times out fails its episode (reward 0), is counted, and the run goes on.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from meshrl.config import Config, source_kind
from meshrl.imports import import_callable
from meshrl.rollout.env import RewardFn
from meshrl.tasks import get_task


def reward_model_fn(path: str) -> RewardFn:
    """A reward model checkpoint as a reward function, in the rollout worker: the score of
    its single-logit head, on the input a reward-model scorer renders (its tokenizer's chat
    template; meshrl/scorers/backends.py). `scoring.scorers` runs one on procs of its own."""
    from meshrl.scorers.backends import RewardModel
    from meshrl.scorers.client import scoring_item

    rm = RewardModel(path, device="cpu")

    def score(prompt: str, response: str, sample: dict) -> float:
        item = scoring_item({**sample, "prompt": sample.get("prompt", prompt)}, response)  # a chat record: all of its messages
        with torch.no_grad():
            return float(rm.forward([rm.encode(item, response)])[0])

    return score


def resolve_reward(config: Config, reward_fn: RewardFn | None = None) -> RewardFn:
    """The run's reward: passed in code, else scoring.reward_model, scoring.reward_fn, or the
    task's own (a built-in task's exact rule, a reasoning-gym task's verifier)."""
    if reward_fn is not None:
        return reward_fn
    if config.scoring.reward_model:
        return reward_model_fn(config.scoring.reward_model)
    if config.scoring.reward_fn:
        return import_callable(config.scoring.reward_fn)
    if source_kind(config.data.source) == "reasoning_gym":
        from meshrl.verifiers import reasoning_gym_reward

        return reasoning_gym_reward(config)
    return inline(get_task(config.data.source.removeprefix("task:")).reward)


def inline(reward: Callable[..., float]) -> RewardFn:
    """A built-in task's reward as a coroutine function: it is exact and takes microseconds,
    so it runs on the worker's event loop instead of a thread hop per episode (a user's
    sync reward function, which may be slow, still runs in a thread)."""

    @functools.wraps(reward)  # keeps the name, and the function as __wrapped__
    async def score(prompt: str, response: str, sample: dict) -> float:
        return reward(prompt, response, sample)

    return score
