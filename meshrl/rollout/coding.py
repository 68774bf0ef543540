"""Model-written code as a tool and as an answer, always run in the sandbox.

- `PythonToolEnv`: a `ToolEnv` whose tool `python(code)` runs the code in a sandbox
  (meshrl/rollout/sandbox.py) and answers with its stdout, or `error: ...` (the limit hit or
  the exit status, and the last line of stderr). Like the Python REPL, code that is one
  expression prints its value.
- `CodeEnv`: a coding task. Each record has a `prompt` and hidden `tests`; the model may call
  the `python` tool (`max_tool_calls`), and its final answer (the last ```python block of
  the turn, else the whole turn; inserted into the record's `template` when it has one) is
  scored by the tests in the sandbox: reward = the fraction passed.

Two kinds of tests, mixed freely in a record's `tests` list:
- `{"input": "...", "output": "..."}`: the solution runs as a program with that stdin, one
  sandbox per test; it passes when it exits 0 and its stdout equals `output` (surrounding
  whitespace ignored). The expected output never enters the sandbox.
- `"assert f(2) == 4"` (any statements): all of a record's statements run in one sandbox
  after the solution, each caught on its own; a statement passes when it raises nothing.
  The harness reports with a per-call random marker, but it runs in the solution's process:
  a solution written to find the marker could fake its report. Use input/output tests where
  that matters.

A data set of problems: one JSON object per line, e.g.
`{"prompt": "Write f(x) returning x squared.", "tests": ["assert f(3) == 9", "assert f(0) == 0"]}`
or with `{"input": ..., "output": ...}` tests; run it with
`data.source=problems.jsonl rollout.env=meshrl.rollout.coding:CodeEnv` (the run's
`rollout.tool_parser` reads tool calls; `rollout.env_args: {max_tool_calls: 0}` makes it
single-turn). The rows' extra fields (`tests`, `template`) reach the env untouched.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import secrets
from typing import Any

from meshrl.config import Config, SandboxConfig
from meshrl.rollout.sandbox import START_TIMEOUT_S, SandboxError, SandboxPool, SandboxResult, get_pool
from meshrl.rollout.tools import ToolEnv

TOOL_REPLY_CHARS = 400
"""Longest tool reply the model sees (each character is a token of its context)."""


def repl_code(code: str) -> str:
    """`code` as the REPL runs it: a lone expression prints its value (None prints nothing)."""
    try:
        ast.parse(code, mode="eval")
    except SyntaxError:
        return code
    return f"_ = ({code}\n)\nif _ is not None:\n    print(repr(_) if not isinstance(_, str) else _)"


class PythonToolEnv(ToolEnv):
    """A ToolEnv with one tool, `python`, run in the sandbox (`rollout.sandbox`)."""

    uses_sandbox = True
    """Preflight checks the sandbox for envs that carry this."""

    def __init__(
        self,
        config: Config | None = None,
        parser: str | None = None,
        max_tool_calls: int = 2,
        system_prompt: str | None = None,
        tool_reply_chars: int = TOOL_REPLY_CHARS,
    ):
        self.run_config = config
        self.sandbox_config = config.rollout.sandbox if config is not None else SandboxConfig()
        parser = parser or (config.rollout.tool_parser if config is not None else "hermes")
        timeout = self.sandbox_config.wall_timeout_s + 30.0  # the sandbox bounds itself; this covers its start
        super().__init__([self.python], parser=parser, max_tool_calls=max(max_tool_calls, 1), tool_timeout_s=timeout, system_prompt=system_prompt)
        self.max_tool_calls = max_tool_calls
        self.tool_reply_chars = tool_reply_chars
        self.last_result: SandboxResult | None = None

    @classmethod
    def from_config(cls, config: Config, **env_args: Any) -> "PythonToolEnv":
        """How a rollout worker makes one for `rollout.env` (with `rollout.env_args`)."""
        return cls(config, **env_args)

    @property
    def pool(self) -> SandboxPool:
        return get_pool(self.sandbox_config)

    def waiting(self) -> int:
        """Sandbox calls the worker's pool holds already (queued or running)."""
        try:
            return self.pool.pending
        except (RuntimeError, SandboxError):  # read outside a worker's event loop, or no sandbox here
            return 0

    def call_bound(self) -> float:
        """A python call's bound: its start and wall time, behind the calls queued ahead of it
        (`max_concurrent` run at a time): a wait for a sandbox is not the model's code hanging."""
        rounds = -(-(self.waiting() + 1) // self.sandbox_config.max_concurrent)
        return max(self.tool_timeout_s, rounds * (self.sandbox_config.wall_timeout_s + START_TIMEOUT_S))

    async def python(self, code: str = "") -> str:
        """Run Python code in a sandbox and return what it printed.

        Args:
            code: the program; a single expression prints its value.
        """
        result = await self.pool.run(repl_code(code))
        self.last_result = result
        return result.summary(self.tool_reply_chars) if result.ok else _error_line(result, self.tool_reply_chars)


def _error_line(result: SandboxResult, max_chars: int) -> str:
    text = result.summary(max_chars)
    return text if text.startswith("error:") else f"error: {text}"


# ---- hidden tests ---------------------------------------------------------------------------------
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block of a reply, else the reply itself."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def solution_code(answer_text: str, sample: dict) -> str:
    code = extract_code(answer_text)
    template = sample.get("template")
    return template.replace("{answer}", code.strip()) if template else code


def _harness(solution: str, statements: list[str], marker: str) -> str:
    # the solution runs in globals of its own, under a runner whose exec and print were bound
    # before it ran: a solution that defines its own `exec` (one that runs nothing) or replaces
    # the builtins passes no assert by it; `from __future__` still opens the solution's code.
    # It is imported, not run as a program: its `if __name__ == "__main__":` block (reading
    # stdin, which is empty) would fail it before any assert ran.
    return (
        "def _meshrl_tests(_solution, _tests, _exec=exec, _print=print, _compile=compile):\n"
        "    _g = {'__name__': 'solution'}\n"
        "    _exec(_compile(_solution, 'solution.py', 'exec'), _g)\n"
        "    _r = []\n"
        "    for _t in _tests:\n"
        "        try:\n"
        "            _exec(_t, _g)\n"
        "            _r.append('1')\n"
        "        except BaseException:\n"
        "            _r.append('0')\n"
        f"    _print({marker!r} + ''.join(_r))\n"
        f"_meshrl_tests({solution!r}, {statements!r})\n"  # (repr: json.dumps would cut a character past U+FFFF in two)
    )


async def run_tests(pool: SandboxPool, solution: str, tests: list) -> tuple[int, int]:
    """(tests passed, tests) of `solution` against `tests` (see the module doc), in the sandbox."""
    if isinstance(tests, str):
        tests = json.loads(tests)
    statements = [t for t in tests if isinstance(t, str)]
    io_tests = [t for t in tests if isinstance(t, dict)]
    if len(statements) + len(io_tests) != len(tests):
        raise ValueError("each test is an assert statement (a string) or {'input': ..., 'output': ...}")
    passed = 0
    calls = []
    marker = f"meshrl-tests-{secrets.token_hex(8)}:"
    if statements:
        calls.append(pool.run(_harness(solution, statements, marker)))
    for t in io_tests:  # an expected output past the tool's output cap still fits, with room to be wrong
        cap = max(pool.config.max_output_bytes, 2 * len(str(t.get("output", "")).encode()) + 4096)
        calls.append(pool.run(solution, stdin=str(t.get("input", "")), max_output_bytes=cap))
    results = await asyncio.gather(*calls)
    if statements:
        result = results.pop(0)
        lines = [line for line in result.stdout.splitlines() if line.startswith(marker)]
        if result.limit is None and lines:
            flags = lines[-1][len(marker) :]
            passed += sum(f == "1" for f in flags[: len(statements)])
    for t, result in zip(io_tests, results):
        passed += int(result.ok and result.stdout.strip() == str(t.get("output", "")).strip())
    return passed, len(tests)


class CodeEnv(PythonToolEnv):
    """A coding task: the record's `tests` are hidden; the final answer's reward is the fraction
    of them that pass in the sandbox. `max_tool_calls` python calls may come first."""

    @property
    def step_timeout_s(self) -> float:
        """The tool calls' bound, or running the record's hidden tests behind the calls the
        worker's sandbox pool holds already: `max_concurrent` at a time, each within its wall
        time and start (the asserts run as one)."""
        tests = self.sample.get("tests") or []
        if isinstance(tests, str):
            try:
                tests = json.loads(tests)
            except ValueError:
                tests = [tests]
        runs = 1 + sum(isinstance(t, dict) for t in tests) + self.waiting()
        rounds = -(-runs // self.sandbox_config.max_concurrent)
        return max(super().step_timeout_s, rounds * (self.sandbox_config.wall_timeout_s + START_TIMEOUT_S))

    async def score(self, answer_text: str, sample: dict) -> float:
        tests = sample.get("tests")
        if not tests:
            raise ValueError("a coding record needs a non-empty `tests` field")
        passed, total = await run_tests(self.pool, solution_code(answer_text, sample), tests)
        return passed / total
