"""Reward functions backed by the field's checkers: math-verify and reasoning-gym's scorers.

Both follow the reward-function signature `(prompt, response, sample) -> float` and are sync:
a rollout worker runs them in threads (meshrl/rollout/env.py), bounded by `scoring.timeout_s`.
That is also why math-verify's own timeouts are off here: they use SIGALRM, which works only
on the main thread, and raise anywhere else.

Each checker is an optional extra. This module imports without them; `math_answer` is looked
up through `__getattr__`, which raises ImportError with the one-line pip hint when
math-verify is missing, so validating `scoring.reward_fn: meshrl.verifiers:math_answer`
fails before a run starts rather than on its first reward.
"""

from __future__ import annotations

import re

from meshrl.config import Config
from meshrl.imports import missing_extra
from meshrl.rollout.env import RewardFn

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (nested braces matched); None if none closes."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for j in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : j]
    return None


def final_answer(response: str) -> str | None:
    """A response's final answer: its last `\\boxed{}`, else its last <answer> tag, else its last number."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        return tagged[-1].strip()
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def _math(text: str) -> list:
    """math-verify's parse of one answer. Bare LaTeX (`\\frac12`) parses only inside math
    delimiters, so text without any gets `$...$` (plain numbers and `1/2` parse either way)."""
    from math_verify import parse

    if "$" not in text and "\\boxed" not in text:
        text = f"${text}$"
    return parse(text, parsing_timeout=None)  # None: no SIGALRM, so it runs off the main thread


def _math_answer(prompt: str, response: str, sample: dict) -> float:
    """1.0 when the response's final answer equals `sample["answer"]` mathematically
    (math-verify: `1/2`, `0.5` and `\\frac{1}{2}` agree), else 0.0."""
    from math_verify import verify

    if sample.get("answer") is None:
        raise ValueError("math_answer needs the reference answer in the record's 'answer' field (data.answer_key)")
    answer = final_answer(response)
    if answer is None:
        return 0.0
    gold, predicted = _math(str(sample["answer"])), _math(answer)
    return float(bool(gold and predicted) and verify(gold, predicted, timeout_seconds=None))


def __getattr__(name: str):
    if name == "math_answer":  # only here, so that looking it up can name the missing extra
        problem = missing_extra("math_verify")
        if problem:
            raise ImportError(f"math_answer {problem}")
        return _math_answer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def reasoning_gym_reward(config: Config, source: str | None = None) -> RewardFn:
    """The reward of a `reasoning_gym:NAME` source (`data.source` unless given): the task's own
    `score_answer` on the response's last <answer> tag (None, which scores 0, without one).

    The task's dataset object is built here, once per rollout worker, with the run's
    `data.task_args`: scoring goes through that object, and some tasks' scorers read its config."""
    from meshrl.data import reasoning_gym_dataset

    name = (source or config.data.source).removeprefix("reasoning_gym:")
    dataset = reasoning_gym_dataset(name, config.data.task_args, config.seed, config.data.num_prompts)
    from reasoning_gym.utils import extract_answer  # installed: the line above checked

    def reasoning_gym_score(prompt: str, response: str, sample: dict) -> float:
        return float(dataset.score_answer(extract_answer(response), sample))

    return reasoning_gym_score
