"""Tool use: parse the model's tool calls, run Python functions as tools, answer with results.

A `ToolEnv` is an env (see `meshrl.rollout.env`) whose tools are plain Python callables,
sync or async. Each model turn is parsed for tool calls; calls are run, each bounded by a
timeout, and their results go back to the model as `tool` chat messages, which the chat
template renders. A turn without a call is the final answer and is scored.

Whatever goes wrong inside a tool (an exception, a timeout, an unknown name, malformed
JSON) becomes the tool message `error: ...`: the model is told and can try again, and a
bad call costs the episode its reward at worst, never the run.

Two call formats:
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, what Qwen and
  Hermes style chat models are trained to write, with the tools' JSON schemas in the prompt.
- `compact`: a turn starting with `!` calls the env's first tool with the rest of the turn
  as its first argument. A model trained from scratch will never sample a JSON call, but
  it can find a single `!` by chance and be rewarded for it.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Union

from meshrl.rollout.env import Message, ModelTurn, StepResult, call_bounded


@dataclass
class ToolCall:
    name: str
    """The tool's name; "" means the env's first tool (see `compact`) or, with `_error`, no tool."""
    arguments: dict[str, Any]
    """Keyword arguments; `_text` is the first parameter's value, `_error` a call that could not be parsed."""
    id: str | None = None


ToolParser = Callable[[str], list[ToolCall]]
"""The model turn's decoded text -> the tool calls in it (none: a final answer)."""

_HERMES = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)(?:</tool_call>|$)", re.DOTALL)  # from the tag nearest its close


def hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": ...}</tool_call>` block after the turn's
    reasoning (its last `</think>`; none in a turn still thinking): a call drafted while it
    thought is no call. A block left open (a turn cut by length) is parsed too; one that is
    not a valid call is returned as an error call, so the model hears what was wrong with it.
    A tag the text only mentions before a block does not swallow the block."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:
        return []
    calls = []
    for block in _HERMES.findall(text):
        try:
            calls.append(_hermes_call(json.loads(block)))
        except (ValueError, TypeError) as e:
            calls.append(ToolCall(name="", arguments={"_error": f"malformed tool call {block.strip()[:200]!r}: {e}"}))
    return calls


def _hermes_call(obj: Any) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError('expected {"name": <tool name>, "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        # OpenAI-style calls carry the arguments as a JSON string.
        arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be an object")
    call_id = obj.get("id")
    return ToolCall(name=obj["name"], arguments=arguments, id=str(call_id) if call_id is not None else None)


def compact(text: str) -> list[ToolCall]:
    """A turn starting with `!` calls the first tool with the rest of the turn (stripped) as
    its first argument; any other turn is a final answer. For tiny models trained from
    scratch, with the character tokenizer's template: `!3*4` is a whole call."""
    if not text.startswith("!"):
        return []
    return [ToolCall(name="", arguments={"_text": text[1:].strip()})]


PARSERS: dict[str, ToolParser] = {"hermes": hermes, "compact": compact}


def resolve_parser(name: str) -> ToolParser:
    """A parser by name (`hermes`, `compact`) or by import path (`mypkg.parsers:my_parser`)."""
    if name in PARSERS:
        return PARSERS[name]
    module, colon, attr = name.partition(":")
    if colon and module and attr:
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot import tool parser {name!r}: {e}") from None
    raise ValueError(f"unknown tool parser {name!r}: choose {', '.join(PARSERS)} or an import path module:callable")


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn: Callable) -> dict:
    """The OpenAI-style JSON schema of `fn`, for `tools=` of a chat template.

    From the type hints and Google-style docstring (`Args:`) when it has them, which gives
    the model a description of every argument; else from the signature alone.
    """
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        return get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException):
        pass  # no docstring, an argument it does not describe, or a hint it cannot express
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    properties: dict[str, dict] = {}
    required = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        json_type = _json_type(hints.get(name))
        properties[name] = {"type": json_type} if json_type else {}
        if param.default is param.empty:
            required.append(name)
    description = (inspect.getdoc(fn) or "").strip().split("\n\n")[0]
    return {
        "type": "function",
        "function": {"name": fn.__name__, "description": description, "parameters": {"type": "object", "properties": properties, "required": required}},
    }


def _json_type(hint: Any) -> str | None:
    # `X | None` and Optional[X] describe an X that may be left out.
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    return _JSON_TYPES.get(typing.get_origin(hint) or hint)


class ToolEnv:
    """An env that gives the model Python functions as tools.

    Each model turn is parsed with `parser`; its calls are run (at most `max_tool_calls` in
    the episode, each within `tool_timeout_s`) and answered with `tool` messages. A turn
    without a call, or one once the budget is spent, ends the episode with reward
    `score(turn text, sample)`. Subclass and override `score` for a task's own reward; the
    results returned so far are in `tool_results`.
    """

    def __init__(
        self,
        tools: list[Callable],
        parser: ToolParser | str = "hermes",
        max_tool_calls: int = 4,
        tool_timeout_s: float = 10.0,
        system_prompt: str | None = None,
    ):
        if not tools:
            raise ValueError("ToolEnv needs at least one tool")
        self.tools = {fn.__name__: fn for fn in tools}
        self.parser = resolve_parser(parser) if isinstance(parser, str) else parser
        self.max_tool_calls = max_tool_calls
        self.tool_timeout_s = tool_timeout_s
        self.system_prompt = system_prompt
        self.sample: dict = {}
        self.calls_made = 0
        self.tool_results: list[str] = []

    @property
    def step_timeout_s(self) -> float:
        """What a step's tool calls may take, each within its bound (`rollout.env` docs)."""
        return self.call_bound() * self.max_tool_calls

    def call_bound(self) -> float:
        """The next tool call's bound: tool_timeout_s (a tool that queues for a resource adds its wait)."""
        return self.tool_timeout_s

    @functools.cached_property
    def tools_schema(self) -> list[dict]:
        """The tools' JSON schemas, for the chat template's `tools=`."""
        return [tool_schema(fn) for fn in self.tools.values()]

    def reset(self, sample: dict) -> list[Message]:
        self.sample = sample
        self.calls_made = 0
        self.tool_results = []
        prompt = sample["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    async def step(self, turn: ModelTurn) -> StepResult:
        calls = self.parser(turn.text)
        budget = self.max_tool_calls - self.calls_made
        if not calls or budget <= 0:  # a plain `def score` (a slow verifier) in a thread: the worker's loop and step bound go on
            reward = await call_bounded(self.score, turn.text, self.sample, timeout=None)
            return StepResult(reward=float(reward), done=True)
        messages = []
        for i, call in enumerate(calls):
            name, content = await self._run(call) if i < budget else (call.name, f"error: tool call budget of {self.max_tool_calls} calls spent")
            message = {"role": "tool", "name": name, "content": content}
            if call.id is not None:
                message["tool_call_id"] = call.id
            messages.append(message)
        ran = min(len(calls), budget)
        self.calls_made += ran
        return StepResult(observation=messages, reward=0.0, done=False, info={"tool_calls": ran})

    async def score(self, answer_text: str, sample: dict) -> float:
        """The final answer's reward: 1 if it is the sample's `answer`, else 0."""
        return 1.0 if answer_text.strip() == str(sample.get("answer")) else 0.0

    async def _run(self, call: ToolCall) -> tuple[str, str]:
        """(tool name, result or `error: ...`) for one call; results are kept in tool_results."""
        if "_error" in call.arguments:
            return call.name, f"error: {call.arguments['_error']}"
        name = call.name or next(iter(self.tools))
        fn = self.tools.get(name)
        if fn is None:
            return name, f"error: unknown tool {name!r}; the tools are {', '.join(self.tools)}"
        arguments = dict(call.arguments)
        # `_text` goes in positionally: it is the first parameter's value, whatever its name.
        args = (arguments.pop("_text"),) if "_text" in arguments else ()
        bound = self.call_bound()
        try:
            result = await call_bounded(functools.partial(fn, *args, **arguments), timeout=bound)
        except asyncio.TimeoutError:
            return name, f"error: tool {name!r} timed out after {bound:g} s"
        except Exception as e:
            from meshrl.rollout.sandbox import SandboxError

            if isinstance(e, SandboxError):  # the sandbox failed, not the model's call: the episode fails, and is not trained on
                raise
            return name, f"error: {type(e).__name__}: {e}"
        content = str(result)
        self.tool_results.append(content)
        return name, content
