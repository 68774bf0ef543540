"""The environment protocol: what a rollout worker talks to between two model turns.

    obs = await env.reset(sample)                 # the prompt: text, chat messages or token ids
    while True:
        turn = <the model's reply to everything so far>
        result = await env.step(turn)             # observation, reward, done, info
        if result.done: break
        <result.observation is appended to the episode, then the model speaks again>

An observation is a plain string (tokenized as is), a list of chat messages (rendered by
the tokenizer's chat template) or a list of token ids (appended as they are). Methods may
be sync or async; a rollout worker bounds every call by `rollout.env_timeout_s`, and an
env that raises or times out fails its episode (reward 0), not the run.

An env may also hold a `max_new_tokens` attribute: the token budget of the next model turn
(None or absent: `generator.max_new_tokens`, which also caps it). Setting it in `reset` and
`step` gives each turn its own budget. A single-turn env takes it from the record's
`max_new_tokens` field, so a data row can carry its own budget.

A user's env is any class with these two methods, named by import path in YAML
(`rollout.env: mypkg.envs:MazeEnv`, constructed with `rollout.env_args`); one instance
plays one episode. Single-turn tasks and reward functions run as a `SingleTurnEnv`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Union, runtime_checkable

Message = dict[str, Any]
Observation = Union[str, list[Message], list[int]]
RewardFn = Callable[[str, str, dict], Union[float, Awaitable[float]]]
"""(prompt text, response text, sample) -> reward; sync or async."""


@dataclass
class ModelTurn:
    """What the model said in one turn, as the env sees it."""

    text: str
    """The sampled tokens decoded, special tokens skipped."""
    token_ids: list[int]
    """The sampled ids, exactly (never re-tokenized)."""
    finish_reason: str
    """`stop` (end-of-turn token), `length` (token budget) or `abort`."""
    index: int = 0
    """0 for the episode's first model turn, 1 for the next, ..."""


@dataclass
class StepResult:
    observation: Observation | None = None
    """What the env says next (ignored when done)."""
    reward: float = 0.0
    """Reward for this turn; the episode's reward is the sum over its turns."""
    done: bool = True
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form; `tool_calls` (an int) is counted in the episode metrics."""


@runtime_checkable
class Env(Protocol):
    def reset(self, sample: dict) -> Observation | Awaitable[Observation]: ...

    def step(self, turn: ModelTurn) -> StepResult | Awaitable[StepResult]: ...


async def call_bounded(fn: Callable, *args: Any, timeout: float) -> Any:
    """Call a sync or async function with a time limit. A sync function runs in a thread,
    so a slow one cannot stall the worker's event loop (on timeout it is abandoned)."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(*args), timeout)
    result = await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout)
    if inspect.isawaitable(result):
        result = await asyncio.wait_for(result, timeout)
    return result


def prompt_text(observation: Observation) -> str:
    """A prompt as plain text for reward functions: the last user message of a chat."""
    if isinstance(observation, str):
        return observation
    if observation and isinstance(observation[0], dict):
        users = [m.get("content", "") for m in observation if m.get("role") == "user"]
        return str(users[-1]) if users else ""
    return ""


class SingleTurnEnv:
    """One prompt, one model turn, one reward: every single-turn task and reward function.

    `reset` hands out `sample["prompt"]` (text or chat messages), and the record's
    `max_new_tokens` (if any) budgets the reply; `step` scores the reply with
    `reward_fn(prompt, response, sample)`, where `sample` also carries the reference answer,
    the task's extra fields, `finish_reason` and `response_ids`.
    """

    def __init__(self, reward_fn: RewardFn, timeout_s: float = 30.0):
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s

    async def reset(self, sample: dict) -> Observation:  # a coroutine: no thread hop for a dict lookup
        self.sample = sample
        self.max_new_tokens = sample.get("max_new_tokens")
        return sample["prompt"]

    async def step(self, turn: ModelTurn) -> StepResult:
        sample = {**self.sample, "finish_reason": turn.finish_reason, "response_ids": turn.token_ids}
        value = await call_bounded(self.reward_fn, prompt_text(self.sample["prompt"]), turn.text, sample, timeout=self.timeout_s)
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"reward is {value}")
        return StepResult(reward=value, done=True)
