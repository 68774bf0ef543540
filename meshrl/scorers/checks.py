"""The scorers' code and checkpoints, checked before a run starts.

`check_reward_fn` and `check_scorer_files` ask what a config's values cannot show alone:
a reward function that imports and takes (prompt, response, sample), a reward model or
judge checkpoint of the right head with its tokenizer beside it, a judge template that
fills and a parser that reads its own probe reply. With `contracts.probe`, `probe_scorers`
calls each function scorer and remote scorer once on the data source's first record.
Each problem is one `ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import json
import os

from meshrl.config import Config, ConfigError, ScorerConfig
from meshrl.imports import import_callable
from meshrl.rollout.checks import check_reward_path, probe_reward, run_probe


def check_reward_fn(c: Config) -> None:
    """scoring.reward_fn imports and takes (prompt, response, sample); scoring.reward_model is a directory."""
    s = c.scoring
    if s.reward_fn is not None:
        check_reward_path("scoring.reward_fn", s.reward_fn)
    if s.reward_model is not None:
        if not os.path.isdir(s.reward_model):
            raise ConfigError("scoring.reward_model", f"directory {s.reward_model!r} not found: give a local checkpoint directory or null")


def check_scorer_files(c: Config) -> None:
    """scoring.reward_model's checkpoint, then each scoring.scorers entry's code and checkpoint."""
    s = c.scoring
    if s.reward_model is not None:
        _check_checkpoint("scoring.reward_model", s.reward_model, "reward_model")
    for i, sc in enumerate(s.scorers):
        _check_scorer(c, sc, f"scoring.scorers[{i}]")


def _check_scorer(c: Config, sc: ScorerConfig, path: str) -> None:
    """A scorer's code and checkpoint: an importable function, a checkpoint with the right
    head and a tokenizer, a judge template and parser that work on a probe, a PRM's
    vocabulary that covers the policy's."""
    if sc.kind == "function":
        check_reward_path(f"{path}.path", sc.path)
    if sc.kind in ("reward_model", "judge") or sc.kind == "prm" and sc.path:
        _check_checkpoint(f"{path}.path", sc.path, sc.kind)
    if sc.kind == "prm" and sc.path:
        _check_prm_vocabulary(c, sc.path, f"{path}.path")
    if sc.kind == "judge":
        from meshrl.scorers.backends import check_judge

        check_judge(sc, path)


def _check_checkpoint(field: str, path: str, kind: str) -> None:
    """A local checkpoint of the kind's head (sequence classification with one label, or a
    causal LM), with a tokenizer beside it."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(field, f"{path!r} is not a Hugging Face checkpoint directory (no config.json): give a local checkpoint")
    with open(config_file) as f:
        hf = json.load(f)
    arch = " ".join(hf.get("architectures") or [])
    if kind == "reward_model":
        want = "a reward model is a sequence-classification checkpoint with one label (AutoModelForSequenceClassification, num_labels=1)"
        if "ForSequenceClassification" not in arch:
            raise ConfigError(field, f"{path!r} is {arch or 'no known architecture'}: {want}")
        labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
        if labels != 1:
            raise ConfigError(field, f"{path!r} has a head of {labels} labels: {want}")
    else:
        if not ("ForCausalLM" in arch or "ForConditionalGeneration" in arch):
            raise ConfigError(field, f"{path!r} is {arch or 'no known architecture'}: a {kind} is a causal LM checkpoint")
    if not any(os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ConfigError(field, f"{path!r} has no tokenizer: save the scorer's tokenizer beside its weights (tokenizer.save_pretrained)")


def _check_prm_vocabulary(c: Config, path: str, field: str) -> None:
    """A PRM's checkpoint reads the episodes' own token ids, the policy's: its vocabulary
    covers the policy's. (One that does not load as a checkpoint is not this check's to refuse.)"""
    from meshrl.trainer.checks import checkpoint_vocabulary, policy_vocabulary

    policy, n = policy_vocabulary(c), checkpoint_vocabulary(path)
    if policy is not None and n is not None and n < policy:
        raise ConfigError(
            field, f"its vocabulary ({n}) is smaller than the policy's ({policy}): the PRM reads the policy's token ids, so it needs the policy's tokenizer"
        )


def probe_scorers(c: Config, record: dict) -> None:
    """Each function scorer (of whole episodes) and remote scorer, once on `record`."""
    for i, sc in enumerate(c.scoring.scorers):
        if sc.kind == "function" and sc.process == "none":  # a process function needs an episode's steps
            probe_reward(c, import_callable(sc.path), f"scoring.scorers[{i}].path", record, sc.timeout_s, f"scoring.scorers[{i}].timeout_s")
        elif sc.kind == "remote":
            _probe_remote(c, sc, f"scoring.scorers[{i}].url", record)


def _probe_remote(c: Config, sc: ScorerConfig, field: str, record: dict) -> None:
    """One request to a remote scorer: the first record, its answer as the response."""
    from meshrl.scorers.backends import Failed, Remote
    from meshrl.scorers.client import scoring_item

    answer = record.get("answer")
    item = scoring_item(record, answer if isinstance(answer, str) else "")
    if sc.process != "none":
        item["steps"] = [item["response"]]
    (result,) = run_probe(lambda: Remote(sc).score([item]), sc.timeout_s + 10)
    if isinstance(result, Failed):
        raise ConfigError(
            field,
            f"{result.reason}, on the first record of {c.data.source}: start the server, fix the url, or set contracts.probe=false",
            kind="contract error",
        )
