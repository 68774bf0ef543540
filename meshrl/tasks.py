"""Built-in verifiable tasks: procedurally generated prompts with exact rewards.

Each task makes prompt i of an epoch deterministically from a seed (so iteration resumes
exactly). A single-turn task scores a response with an exact rule:
`reward(prompt, response, sample)` follows the reward-function signature, and
`sample["answer"]` holds the reference answer. A multi-turn task brings its own env
(meshrl/rollout/env.py), which plays the episode and gives the reward. Rewards are in
[0, 1]; 1 is a perfect answer.

These stay beside reasoning-gym's tasks (`data.source: reasoning_gym:NAME`) because a
~100K-parameter model with the character tokenizer learns them from scratch in minutes on a
CPU, as the tests, examples and benchmarks need; reasoning-gym's nearest tasks are out of
its reach. basic_arithmetic cut down to `add` (`+`, two 1-2 digit terms) asks "Calculate
5 + 33." under its 424-character system prompt: about 450 character tokens through the
chat template, past the default 256-token context, against "17+25="'s 6; and it scores
only an answer inside `<answer></answer>` (19 characters against 2, past the default
8-token budget), which a model from scratch never samples by chance, so it never sees a
reward. Nothing there covers the rest: letter_counting counts a letter in a ~115-character
sentence (not `count`'s writing it n times), spell_backward reverses a word (not `copy`),
and digits, letters and longtail train output format and length, not reasoning.

Single-turn (raw text prompts):

- digits:  "q:" -> any 8 digits. Credit per digit among the first 8 characters. A model
  trained from scratch starts near 1/10 per character and 0 success, and reaches a clear
  majority of perfect answers in a few hundred steps: the embedded default's task.
- letters: "q:" -> repeat the letter 8 times. Partial credit per correct character. A tiny
  model from scratch tends to collapse onto one letter before it learns to copy the prompt.
- count:   "q*3=" -> "qqq" and stop. Partial credit for the right letter, full for exact.
- add:     "17+25=" -> "42". Exact match only.
- copy:    "copy:hello=" -> "hello". Per-character credit.
- longtail: "37:" -> 37 digits and stop, n heavy-tailed like reasoning traces
           (`data.lengths`: lognormal around a median, clipped at a max of 20x or more).
           Each prompt carries its own token budget (`max_new_tokens`, n plus a slack):
           a model that does not stop is cut there. Credit per digit among the first n
           characters, over the longer of n and the response: exactly 1 only for n digits
           and a stop. From scratch a model learns digits within tens of steps (as in
           digits), stopping at the right count far more slowly, so response lengths follow
           the targets' tail throughout a run: a workload for stragglers
           (configs/long-tail.yaml, benchmarks/long_tail.py).

Multi-turn (chat messages, rendered by the tokenizer's chat template; both are learnable
from scratch on a CPU by the tiny default model with the built-in character tokenizer):
- calc:  "7-3" -> the model calls the calculator tool, then answers with its result.
         Answering right is only possible by calling the tool and copying what it
         returned. Credit: 0.2 for a call, 0.5 for a call that returned the answer, 0.6
         for then answering with a number (the first number in the reply), 1.0 for the right one. Use `rollout.tool_parser: compact` (a turn `!` or
         `!7-3` is a call) for models trained from scratch.
- pyexpr: "7**5%9" -> the model calls the `python` tool (run in the sandbox,
         meshrl/rollout/sandbox.py), then answers with what it printed: a one-digit value
         the tiny model cannot compute but can read off the tool. Credit as in calc. With
         `rollout.tool_parser: compact`, a turn `!` runs the question itself, `!CODE` runs
         CODE (a lone expression prints its value). configs/code-tool.yaml.
- code:  a coding task with hidden tests, the tiny version of meshrl.rollout.coding:CodeEnv.
         "0:2 1:3" shows f(0) and f(1) of f(x) = x+k or x*k; the answer is the body of
         `f=lambda x:`, e.g. `x+2`, and the reward is the fraction of the hidden tests
         f(0)..f(4) it passes, run in the sandbox. One model turn (no tool calls).
- guess: a hidden digit; the model guesses, the env answers `+` (higher) or `-` (lower),
         at most 4 guesses. 1.0 for a hit on the first guess, 0.1 less per extra guess.
- longtail_chat: longtail's question ("37") asked for 1 to `data.lengths.turns_max` rounds
         (P(k) proportional to 1/k^2), one heavy-tailed length and budget per round; the
         mean of the rounds' credit.

A game of two trained models (meshrl/rollout/game.py; `models: [{name: proposer}]`):
- propose: the proposer (`models[0]`) writes one character after "p:"; a digit d sets the
         problem, n = 1 + d mod 8 digits, which the solver (the policy) answers in
         PROPOSE_ATTEMPTS threads of its own played at once, each "n:" with a budget of n tokens. The
         solver's credit is the fraction of its n characters that are digits; an attempt
         succeeds with all n. The proposer gets Absolute Zero's learnability, 1 - the
         solver's success rate when it is strictly between 0 and 1 (else 0), scaled to
         0.8, plus 0.2 for a digit at all. A proposal that is no digit earns 0, and the
         solver then plays n = 4, so it learns from every episode.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
import string
from dataclasses import dataclass
from typing import Any, Callable

from meshrl.config import Config, DataConfig, LengthTailConfig, source_kind
from meshrl.imports import import_callable
from meshrl.rollout.coding import CodeEnv, PythonToolEnv
from meshrl.rollout.env import ModelTurn, StepResult
from meshrl.rollout.game import Ask, Outcome, Reply
from meshrl.rollout.tools import ToolEnv

LETTERS_LENGTH = 8


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[random.Random, DataConfig], dict[str, Any]]
    """(rng, the run's data config) -> the record: `prompt` (text or chat messages), the
    reference `answer`, and the task's own fields"""
    reward: Callable[[str, str, dict], float] | None = None
    """single-turn: (prompt, response, sample) -> reward in [0, 1]"""
    env: Callable[[Any], Any] | None = None
    """multi-turn: (run Config) -> a fresh env for one episode"""
    sandbox: bool = False
    """the task runs model-written code (meshrl/rollout/sandbox.py): preflight checks the sandbox"""
    game: bool = False
    """its env is a game whose turns several trained models speak (meshrl/rollout/game.py)"""

    def sample(self, rng: random.Random, data: DataConfig | None = None) -> dict[str, Any]:
        return self.make(rng, data or DataConfig())


def _make_digits(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    return {"prompt": f"{rng.choice(string.ascii_lowercase)}:", "answer": ""}


def digits_reward(prompt: str, response: str, sample: dict) -> float:
    """Fraction of the first 8 response characters that are digits."""
    return sum(ch.isdigit() for ch in response[:LETTERS_LENGTH]) / LETTERS_LENGTH


SPARSE_LOOK, SPARSE_NEED = 4, 2
"""task:digits_sparse: the response's first SPARSE_LOOK characters, SPARSE_NEED of them digits."""


def digits_sparse_reward(prompt: str, response: str, sample: dict) -> float:
    """1 when at least 2 of the first 4 response characters are digits, else 0: the default
    task's signal as a sparse outcome (an untrained model's episodes pass a few percent of
    the time), for process rewards to densify (docs/coevolve.md, PRIME)."""
    return float(sum(ch.isdigit() for ch in response[:SPARSE_LOOK]) >= SPARSE_NEED)


def _make_letters(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    c = rng.choice(string.ascii_lowercase)
    return {"prompt": f"{c}:", "answer": c * LETTERS_LENGTH}


def letters_reward(prompt: str, response: str, sample: dict) -> float:
    """Fraction of the first 8 response characters equal to the requested letter."""
    target = sample["answer"]
    return sum(a == b for a, b in zip(response, target)) / len(target)


def _make_count(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    c, n = rng.choice(string.ascii_lowercase), rng.randint(1, 5)
    return {"prompt": f"{c}*{n}=", "answer": c * n}


def count_reward(prompt: str, response: str, sample: dict) -> float:
    """1 for exactly the letter n times; else half the share of positions that hold the right letter."""
    target = sample["answer"]
    if response == target:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(response, target)) / max(len(target), len(response))


def _make_add(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def add_reward(prompt: str, response: str, sample: dict) -> float:
    """1 if the response is exactly the sum (surrounding whitespace ignored), else 0."""
    return float(response.strip() == sample["answer"])


def _make_copy(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
    return {"prompt": f"copy:{word}=", "answer": word}


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


def _make_calc(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    # one-digit results: the answer is copied from the tool in one token
    result, op = rng.randint(0, 9), rng.choice("+-")
    b = rng.randint(0, result) if op == "+" else rng.randint(0, 9 - result)
    a = result - b if op == "+" else result + b
    return {"prompt": [{"role": "user", "content": f"{a}{op}{b}"}], "answer": str(result)}


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


def _make_pyexpr(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    a, b, m = rng.randint(2, 9), rng.randint(2, 9), rng.randint(3, 9)
    return {"prompt": [{"role": "user", "content": f"{a}**{b}%{m}"}], "answer": str(a**b % m)}


class PyExprEnv(PythonToolEnv):
    """task:pyexpr: one `python` call, then an answer read off its output. The tool runs the
    code it is given, or the question itself when given none (`!` in the compact format), so
    a tiny model learns one call token before it could learn to copy code into the call."""

    def __init__(self, config):
        super().__init__(config, max_tool_calls=1, tool_reply_chars=40)

    async def python(self, code: str = "") -> str:
        """Run Python code in a sandbox and return what it printed.

        Args:
            code: the program; a lone expression prints its value; empty: the question.
        """
        return await super().python(code if code.strip() else self.sample["prompt"][-1]["content"])

    async def score(self, answer_text: str, sample: dict) -> float:
        if not self.calls_made:
            return 0.0
        if sample["answer"] not in [r.strip() for r in self.tool_results]:
            return 0.2  # called the tool, but it did not print the answer
        answer = _FIRST_NUMBER.search(answer_text)
        if answer is None:
            return 0.5
        return 0.6 + 0.4 * (answer.group(0) == sample["answer"])


def _make_code(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    k, op = rng.randint(0, 4), rng.choice("+*")
    f = (lambda x: x + k) if op == "+" else (lambda x: x * k)
    return {
        "prompt": [{"role": "user", "content": f"0:{f(0)} 1:{f(1)}"}],
        "answer": f"x{op}{k}",
        "tests": [f"assert f({x})=={f(x)}" for x in range(5)],
        "template": "f=lambda x:{answer}",
    }


class TinyCodeEnv(CodeEnv):
    """task:code: the answer is scored by the record's hidden tests in the sandbox, no tool calls."""

    def __init__(self, config):
        super().__init__(config, max_tool_calls=0)


GUESSES = 4


def _make_guess(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": "?"}], "answer": str(rng.randint(0, 9))}


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


# ---- heavy-tailed lengths -------------------------------------------------------------------------
def target_length(rng: random.Random, lengths: LengthTailConfig) -> int:
    """A target answer length: lognormal around `lengths.median`, clipped to [1, lengths.max]."""
    return max(1, min(lengths.max, round(lengths.median * math.exp(rng.gauss(0.0, lengths.sigma)))))


def answer_budget(target: int, slack: float) -> int:
    """Token budget of an answer `target` tokens long: room to overshoot a little, then cut."""
    return math.ceil(target * (1 + slack)) + 2


def _make_longtail(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    n = target_length(rng, data.lengths)
    return {"prompt": f"{n}:", "answer": str(n), "max_new_tokens": answer_budget(n, data.lengths.slack)}


def longtail_reward(prompt: str, response: str, sample: dict) -> float:
    """Digits among the first n characters, over the longer of n and the response: 1 only
    for exactly n digits and a stop."""
    n = int(sample["answer"])
    return sum(ch.isdigit() for ch in response[:n]) / max(n, len(response))


def _make_longtail_chat(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    turns = range(1, data.lengths.turns_max + 1)
    rounds = rng.choices(turns, weights=[1 / k**2 for k in turns])[0]
    answers = [target_length(rng, data.lengths) for _ in range(rounds)]
    return {"prompt": [{"role": "user", "content": str(answers[0])}], "answer": answers}


class LongtailChatEnv:
    """task:longtail_chat: round after round the user asks for n digits. Each answer is
    scored like task:longtail and within its own budget; the episode's reward is the mean
    over its rounds, so a round never reached (the context ran out) counts 0."""

    def __init__(self, config):
        self.slack = config.data.lengths.slack
        self.answers: list[int] = []
        self.max_new_tokens: int | None = None

    def reset(self, sample: dict) -> list[dict]:
        self.answers = sample["answer"]
        self.max_new_tokens = answer_budget(self.answers[0], self.slack)
        return sample["prompt"]

    def step(self, turn: ModelTurn) -> StepResult:
        reward = longtail_reward("", turn.text, {"answer": self.answers[turn.index]}) / len(self.answers)
        following = turn.index + 1
        if following == len(self.answers):
            return StepResult(reward=reward, done=True)
        self.max_new_tokens = answer_budget(self.answers[following], self.slack)
        return StepResult(observation=[{"role": "user", "content": str(self.answers[following])}], reward=reward, done=False)


# ---- a game of two trained models ---------------------------------------------------------------
PROPOSE_ATTEMPTS = 4
"""The solver's independent attempts at each proposal: its success rate, for the learnability."""


def _make_propose(rng: random.Random, data: DataConfig) -> dict[str, Any]:
    return {"prompt": "p:", "answer": ""}


class ProposeSolveGame:
    """task:propose (see the module docstring): a proposer sets the problem, the solver answers
    it PROPOSE_ATTEMPTS times, each in a thread of its own; names from `models[0]` and `policy`."""

    def __init__(self, config=None):
        self.proposer = config.models[0].name if config is not None and config.models else "policy"  # one model: self-play
        self.solver, self.n, self.scores, self.valid = "policy", 4, [], False

    @classmethod
    def from_config(cls, config) -> "ProposeSolveGame":
        """As `rollout.env` too (rollout/env.py `env_maker`): the names are the run's."""
        return cls(config)

    def reset(self, sample: dict) -> Ask:
        return Ask(self.proposer, "propose", sample["prompt"], max_new_tokens=1, role="proposer")

    def step(self, reply: Reply | list[Reply]) -> list[Ask] | Outcome:
        if not isinstance(reply, list):  # the proposal: the solver's attempts, played at once
            self.valid = reply.text[:1].isascii() and reply.text[:1].isdigit()  # ASCII: str.isdigit takes '²', which int() refuses
            self.n = 1 + int(reply.text[0]) % 8 if self.valid else 4
            return [Ask(self.solver, f"solve{i}", f"{self.n}:", max_new_tokens=self.n, role="solver") for i in range(PROPOSE_ATTEMPTS)]
        self.scores = [sum(ch.isdigit() for ch in r.text[: self.n]) / self.n for r in reply]
        rate = sum(score == 1.0 for score in self.scores) / len(self.scores)
        learnability = 1.0 - rate if 0.0 < rate < 1.0 else 0.0
        proposer = 0.2 + 0.8 * learnability if self.valid else 0.0
        return Outcome({"propose": proposer, **{f"solve{i}": score for i, score in enumerate(self.scores)}})


TASKS: dict[str, Task] = {
    "digits": Task("digits", _make_digits, digits_reward),
    "digits_sparse": Task("digits_sparse", _make_digits, digits_sparse_reward),
    "letters": Task("letters", _make_letters, letters_reward),
    "count": Task("count", _make_count, count_reward),
    "add": Task("add", _make_add, add_reward),
    "copy": Task("copy", _make_copy, copy_reward),
    "calc": Task("calc", _make_calc, env=CalcEnv),
    "pyexpr": Task("pyexpr", _make_pyexpr, env=PyExprEnv, sandbox=True),
    "code": Task("code", _make_code, env=TinyCodeEnv, sandbox=True),
    "guess": Task("guess", _make_guess, env=GuessEnv),
    "longtail": Task("longtail", _make_longtail, longtail_reward),
    "longtail_chat": Task("longtail_chat", _make_longtail_chat, env=LongtailChatEnv),
    "propose": Task("propose", _make_propose, env=ProposeSolveGame, game=True),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise KeyError(f"unknown built-in task {name!r}: choose one of {', '.join(TASKS)}")
    return TASKS[name]


def needs_sandbox(c: Config) -> bool:
    """Whether the run executes model-written code: a built-in task (trained on, or its eval.source)
    or an env marked as using the sandbox (`uses_sandbox`); preflight then checks the sandbox
    (meshrl/rollout/sandbox.py)."""
    if c.eval.source is not None and _sandboxed_task(c.eval.source):  # played with its own env (agent/envs.py eval_view)
        return True
    if c.rollout.env:
        try:
            return bool(getattr(import_callable(c.rollout.env), "uses_sandbox", False))
        except ImportError:
            return False  # reported by check()
    return _sandboxed_task(c.data.source)


def _sandboxed_task(source: str) -> bool:
    task = TASKS.get(source.removeprefix("task:")) if source_kind(source) == "task" else None
    return bool(task and task.sandbox)
