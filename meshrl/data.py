"""Prompts: built-in or reasoning-gym tasks, JSONL/Parquet files or `datasets` directories; resumable.

The episode queue draws records through `PromptNode` (meshrl/queue/prompts.py), a torchdata
node over one source's records, shuffled per epoch with the run seed, whose state (epoch,
index) lets a resumed run continue exactly where it stopped; this module imports no torch,
so the checks before a run read rows without it. A record is a dict with `prompt` (text, or
a list of chat messages) and `answer`, plus whatever else the source holds; the episode
queue (meshrl/queue/) hands records out to rollout workers, whose env turns them into
episodes. Records cross actor boundaries, so they hold plain picklable, JSON-able values only.

A stored source is read row by row (`iter_rows`): every row must parse and hold its prompt,
and the first that does not is a `DataError` whose message is `FILE:LINE: what is wrong`
(LINE counts the file's lines for JSONL, rows from 1 for Parquet and `datasets`).
`check_source` runs that over a whole source, bounded in time, before any mesh starts
(`check_records`, at preflight: the first bad row is then a `ConfigError` of kind `data
error`); the episode queue meets the same error with the same line if a row past that
bound, or a generated record, is bad. The checks that read no rows come first, at preflight
and in `meshrl config show`: `check_data` (a `task:` source names a built-in task, and a
multi-turn one gets its reward from its env; a `reasoning_gym:` task exists with the
arguments given; a file or `datasets` directory is there; something scores it; a longtail
tail fits the generation budget) and `check_eval_source` (the same of `eval.source`).

Task and reasoning-gym sources are generated, never stored: record i of an epoch is a pure
function of (seed, epoch, i). That is what makes resuming exact without saving data, and
what gives evaluation (`eval_records`) a held-out stream: the same generator under a seed
string of its own, which no training epoch uses.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import random
import time
from typing import Any, Callable, Iterator

from meshrl.config import Config, ConfigError, DataConfig, source_kind
from meshrl.imports import missing_extra
from meshrl.tasks import TASKS, answer_budget, get_task


class DataError(ValueError):
    """A row that cannot be a record; the message is `FILE:LINE: what is wrong`."""


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
    if c.models and c.rollout.env is None and not (source_kind(d.source) == "task" and TASKS[d.source.removeprefix("task:")].game):
        raise ConfigError(
            "models",
            f"the models beside the policy speak in a game, and {d.source} is the policy's alone: "
            "set rollout.env to a game, a game task (task:propose), or no models",
        )
    if source_kind(d.source) in ("file", "dataset"):
        if s.reward_fn is None and s.reward_model is None and c.rollout.env is None:
            raise ConfigError(
                "scoring.reward_fn", f"a file data source ({d.source}) needs a reward: set scoring.reward_fn, scoring.reward_model or rollout.env"
            )


def check_eval_source(c: Config) -> None:
    """eval.source, when set, exists, its package is installed and it is not the training
    file itself; what is evaluated is no game task (the policy plays an evaluation alone, and a game's rewards are its threads')."""
    source = c.eval.source
    if source is not None:
        _check_source(c, "eval.source", source, c.eval.task_args)
        if source_kind(source) == "file" and os.path.realpath(source) == os.path.realpath(c.data.source):
            raise ConfigError(
                "eval.source", f"is data.source itself ({source}): held-out accuracy would be the training rows': give a file held out from training"
            )
    elif c.eval.every and c.rollout.env is None:
        source = c.data.source  # the training task's own held-out prompts
    name = (source or "").removeprefix("task:")
    if source is not None and source_kind(source) == "task" and TASKS[name].game:
        raise ConfigError("eval.source", f"task:{name} is a game: evaluate the policy alone on a task of its own (e.g. eval.source=task:digits)")


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


def load_records(cfg: DataConfig, held_out: bool = False, limit: int | None = None) -> list[dict[str, Any]] | None:
    """Records of a file or `datasets` source, in their stored order; None for a generated
    (task or reasoning-gym) source. DataError at the first bad row. `held_out`: of a `datasets`
    directory of several splits, the held-out one (`_saved_dataset`); `limit`: its first rows
    only (the rest neither read nor checked)."""
    kind = source_kind(cfg.source)
    if kind == "task":
        get_task(cfg.source.removeprefix("task:"))  # fail early on a bad name
        return None
    if kind == "reasoning_gym":
        return None
    rows = itertools.islice(iter_rows(cfg.source, held_out=held_out), limit)
    records = [_record(cfg, f"{cfg.source}:{n}", row) for n, row in rows]
    if not records:
        raise DataError(f"{cfg.source}: holds no records")
    return records


def iter_rows(source: str, batch_rows: int = 1024, held_out: bool = False) -> Iterator[tuple[int, Any]]:
    """(line or row number from 1, row) of a .jsonl / .parquet file or a `datasets`
    directory (its held-out split: `held_out`), streamed; a line that does not parse is a
    DataError naming it."""
    if source.endswith(".jsonl"):
        with open(source, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{source}:{n}: not UTF-8 text (byte {e.start + 1} of the line)") from None
                if not line.strip():
                    continue
                try:
                    yield n, json.loads(line.rstrip())
                except json.JSONDecodeError as e:
                    raise DataError(f"{source}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    elif source.endswith(".parquet"):
        import pyarrow.parquet as pq

        n = 0
        for batch in pq.ParquetFile(source).iter_batches(batch_size=batch_rows):
            for row in batch.to_pylist():
                n += 1
                yield n, row
    else:
        data = _saved_dataset(source, held_out)
        n = 0
        for batch in data.iter(batch_size=batch_rows):
            keys = list(batch)
            for values in zip(*(batch[k] for k in keys)):
                n += 1
                yield n, dict(zip(keys, values))


def check_source(cfg: DataConfig, time_limit_s: float, held_out: bool = False) -> tuple[dict | None, int, bool]:
    """Read a stored source row by row for at most `time_limit_s` s, each made a record as
    the queue will make it (`held_out`: an eval source's split, as `load_records`). Returns
    (the first record, rows checked, whether that was all of them); DataError at the first
    bad row. A generated source: (None, 0, True)."""
    if source_kind(cfg.source) not in ("file", "dataset"):
        return None, 0, True
    deadline = time.monotonic() + time_limit_s
    first, count = None, 0
    for n, row in iter_rows(cfg.source, held_out=held_out):
        record = _record(cfg, f"{cfg.source}:{n}", row)
        first = first if first is not None else record
        count += 1
        if count % 256 == 0 and time.monotonic() > deadline:
            return first, count, False
    if first is None:
        raise DataError(f"{cfg.source}: holds no records")
    return first, count, True


def check_records(c: Config) -> dict:
    """The data source's first record, a stored source's rows read first (bounded by
    contracts.data_check_s), and those of a stored eval.source when evaluation reads one;
    the first bad row a ConfigError (kind `data error`) `FILE:LINE: what is wrong`."""
    record = _first_record(c)
    if c.eval.every and c.eval.source is not None and source_kind(c.eval.source) in ("file", "dataset"):
        _first_record(dataclasses.replace(c, data=dataclasses.replace(c.data, source=c.eval.source)), held_out=True)
    return record


def check_prompt_room(c: Config, record: dict, tokenizer=None) -> None:
    """A single-turn run's first record (`record`): its prompt, rendered as a worker renders it
    with the policy's tokenizer (`tokenizer`: the one `check_tokenizer` loaded, else loaded
    here), and its answer budget fit `model.max_seq_len`. (An env renders
    its own observations: an episode whose first one leaves no room fails as it runs, naming
    the same fix, agent/worker.py.)"""
    import tempfile

    from meshrl.rollout.chat import ChatRenderer, prompt_too_long
    from meshrl.tokenizer import build_char_tokenizer, load_tokenizer

    m, source = c.model, c.data.source
    if c.rollout.env is not None or (source.startswith("task:") and get_task(source.removeprefix("task:")).env is not None):
        return
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer is None:
            tokenizer = load_tokenizer(m.tokenizer or m.path or build_char_tokenizer(tmp))
        tokens = len(ChatRenderer(tokenizer).initial_ids(record["prompt"]))
    budget = min(record.get("max_new_tokens") or c.generator.max_new_tokens, c.generator.max_new_tokens)  # (as the worker caps it)
    if tokens + budget > m.max_seq_len:
        raise ConfigError("model.max_seq_len", f"{prompt_too_long(tokens, m.max_seq_len, budget)}; it is the first record's of data.source={source!r}")


def _first_record(c: Config, held_out: bool = False) -> dict:
    d = c.data
    try:
        if source_kind(d.source) in ("file", "dataset"):
            if c.contracts.data_check_s > 0:
                first, rows, complete = check_source(d, c.contracts.data_check_s, held_out)
                if not complete:
                    logging.getLogger("meshrl").warning(
                        "%s: checked the first %d rows in contracts.data_check_s=%gs; the rest are checked as the run reads them",
                        d.source,
                        rows,
                        c.contracts.data_check_s,
                    )
                return first
            for n, row in iter_rows(d.source, held_out=held_out):
                return _record(d, f"{d.source}:{n}", row)
            raise DataError(f"{d.source}: holds no records")
        return generator(d, str(c.seed), 1)(0, 0)
    except DataError as e:
        raise ConfigError("", str(e), kind="data error") from None


def _saved_dataset(path: str, held_out: bool = False):
    """A `datasets` save_to_disk directory as one Dataset: a DatasetDict's `train` split, or its
    only split; `held_out` (an eval source): its `test` split, else `validation`, else as training
    reads it (a train/test dict named as eval.source evaluated on its training rows)."""
    from datasets import DatasetDict, load_from_disk

    data = load_from_disk(path)  # local files only: never the hub
    if not isinstance(data, DatasetDict):
        return data
    for split in ("test", "validation") if held_out else ():
        if split in data:
            return data[split]
    if "train" in data:
        return data["train"]
    if len(data) == 1:
        return next(iter(data.values()))
    if held_out:
        raise DataError(f"{path} holds splits {sorted(data)} and none is 'test', 'validation' or 'train': save the held-out split alone, or name it 'test'")
    raise DataError(f"{path} holds splits {sorted(data)} and none is 'train': save the split to train on alone, or name it 'train'")


def _record(cfg: DataConfig, where: str, row: Any) -> dict[str, Any]:
    """One stored row as a record; DataError(`where: what is wrong`) when it cannot be one.
    A chat prompt ending with the assistant's message holds its
    reference answer there (the usual `messages` layout of SFT data): that message leaves the
    prompt, since the model is to write it, and is the answer unless the row has its own."""
    key = cfg.prompt_key
    if not isinstance(row, dict):
        raise DataError(f"{where}: a {type(row).__name__} where a record (an object with a {key!r} field) is expected")
    if key not in row:
        keys = ", ".join(map(repr, list(row)[:8])) or "none"
        raise DataError(f"{where}: no {key!r} field (data.prompt_key); the row's fields: {keys}")
    prompt, answer = row[key], row.get(cfg.answer_key)
    if prompt is None or isinstance(prompt, dict):
        raise DataError(f"{where}: {key!r} is {json.dumps(prompt)[:60]}: expected text or a list of chat messages")
    if isinstance(prompt, list):
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
                raise DataError(f"{where}: {key!r} holds {str(m)[:60]!s}, not a chat message (a dict with 'role' and 'content')")
        # Parquet and `datasets` give every row every column and message field, None where a
        # row had none: such a None is no answer, and no field of the message
        prompt = [{k: v for k, v in m.items() if v is not None or k == "content"} for m in prompt]
        if prompt and prompt[-1]["role"] == "assistant":
            if answer is None:
                answer = prompt[-1]["content"]
            prompt = prompt[:-1]
        if not prompt:
            raise DataError(f"{where}: {key!r} has no message before the assistant's answer")
    else:
        prompt = str(prompt)
    extra = {k: v for k, v in row.items() if k not in (key, cfg.answer_key)}
    return {**extra, "prompt": prompt, "answer": answer}  # a column named `prompt` or `answer` is not the one chosen


# ---- generated sources ----------------------------------------------------------------------------
Generator = Callable[[int, int], dict]
"""(epoch, i) -> record i of that epoch."""


def generator(cfg: DataConfig, seed: str, size: int) -> Generator:
    """A task or reasoning-gym source's records as a pure function of (`seed`, epoch, i)."""
    if source_kind(cfg.source) == "task":
        task = get_task(cfg.source.removeprefix("task:"))
        return lambda epoch, i: task.sample(random.Random(f"{seed}/{epoch}/{i}"), cfg)
    name = cfg.source.removeprefix("reasoning_gym:")
    current: dict[int, Any] = {}  # the epoch's dataset object: made once per epoch, not per record

    def record(epoch: int, i: int) -> dict:
        if epoch not in current:
            current.clear()
            # reasoning-gym seeds item i with dataset seed + i; seeds drawn at random from 2^31
            # keep epochs' (and evaluation's) item streams apart in all but a ~size/2^30 chance
            current[epoch] = reasoning_gym_dataset(name, cfg.task_args, random.Random(f"{seed}/{epoch}").randrange(2**31), size)
        return reasoning_gym_record(current[epoch][i])

    return record


def reasoning_gym_dataset(name: str, task_args: dict, seed: int, size: int, field: str = "data.task_args"):
    """reasoning-gym's dataset object for task `name`; bad `task_args` are a ConfigError naming `field`."""
    problem = missing_extra("reasoning_gym")
    if problem:
        raise ImportError(f"reasoning_gym:{name} {problem}")
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **task_args)
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(
            field, f"reasoning_gym:{name} rejects {task_args} with size={size} ({type(e).__name__}: {e}): fix {field} or data.num_prompts"
        ) from None


def reasoning_gym_record(entry: dict) -> dict:
    """A reasoning-gym item as a record: its question as chat messages under reasoning-gym's
    own system prompt (which asks for the final answer in <answer></answer> tags, where its
    scorer looks), and the item's answer and metadata, which its `score_answer` reads."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return {**entry, "prompt": [{"role": "system", "content": SYSTEM_PROMPTS["default"]}, {"role": "user", "content": entry["question"]}]}


def eval_records(config: Config) -> list[dict]:
    """The run's held-out prompts, the same on every call: the first `eval.num_prompts` records
    of `eval.source` in stored order, or of the training task drawn under the seed string
    "SEED/eval", a stream no training epoch ("SEED/EPOCH") draws from."""
    e = config.eval
    data = config.data if e.source is None else dataclasses.replace(config.data, source=e.source, task_args=e.task_args)
    records = load_records(data, held_out=e.source is not None, limit=e.num_prompts)  # a big file is not read whole
    if records is not None:
        return records
    make = generator(data, f"{config.seed}/eval", e.num_prompts)
    return [make(0, i) for i in range(e.num_prompts)]
