"""Built-in verifiable tasks: procedurally generated prompts with exact rewards.

Each task makes prompt i of an epoch deterministically from a seed (so iteration resumes
exactly) and scores a response with an exact rule. `reward(prompt, response, sample)`
follows the reward-function signature every scorer uses; `sample["answer"]` holds the
reference answer. Rewards are in [0, 1]; `sample["success"]` is set on a perfect score.

- digits:  "q:" -> any 8 digits. Credit per digit among the first 8 characters. A model
  trained from scratch starts near 1/10 per character and 0 success, and reaches a clear
  majority of perfect answers in a few hundred steps: the embedded default's task.
- letters: "q:" -> repeat the letter 8 times. Partial credit per correct character. A tiny
  model from scratch tends to collapse onto one letter before it learns to copy the prompt.
- count:   "q*3=" -> "qqq" and stop. Partial credit for the right letter, full for exact.
- add:     "17+25=" -> "42". Exact match only.
- copy:    "copy:hello=" -> "hello". Per-character credit.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable

LETTERS_LENGTH = 8


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[random.Random], tuple[str, str]]
    """rng -> (prompt text, reference answer)"""
    reward: Callable[[str, str, dict], float]
    """(prompt, response, sample) -> reward in [0, 1]"""


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


TASKS: dict[str, Task] = {
    "digits": Task("digits", _make_digits, digits_reward),
    "letters": Task("letters", _make_letters, letters_reward),
    "count": Task("count", _make_count, count_reward),
    "add": Task("add", _make_add, add_reward),
    "copy": Task("copy", _make_copy, copy_reward),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise KeyError(f"unknown built-in task {name!r}: choose one of {', '.join(TASKS)}")
    return TASKS[name]
