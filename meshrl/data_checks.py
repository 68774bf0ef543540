"""The data source's checks that read no rows: a prompt source checked whole in one place.

`check_data` asks what a config's values cannot show alone: that a `task:` source names a
built-in task (and a multi-turn one gets its reward from its env), that a `reasoning_gym:`
task exists with the arguments given, that a file or `datasets` directory is there, that
something scores it, and that a longtail tail fits the generation budget; `check_eval_source`
the same of `eval.source`. The rows themselves are read by meshrl/data.py (`check_records`),
at preflight. These live beside data.py rather than in it because data.py brings torch
(its `PromptNode` is a torchdata node), and `meshrl config show` runs these without it.
"""

from __future__ import annotations

import os

from meshrl.config import Config, ConfigError, source_kind
from meshrl.imports import missing_extra
from meshrl.tasks import TASKS, answer_budget


def check_data(c: Config) -> None:
    """data.source exists, its package is installed, something scores it, and a longtail
    tail fits the generation budget."""
    d, s = c.data, c.scoring
    if d.source in ("task:longtail", "task:longtail_chat"):
        _check_budget(c)
    _check_source(c, "data.source", d.source, d.task_args)
    if source_kind(d.source) == "task":
        name = d.source.removeprefix("task:")
        if TASKS[name].env is not None and c.rollout.env is None:
            if s.reward_fn or s.reward_model:
                raise ConfigError(
                    "scoring.reward_fn", f"task:{name} is multi-turn and its env gives the reward: unset scoring.reward_fn / reward_model, or set rollout.env"
                )
    elif source_kind(d.source) in ("file", "dataset"):
        if s.reward_fn is None and s.reward_model is None and c.rollout.env is None:
            raise ConfigError(
                "scoring.reward_fn", f"a file data source ({d.source}) needs a reward: set scoring.reward_fn, scoring.reward_model or rollout.env"
            )


def check_eval_source(c: Config) -> None:
    """eval.source, when set, exists and its package is installed; with several trained
    models, it is no game (the policy plays it alone)."""
    if c.eval.source is not None:
        _check_source(c, "eval.source", c.eval.source, c.eval.task_args)
        name = c.eval.source.removeprefix("task:")
        if c.models and source_kind(c.eval.source) == "task" and TASKS[name].game:
            raise ConfigError("eval.source", f"task:{name} is a game of several models: evaluate the policy alone on a task of its own (e.g. task:digits)")


def _check_source(c: Config, path: str, source: str, task_args: dict) -> None:
    """A prompt source that exists and whose package is installed."""
    kind = source_kind(source)
    if kind == "task":
        name = source.removeprefix("task:")
        if name not in TASKS:
            raise ConfigError(path, f"unknown built-in task {name!r}: use one of {', '.join('task:' + t for t in TASKS)}")
    elif kind == "reasoning_gym":
        problem = missing_extra("reasoning_gym")
        if problem is not None:
            raise ConfigError(path, f"{source} {problem}")
        from reasoning_gym.factory import DATASETS

        name = source.removeprefix("reasoning_gym:")
        if name not in DATASETS:
            raise ConfigError(path, f"reasoning-gym has no task {name!r}: see reasoning_gym.factory.DATASETS (e.g. basic_arithmetic, chain_sum, leg_counting)")
        from meshrl.data import reasoning_gym_dataset

        reasoning_gym_dataset(name, task_args, c.seed, 1, path.replace("source", "task_args"))  # bad ones: a ConfigError naming them
    elif kind == "file":
        if not os.path.isfile(source):
            raise ConfigError(path, f"file {source!r} not found: give a local .jsonl or .parquet file")
    else:
        if not os.path.isdir(source):
            raise ConfigError(path, f"{source!r} must be 'task:NAME', 'reasoning_gym:NAME', a .jsonl/.parquet file or a datasets save_to_disk directory")
        if not (os.path.isfile(os.path.join(source, "dataset_info.json")) or os.path.isfile(os.path.join(source, "dataset_dict.json"))):
            raise ConfigError(path, f"directory {source!r} is not a datasets save_to_disk directory (no dataset_info.json): save it with Dataset.save_to_disk")


def _check_budget(c: Config) -> None:
    """The longtail tasks' longest answer must fit the generation budget and the context
    (the tail's own ranges are checked with the values, in config/checks.py)."""
    n = c.data.lengths
    budget = answer_budget(n.max, n.slack)
    if c.generator.max_new_tokens < budget:
        raise ConfigError(
            "generator.max_new_tokens",
            f"must be at least {budget} (the budget of the longest longtail answer, data.lengths.max x (1 + slack) + 2), got {c.generator.max_new_tokens}; "
            "raise it or lower data.lengths.max",
        )
    if c.model.max_seq_len < budget + 16:
        raise ConfigError(
            "model.max_seq_len", f"must be at least {budget + 16} (the longest longtail answer's budget plus its prompt), got {c.model.max_seq_len}"
        )
