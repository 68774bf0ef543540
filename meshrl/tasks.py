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
- calc:  "7-3" -> the model calls the calculator tool, then answers with its result.
         Answering right is only possible by calling the tool and copying what it
         returned. Credit: 0.2 for a call, 0.5 for a call that returned the answer, 0.6
         for then answering with a number (the first number in the reply), 1.0 for the right one. Use `rollout.tool_parser: compact` (a turn `!` or
         `!7-3` is a call) for models trained from scratch.
- guess: a hidden digit; the model guesses, the env answers `+` (higher) or `-` (lower),
         at most 4 guesses. 1.0 for a hit on the first guess, 0.1 less per extra guess.
"""

from __future__ import annotations

import ast
import operator
import random
import re
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
    """Evaluate an integer arithmetic expression; "?" when it is not one.

    Args:
        expression: digits with +, - and *, e.g. "7*8".
    """

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError

    try:
        return str(ev(ast.parse(expression.strip()[:32], mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "?"  # short: every token of a tool reply lengthens the episode


_LEADING_ARITHMETIC = re.compile(r"[\d+\-*() ]*")
_FIRST_NUMBER = re.compile(r"-?\d+")


def _make_calc(rng: random.Random) -> tuple[list[dict], str]:
    # one-digit results: the answer is copied from the tool in one token
    result, op = rng.randint(0, 9), rng.choice("+-")
    b = rng.randint(0, result) if op == "+" else rng.randint(0, 9 - result)
    a = result - b if op == "+" else result + b
    return [{"role": "user", "content": f"{a}{op}{b}"}], str(result)


class CalcEnv(ToolEnv):
    """The calculator task: one tool call, then an answer copied from the tool's result.

    The tool evaluates the arithmetic its argument starts with, or the question's own when
    the argument starts with none (`!` in the compact format): a tiny model learns one call
    token, not to copy the question into the call. The answer is the first number in the
    reply. Answering right still needs the tool's result."""

    def __init__(self, config):
        super().__init__([self.calculator], parser=config.rollout.tool_parser, max_tool_calls=1)

    def calculator(self, expression: str = "") -> str:
        """Evaluate the integer arithmetic (digits, +, -, *) the expression starts with.

        Args:
            expression: e.g. "7-3"; without arithmetic, the question's own expression.
        """
        arithmetic = _LEADING_ARITHMETIC.match(expression).group(0).strip()
        return calculator(arithmetic or self.sample["prompt"][-1]["content"])

    async def score(self, answer_text: str, sample: dict) -> float:
        if not self.calls_made:
            return 0.0
        if sample["answer"] not in self.tool_results:
            return 0.2  # called the tool, but not on the question
        answer = _FIRST_NUMBER.search(answer_text)
        if answer is None:
            return 0.5
        return 0.6 + 0.4 * (answer.group(0) == sample["answer"])  # a number at all: a step toward copying one


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
