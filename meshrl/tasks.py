"""Built-in verifiable tasks: procedurally generated prompts with exact rewards.

Each task makes prompt i of an epoch deterministically from a seed (so iteration resumes
exactly). A single-turn task scores a response with an exact rule:
`reward(prompt, response, sample)` follows the reward-function signature, and
`sample["answer"]` holds the reference answer. A multi-turn task brings its own env
(meshrl/rollout/env.py), which plays the episode and gives the reward. Rewards are in
[0, 1]; 1 is a perfect answer.

Single-turn (raw text prompts):

- digits:  "q:" -> any 8 digits. Credit per digit among the first 8 characters. A model
  trained from scratch starts near 1/10 per character and 0 success, and reaches a clear
  majority of perfect answers in a few hundred steps: the embedded default's task.
- letters: "q:" -> repeat the letter 8 times. Partial credit per correct character. A tiny
  model from scratch tends to collapse onto one letter before it learns to copy the prompt.
- count:   "q*3=" -> "qqq" and stop. Partial credit for the right letter, full for exact.
- add:     "17+25=" -> "42". Exact match only.
- copy:    "copy:hello=" -> "hello". Per-character credit.

Multi-turn (chat messages, rendered by the tokenizer's chat template; both are learnable
from scratch on a CPU by the tiny default model with the built-in character tokenizer):
- calc:  "7*8" -> the model calls the calculator tool, then answers with its result.
         Answering right is only possible by calling the tool and copying what it
         returned. Credit: 0.2 for calling the tool, up to 0.3 more for the call's
         argument (per character against the question), up to 0.5 more for the answer
         (per character against the tool's correct result). Use `rollout.tool_parser:
         compact` (a turn `!7*8` is a call) for models trained from scratch.
- guess: a hidden digit; the model guesses, the env answers `+` (higher) or `-` (lower),
         at most 4 guesses. 1.0 for a hit on the first guess, 0.1 less per extra guess.
"""

from __future__ import annotations

import ast
import operator
import random
import string
from dataclasses import dataclass
from typing import Any, Callable

from meshrl.rollout.env import ModelTurn, StepResult
from meshrl.rollout.tools import ToolEnv

LETTERS_LENGTH = 8


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[random.Random], tuple[Any, str]]
    """rng -> (prompt: text or chat messages, reference answer)"""
    reward: Callable[[str, str, dict], float] | None = None
    """single-turn: (prompt, response, sample) -> reward in [0, 1]"""
    env: Callable[[Any], Any] | None = None
    """multi-turn: (run Config) -> a fresh env for one episode"""

    def sample(self, rng: random.Random) -> dict:
        prompt, answer = self.make(rng)
        return {"prompt": prompt, "answer": answer}


def _make_digits(rng: random.Random) -> tuple[str, str]:
    c = rng.choice(string.ascii_lowercase)
    return f"{c}:", ""


def digits_reward(prompt: str, response: str, sample: dict) -> float:
    """Fraction of the first 8 response characters that are digits."""
    return sum(ch.isdigit() for ch in response[:LETTERS_LENGTH]) / LETTERS_LENGTH


def _make_letters(rng: random.Random) -> tuple[str, str]:
    c = rng.choice(string.ascii_lowercase)
    return f"{c}:", c * LETTERS_LENGTH


def letters_reward(prompt: str, response: str, sample: dict) -> float:
    """Fraction of the first 8 response characters equal to the requested letter."""
    target = sample["answer"]
    return sum(a == b for a, b in zip(response, target)) / len(target)


def _make_count(rng: random.Random) -> tuple[str, str]:
    c, n = rng.choice(string.ascii_lowercase), rng.randint(1, 5)
    return f"{c}*{n}=", c * n


def count_reward(prompt: str, response: str, sample: dict) -> float:
    """1 for exactly the letter n times; else half the fraction of leading correct letters."""
    target = sample["answer"]
    if response == target:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(response, target)) / max(len(target), len(response))


def _make_add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", str(a + b)


def add_reward(prompt: str, response: str, sample: dict) -> float:
    """1 if the response is exactly the sum (surrounding whitespace ignored), else 0."""
    return float(response.strip() == sample["answer"])


def _make_copy(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
    return f"copy:{word}=", word


def copy_reward(prompt: str, response: str, sample: dict) -> float:
    """Per-character agreement with the word, over the longer of the two."""
    target = sample["answer"]
    return sum(a == b for a, b in zip(response, target)) / max(len(target), len(response), 1)


# ---- multi-turn ---------------------------------------------------------------------------------
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: digits with +, - and *, e.g. "7*8".
    """

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"cannot evaluate {expression!r}")

    if len(expression) > 32:
        raise ValueError("expression too long")
    return str(ev(ast.parse(expression.strip(), mode="eval").body))


def _make_calc(rng: random.Random) -> tuple[list[dict], str]:
    a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+*")
    question = f"{a}{op}{b}"
    return [{"role": "user", "content": question}], calculator(question)


def _agreement(got: str, want: str) -> float:
    """Per-character agreement over the longer of the two."""
    return sum(x == y for x, y in zip(got, want)) / max(len(got), len(want), 1)


class CalcEnv(ToolEnv):
    """The calculator task: a tool turn, then an answer copied from the tool's result."""

    def __init__(self, config):
        super().__init__([calculator], parser=config.rollout.tool_parser, max_tool_calls=2)
        self.arguments: list[str] = []

    async def step(self, turn: ModelTurn) -> StepResult:
        calls = self.parser(turn.text)
        self.arguments += [str(next(iter(c.arguments.values()), "")) for c in calls]
        return await super().step(turn)

    async def score(self, answer_text: str, sample: dict) -> float:
        if not self.arguments:
            return 0.0
        question = sample["prompt"][-1]["content"]
        called = 0.2 + 0.3 * max(_agreement(a.strip(), question) for a in self.arguments)
        # the answer counts only where the tool gave the right result to copy
        if sample["answer"] not in self.tool_results:
            return called
        return called + 0.5 * _agreement(answer_text.strip(), sample["answer"])


GUESSES = 4


def _make_guess(rng: random.Random) -> tuple[list[dict], str]:
    return [{"role": "user", "content": "?"}], str(rng.randint(0, 9))


class GuessEnv:
    """The guessing game: a hidden digit, `+` / `-` feedback, at most GUESSES guesses."""

    def __init__(self, config=None):
        self.secret = ""

    def reset(self, sample: dict) -> list[dict]:
        self.secret = sample["answer"]
        return sample["prompt"]

    def step(self, turn: ModelTurn) -> StepResult:
        guess = turn.text.strip()[:1]
        if guess == self.secret:
            return StepResult(reward=1.0 - 0.1 * turn.index, done=True)
        if turn.index + 1 >= GUESSES:
            return StepResult(reward=0.0, done=True)
        hint = "?" if not guess.isdigit() else ("+" if self.secret > guess else "-")
        return StepResult(observation=[{"role": "user", "content": hint}], done=False)


TASKS: dict[str, Task] = {
    "digits": Task("digits", _make_digits, digits_reward),
    "letters": Task("letters", _make_letters, letters_reward),
    "count": Task("count", _make_count, count_reward),
    "add": Task("add", _make_add, add_reward),
    "copy": Task("copy", _make_copy, copy_reward),
    "calc": Task("calc", _make_calc, env=CalcEnv),
    "guess": Task("guess", _make_guess, env=GuessEnv),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise KeyError(f"unknown built-in task {name!r}: choose one of {', '.join(TASKS)}")
    return TASKS[name]
