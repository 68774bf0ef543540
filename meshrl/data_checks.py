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

from meshrl.config import Config, source_kind
from meshrl.config.loading import need
from meshrl.imports import missing_extra
from meshrl.tasks import TASKS, answer_budget


def check_data(c: Config) -> None:
    """data.source exists, its package is installed, something scores it, and a longtail
    tail fits the generation budget."""
    d, s = c.data, c.scoring
    _check_source(c, "data.source", d.source, d.task_args)
    if source_kind(d.source) == "task":
        name = d.source.removeprefix("task:")
        if TASKS[name].env is not None and c.rollout.env is None:
            need(
                not (s.reward_fn or s.reward_model),
                "scoring.reward_fn",
                f"task:{name} is multi-turn and its env gives the reward: unset scoring.reward_fn / reward_model, or set rollout.env",
            )
    elif source_kind(d.source) in ("file", "dataset"):
        need(
            s.reward_fn is not None or s.reward_model is not None or c.rollout.env is not None,
            "scoring.reward_fn",
            f"a file data source ({d.source}) needs a reward: set scoring.reward_fn, scoring.reward_model or rollout.env",
        )
    if d.source in ("task:longtail", "task:longtail_chat"):
        _check_budget(c)


def check_eval_source(c: Config) -> None:
    """eval.source, when set, exists and its package is installed."""
    if c.eval.source is not None:
        _check_source(c, "eval.source", c.eval.source, c.eval.task_args)


def _check_source(c: Config, path: str, source: str, task_args: dict) -> None:
    """A prompt source that exists and whose package is installed."""
    kind = source_kind(source)
    if kind == "task":
        name = source.removeprefix("task:")
        need(name in TASKS, path, f"unknown built-in task {name!r}: use one of {', '.join('task:' + t for t in TASKS)}")
    elif kind == "reasoning_gym":
        problem = missing_extra("reasoning_gym")
        need(problem is None, path, f"{source} {problem}")
        from reasoning_gym.factory import DATASETS

        name = source.removeprefix("reasoning_gym:")
        need(name in DATASETS, path, f"reasoning-gym has no task {name!r}: see reasoning_gym.factory.DATASETS (e.g. basic_arithmetic, chain_sum, leg_counting)")
        from meshrl.data import reasoning_gym_dataset

        reasoning_gym_dataset(name, task_args, c.seed, 1, path.replace("source", "task_args"))  # bad ones: a ConfigError naming them
    elif kind == "file":
        need(os.path.isfile(source), path, f"file {source!r} not found: give a local .jsonl or .parquet file")
    else:
        need(os.path.isdir(source), path, f"{source!r} must be 'task:NAME', 'reasoning_gym:NAME', a .jsonl/.parquet file or a datasets save_to_disk directory")
        need(
            os.path.isfile(os.path.join(source, "dataset_info.json")) or os.path.isfile(os.path.join(source, "dataset_dict.json")),
            path,
            f"directory {source!r} is not a datasets save_to_disk directory (no dataset_info.json): save it with Dataset.save_to_disk",
        )


def _check_budget(c: Config) -> None:
    """The longtail tasks' longest answer must fit the generation budget and the context
    (the tail's own ranges are checked with the values, in config/checks.py)."""
    n = c.data.lengths
    budget = answer_budget(n.max, n.slack)
    need(
        c.generator.max_new_tokens >= budget,
        "generator.max_new_tokens",
        f"must be at least {budget} (the budget of the longest longtail answer, data.lengths.max x (1 + slack) + 2), got {c.generator.max_new_tokens}; "
        "raise it or lower data.lengths.max",
    )
    need(
        c.model.max_seq_len >= budget + 16,
        "model.max_seq_len",
        f"must be at least {budget + 16} (the longest longtail answer's budget plus its prompt), got {c.model.max_seq_len}",
    )
