"""Scoring: reward functions and reward models behind one interface, in a scorer actor.

A reward function is any Python callable `(prompt: str, response: str, sample: dict) ->
float`, sync or async, given by import path (`scoring.reward_fn`) or passed in code.
`sample` carries the reference answer and the task's extra fields. A reward model
(`scoring.reward_model`, a local Hugging Face sequence-classification checkpoint) is
wrapped into the same signature. A call that raises or exceeds `scoring.timeout_s` marks
that sample `failed` with reward 0; it is counted and logged, and the run goes on.

The scorer is the generators' sink: it scores each finished group, computes group
advantages, and puts the group into the replay buffer (whose backpressure then reaches
the generators), then tells the prompt source the group has landed.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import time
from typing import Any, Awaitable, Callable

import torch
from monarch.actor import Actor, concurrent_endpoint
from tensordict import TensorDict

from meshrl import rollout
from meshrl.config import Config
from meshrl.rollout import Completion
from meshrl.tasks import get_task

RewardFn = Callable[[str, str, dict], float | Awaitable[float]]
log = logging.getLogger(__name__)


def import_callable(path: str) -> Callable:
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"cannot import reward function {path!r}: {e}") from None


def reward_model_fn(path: str) -> RewardFn:
    """A reward model checkpoint as a reward function: the score of the single-logit head."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).eval()

    def score(prompt: str, response: str, sample: dict) -> float:
        with torch.no_grad():
            ids = tok(prompt + response, return_tensors="pt")
            return float(model(**ids).logits[0, 0])

    return score


def resolve_reward(config: Config, reward_fn: RewardFn | None = None) -> RewardFn:
    """The run's reward: passed in code, else scoring.reward_model, scoring.reward_fn, or the task's own."""
    if reward_fn is not None:
        return reward_fn
    if config.scoring.reward_model:
        return reward_model_fn(config.scoring.reward_model)
    if config.scoring.reward_fn:
        return import_callable(config.scoring.reward_fn)
    return get_task(config.data.source.removeprefix("task:")).reward


async def call_reward(fn: RewardFn, prompt: str, response: str, sample: dict, timeout: float) -> float:
    """One bounded reward call. Raises on error, timeout or a non-finite value."""
    if inspect.iscoroutinefunction(fn):
        value = await asyncio.wait_for(fn(prompt, response, sample), timeout)
    else:
        # A sync function runs in a thread; on timeout the thread is abandoned, not killed.
        value = await asyncio.wait_for(asyncio.to_thread(fn, prompt, response, sample), timeout)
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward is {value}")
    return value


class Scorer:
    """Turns one group of completions into a scored rollout TensorDict."""

    def __init__(self, config: Config, tokenizer_dir: str, reward_fn: RewardFn | None = None):
        from meshrl.tokenizer import load_tokenizer

        self.config = config
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.reward_fn = resolve_reward(config, reward_fn)
        self.window: list[dict[str, float]] = []  # per-sample stats since the last metrics()
        self.failures = 0

    async def score_group(self, completions: list[Completion]) -> TensorDict:
        texts = [
            (self.tokenizer.decode(c.prompt_ids), self.tokenizer.decode(c.response_ids, skip_special_tokens=True))
            for c in completions
        ]
        results = await asyncio.gather(
            *(self._score_one(c, prompt, response) for c, (prompt, response) in zip(completions, texts))
        )
        for c, reward in zip(completions, results):
            c.reward = reward
        td = rollout.from_completions(completions)
        return rollout.assign_advantages(td, self.config.trainer.loss.advantage)

    async def _score_one(self, c: Completion, prompt: str, response: str) -> float:
        sample = {**c.extra, "finish_reason": c.finish_reason, "prompt_ids": c.prompt_ids, "response_ids": c.response_ids}
        try:
            reward = await call_reward(self.reward_fn, prompt, response, sample, self.config.scoring.timeout_s)
            failed = False
        except Exception as e:  # noqa: BLE001 - any user error marks the sample failed
            kind = "timed out" if isinstance(e, (asyncio.TimeoutError, TimeoutError)) else f"raised {type(e).__name__}: {e}"
            log.warning("reward for sample %d (group %d) %s; marked failed", c.sample_id, c.group_id, kind)
            c.finish_reason = "failed"
            self.failures += 1
            reward, failed = 0.0, True
        self.window.append({
            "reward": reward, "success": float(reward >= 1.0 and not failed),
            "failed": float(failed), "response_len": float(len(c.response_ids)),
        })
        return reward

    def metrics(self) -> dict[str, float]:
        """Reward statistics since the last call."""
        window, self.window = self.window, []
        if not window:
            return {"scoring/failed_total": float(self.failures)}
        rewards = torch.tensor([w["reward"] for w in window])
        return {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(window) > 1 else 0.0,
            "reward/success_rate": sum(w["success"] for w in window) / len(window),
            "response/length_mean": sum(w["response_len"] for w in window) / len(window),
            "scoring/failed": sum(w["failed"] for w in window),
            "scoring/failed_total": float(self.failures),
            "scoring/samples": float(len(window)),
        }


class ScorerActor(Actor):
    """The generators' sink: scores a group, puts it in the buffer, acknowledges the source."""

    def __init__(self, config: dict, tokenizer_dir: str, buffer: Any, source: Any, reward_fn: RewardFn | None = None):
        self.config = Config.from_dict(config)
        self.scorer = Scorer(self.config, tokenizer_dir, reward_fn)
        self.buffer, self.source = buffer, source
        self.score_s = 0.0

    @concurrent_endpoint
    async def put_completions(self, completions: list[Completion]) -> bool:
        group_id = completions[0].group_id
        await self.source.received.call_one([group_id])  # ours now, whatever befalls the generator
        t0 = time.monotonic()
        group = await self.scorer.score_group(completions)
        self.score_s += time.monotonic() - t0
        accepted = await self.buffer.put.call_one(group, self.config.buffer.put_timeout_s)
        await self.source.acknowledge.call_one([group_id])
        return accepted

    @concurrent_endpoint
    async def metrics(self) -> dict[str, float]:
        return {**self.scorer.metrics(), "scoring/busy_s": self.score_s}
