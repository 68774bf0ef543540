"""Which env plays an episode: training's (`rollout.env`, a task's own, or a single turn around the
run's reward) and evaluation's (an eval source that brings its own env or verifier)."""

from __future__ import annotations

from meshrl.config import Config
from meshrl.rollout.env import SingleTurnEnv


def env_factory(config: Config, reward_fn=None):
    """() -> a fresh Env per episode: `rollout.env`, else the task's own env, else a
    SingleTurnEnv around the run's reward (passed in code, scoring.*, or the task's)."""
    from meshrl.rollout.env import env_maker
    from meshrl.scoring import resolve_reward
    from meshrl.tasks import get_task

    if config.rollout.env:
        return env_maker(config)
    if config.data.source.startswith("task:") and reward_fn is None:
        task = get_task(config.data.source.removeprefix("task:"))
        if task.env is not None:
            return lambda: task.env(config)
    reward = resolve_reward(config, reward_fn)
    return lambda: SingleTurnEnv(reward, config.scoring.timeout_s)


def eval_view(config: Config) -> Config:
    """The config as evaluation plays it: a `task:` or `reasoning_gym:` eval.source brings its
    own env or verifier (the run's env, reward function and reward model are not its); any
    other eval source is scored like the training data."""
    import dataclasses

    from meshrl.config import source_kind

    source = config.eval.source
    if source is None or source_kind(source) not in ("task", "reasoning_gym"):
        return config
    own = dataclasses.replace(config.scoring, reward_fn=None, reward_model=None)
    data = dataclasses.replace(config.data, source=source, task_args=config.eval.task_args)
    return dataclasses.replace(config, data=data, scoring=own, rollout=dataclasses.replace(config.rollout, env=None))
