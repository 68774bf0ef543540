"""Reward functions backed by the field's checkers: math-verify and reasoning-gym's scorers.

Both follow the reward-function signature `(prompt, response, sample) -> float` and are sync:
a rollout worker runs them in threads (meshrl/rollout/env.py), bounded by `scoring.timeout_s`.
A thread cannot bound math-verify, though: one answer like `3^{3^{16}}` keeps sympy inside a
single big-integer operation that holds the GIL for seconds to forever, freezing the worker's
event loop with it, and math-verify's own timeouts use SIGALRM, which works only on a main
thread. So `math_answer` checks in a child process (a few kept warm) that it kills after
VERIFY_TIMEOUT_S, scoring that answer 0.0 as math-verify does on its own timeout.

Each checker is an optional extra. This module imports without them; `math_answer` is looked
up through `__getattr__`, which raises ImportError with the one-line pip hint when
math-verify is missing, so validating `scoring.reward_fn: meshrl.verifiers:math_answer`
fails before a run starts rather than on its first reward.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

from meshrl.config import Config
from meshrl.errors import first_line
from meshrl.imports import missing_extra
from meshrl.rollout.env import RewardFn

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"[-\u2212]?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?")  # U+2212: the minus sign of typeset text
# "the answer is 42." (a number that ends its sentence: "the answer is 2 times the radius" states none)
# (the number atomic: backtracking into it, "3.5 cm." would state "3")
# (Markdown's emphasis around the cue or its answer is read through: "**Answer:** 42", "is **42**.")
_CUE, _ENDS_SENTENCE = r"answer[*_]*(?:\s+is|\s*[:=])[*_]*\s*[:=]?\s*[*_]*", r"[*_]*(?=\s*(?:[.!?;,)]|$))"
_CUED = re.compile(_CUE + r"\$?\s*((?>" + _NUMBER.pattern + r"))\$?" + _ENDS_SENTENCE, re.IGNORECASE | re.MULTILINE)
_MATH = re.compile(r"(?<!\\)\$(?P<d>[^$]+?)(?<!\\)\$|\\\((?P<p>.+?)\\\)|\\\[(?P<b>.+?)\\\]", re.DOTALL)  # $...$, \(...\), \[...\]
# "the answer is $\frac{1}{2}$.": the math a cue names, whole (its digits are no number of their own)
_CUED_MATH = re.compile(_CUE + r"(?:" + _MATH.pattern + r")" + _ENDS_SENTENCE, re.IGNORECASE | re.DOTALL | re.MULTILINE)
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


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
    """A response's final answer: the last of its `\\boxed{}`, its <answer> tags and the math or
    number after an "answer is" (or "answer:"), so that a draft boxed while thinking gives way
    to the tag or cue after it; else its last number, or the last math it wrote where that
    number is part of it (`$\\frac{3}{4}$` is no 4). None where its last `\\boxed{` never closes
    (the answer was still being written). (A reply cut at its budget is read the same: a
    short-answer task's answer often fills its budget, end token left out.)"""
    found = []  # (where it starts, the answer)
    box = response.rfind("\\boxed{")
    if box >= 0:
        found.append((box, last_boxed(response)))
    found += [(m.start(), m.group(1).strip()) for m in _ANSWER_TAG.finditer(response)]
    found += [(m.start(), next(g for g in m.groups() if g is not None).strip()) for m in _CUED_MATH.finditer(response)]
    found += [(m.start(), m.group(1)) for m in _CUED.finditer(response)]
    if found:
        answer = max(found, key=lambda f: f[0])[1]  # (a box inside a tag starts after it: the box's)
        return None if answer is None else answer.replace("\u2212", "-")
    numbers = list(_NUMBER.finditer(response))  # "The answer is 42. It took 3 tries.": 42
    if not numbers:
        return None
    maths = [m for m in _MATH.finditer(response) if m.start() <= numbers[-1].start() < m.end()]
    if maths and any(c in maths[-1].group(0) for c in "\\^"):  # the number is a piece of LaTeX: the whole of it
        return next(g for g in maths[-1].groups() if g is not None).strip().replace("\u2212", "-")
    return numbers[-1].group(0).replace("\u2212", "-")


VERIFY_TIMEOUT_S = 10.0  # one check; past it the child is killed and the answer scores 0.0
STARTUP_TIMEOUT_S = 120.0  # a new child, until it has imported math-verify
MAX_CHECKERS = 4  # children at once, each a Python with sympy loaded; more callers wait for one
IDLE_EXIT_S = 20.0  # a child asked nothing this long exits: a finished run (or its preflight) leaves none behind
_log = logging.getLogger(__name__)


def _math(text: str) -> list:
    """math-verify's parse of one answer. Bare LaTeX (`\\frac12`) parses only inside math
    delimiters, so text without any gets `$...$` (plain numbers and `1/2` parse either way)."""
    from math_verify import parse

    if not _UNESCAPED_DOLLAR.search(text) and "\\boxed" not in text:  # `\\$18`, a money answer, is no delimiter
        text = f"${text}$"
    return parse(text, parsing_timeout=None)  # None: no SIGALRM; the parent's kill bounds it


def _equal(gold: str, answer: str) -> bool:
    """In the child: whether math-verify finds the two answers equal."""
    from math_verify import verify

    expected, predicted = _math(gold), _math(answer)
    return bool(expected and predicted) and verify(expected, predicted, timeout_seconds=None)


def _serve(idle_exit_s: float = IDLE_EXIT_S) -> None:
    """The child's loop: one JSON request per line on stdin, one reply per line, until stdin
    closes or nothing is asked for `idle_exit_s`."""
    try:  # Linux: die with the parent even in the middle of a check, when stdin is not being read
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever math-verify prints goes to stderr, never into the replies
    import math_verify  # noqa: F401  (warm before saying ready)

    replies.write('"ready"\n')
    pending = b""
    while True:
        while b"\n" not in pending:
            if not select.select([0], [], [], idle_exit_s)[0]:
                return  # idle: the parent starts another when it needs one (and leaves none behind)
            chunk = os.read(0, 65536)
            if not chunk:
                return  # the parent closed stdin, or is gone
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        try:
            reply = {"equal": _equal(request["gold"], request["answer"])}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {first_line(str(e))}"}
        replies.write(json.dumps(reply) + "\n")


class _Gone(RuntimeError):
    """The child process exited."""


class _CheckFailed(RuntimeError):
    """math-verify raised on one check; the child goes on."""


class _Checker:
    """One child process running `_serve`, asked one question at a time."""

    def __init__(self) -> None:
        command = [sys.executable, "-c", f"from meshrl.verifiers import _serve; _serve({IDLE_EXIT_S!r})"]
        # started by one long-lived thread: PDEATHSIG fires when the *thread* that started the
        # child ends, and reward calls run on threads that end with the call (rollout/env.py)
        self.proc = _SPAWNER.submit(subprocess.Popen, command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0).result()
        self._pending = b""
        try:
            if self._read(STARTUP_TIMEOUT_S) != "ready":
                raise RuntimeError("math_answer's checker process did not start")
        except BaseException:
            self.kill()
            raise

    def ask(self, gold: str, answer: str) -> bool:
        """Raises TimeoutError after VERIFY_TIMEOUT_S (the caller kills this checker)."""
        try:
            self.proc.stdin.write((json.dumps({"gold": gold, "answer": answer}) + "\n").encode())
        except BrokenPipeError:
            raise _Gone("math_answer's checker process exited") from None
        reply = self._read(VERIFY_TIMEOUT_S)
        if "error" in reply:  # the child is fine: only this check failed
            raise _CheckFailed(f"math-verify failed on {answer!r} against {gold!r}: {reply['error']}")
        return bool(reply["equal"])

    def _read(self, timeout_s: float):
        deadline, ready = time.monotonic() + timeout_s, select.poll()  # (poll: select refuses descriptors past 1023)
        ready.register(self.proc.stdout, select.POLLIN)
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not ready.poll(left * 1000):
                raise TimeoutError
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise _Gone(f"math_answer's checker process exited (status {self.proc.wait()})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshrl-math-verify")
_idle: list[_Checker] = []
_idle_lock = threading.Lock()
_slots = threading.BoundedSemaphore(MAX_CHECKERS)


@atexit.register
def _stop_checkers() -> None:
    with _idle_lock:
        while _idle:
            _idle.pop().kill()


def _check(gold: str, answer: str) -> bool:
    with _slots:
        with _idle_lock:
            warm = _idle.pop() if _idle else None
        if warm is not None:
            try:
                return _ask(warm, gold, answer)
            except _Gone:  # died since its last check (e.g. the thread that started it ended): a fresh one
                pass
        return _ask(_Checker(), gold, answer)


def _ask(checker: _Checker, gold: str, answer: str) -> bool:
    try:
        equal = checker.ask(gold, answer)
    except TimeoutError:
        checker.kill()
        _log.warning("math_answer: math-verify took longer than %gs on %.80r; scored 0.0", VERIFY_TIMEOUT_S, answer)
        return False
    except _CheckFailed:
        with _idle_lock:
            _idle.append(checker)
        raise
    except BaseException:
        checker.kill()
        raise
    with _idle_lock:
        _idle.append(checker)
    return equal


def _math_answer(prompt: str, response: str, sample: dict) -> float:
    """1.0 when the response's final answer (`final_answer`) equals `sample["answer"]`
    mathematically (math-verify: `1/2`, `0.5` and `\\frac{1}{2}` agree), else 0.0 (also when the
    check takes longer than VERIFY_TIMEOUT_S). A list answer holds the accepted forms: any of them."""
    gold = sample.get("answer")
    if gold is None or gold == []:
        raise ValueError("math_answer needs the reference answer in the record's 'answer' field (data.answer_key)")
    answer = final_answer(response)
    if answer is None:
        return 0.0
    return float(any(_check(str(g), answer) for g in (gold if isinstance(gold, (list, tuple)) else [gold])))


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
