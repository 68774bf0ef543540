"""The environment protocol: what a rollout worker talks to between two model turns.

    obs = await env.reset(sample)                 # the prompt: text, chat messages or token ids
    while True:
        turn = <the model's reply to everything so far>
        result = await env.step(turn)             # a StepResult, or a gym tuple
        if result.done: break
        <result.observation is appended to the episode, then the model speaks again>

An observation is a plain string (tokenized as is), a list of chat messages (rendered by
the tokenizer's chat template) or a list of token ids (appended as they are). Methods may
be sync or async; a rollout worker bounds every call by `rollout.env_timeout_s`, and an
env that raises or times out fails its episode (reward 0), not the run.

An env may also hold a `max_new_tokens` attribute: the token budget of the next model turn
(None or absent: `generator.max_new_tokens`, which also caps it; 0 ends the episode as its
length would; anything else but a non-negative int fails the episode). Setting it in `reset`
and `step` gives each turn its own budget. A single-turn env takes it from the record's
`max_new_tokens` field, so a data row can carry its own budget. Token ids an env sends lie in
the model's vocabulary, or the episode fails. An env whose step does bounded work of its own
(tool calls, sandbox runs, a reward call) says how long it may take in `step_timeout_s`,
which its step gets beyond `rollout.env_timeout_s`.

A user's env is any class with these two methods (or a function returning such an
object), named by import path in YAML (`rollout.env: mypkg.envs:MazeEnv`, called with
`rollout.env_args`, or through its classmethod `from_config(config, **env_args)` where it
has one, to read the run's config); one instance plays one episode. Single-turn tasks and reward
functions run as a `SingleTurnEnv`.

The contract, checked on every call (`as_observation`, `as_step_result`, `as_reward`):
- `reset` returns an observation, or gymnasium's `(observation, info)`: a tuple of two
  whose first item is an observation and whose second is a dict. An observation is never
  a tuple, so this reading is unambiguous; any other tuple is refused.
- `step` returns a `StepResult`, the gym tuple `(observation, reward, done, info)`, or
  gymnasium's `(observation, reward, terminated, truncated, info)` (done = terminated or
  truncated; truncated and not terminated ends the episode as `length`, as gym's
  `info["TimeLimit.truncated"]` does). The reward is a finite number (a bool counts as 0 or 1), `done` a bool, `info`
  a dict or None, and an episode that goes on needs an observation.
- a reward function returns a finite number.
Anything else raises `ContractError`, one line naming the env or function, the method,
what it returned and what is expected: the episode fails with it, as with any exception.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import math
import numbers
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Union, runtime_checkable

from meshrl.errors import first_line, source_location, user_location

Message = dict[str, Any]
Observation = Union[str, list[Message], list[int]]
RewardFn = Callable[[str, str, dict], Union[float, Awaitable[float]]]
"""(prompt text, response text, sample) -> reward; sync or async."""


@dataclass
class ModelTurn:
    """What the model said in one turn, as the env sees it."""

    text: str
    """The sampled tokens decoded, special tokens skipped."""
    token_ids: list[int]
    """The sampled ids, exactly (never re-tokenized)."""
    finish_reason: str
    """`stop` (end-of-turn token), `length` (token budget) or `abort`."""
    index: int = 0
    """0 for the episode's first model turn, 1 for the next, ..."""


@dataclass
class StepResult:
    observation: Observation | None = None
    """What the env says next (ignored when done)."""
    reward: float = 0.0
    """Reward for this turn; the episode's reward is the sum over its turns."""
    done: bool = True
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form; `tool_calls` (an int) is counted in the episode metrics."""
    truncated: bool = False
    """Done because the env cut the episode short (a time or turn limit of its own), not because
    it ended: recorded as finish_reason `length` and counted in `episode/truncated`."""


@runtime_checkable
class Env(Protocol):
    def reset(self, sample: dict) -> Observation | Awaitable[Observation]: ...

    def step(self, turn: ModelTurn) -> StepResult | Awaitable[StepResult]: ...


class ContractError(Exception):
    """User code returned what its contract with meshrl does not allow; `where` is the
    file:line of the method or function that returned it."""

    def __init__(self, message: str, where: str | None = None):
        super().__init__(message)
        self.where = where


def callable_name(fn) -> str:
    """`module:qualname` of a function, method or class (a bound method names its class)."""
    fn = inspect.unwrap(fn) if callable(fn) else fn
    owner = getattr(fn, "__self__", None)
    if owner is not None and not inspect.isclass(owner) and not inspect.ismodule(owner):
        owner_type = type(owner)
        return f"{owner_type.__module__}:{owner_type.__qualname__}.{getattr(fn, '__name__', '?')}"
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}:{getattr(fn, '__qualname__', None) or type(fn).__qualname__}"


def _where(fn) -> str | None:
    return source_location(fn) if fn is not None else None


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{text} ({type(value).__name__})"


def is_observation(value: Any) -> bool:
    """Text, a list of chat messages (dicts with `role` and `content`) or a list of token ids."""
    if isinstance(value, str):
        return True
    if not isinstance(value, list):
        return False
    return all(isinstance(m, dict) and "role" in m and "content" in m for m in value) or all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value
    )


OBSERVATION = "text, a list of chat messages ({'role', 'content'} dicts) or a list of token ids"


def as_reward(value: Any, what: str, where: str | None = None) -> float:
    """`value` as a finite float; ContractError naming `what` returned it otherwise."""
    if isinstance(value, (numbers.Real, bool)) or (hasattr(type(value), "__float__") and not isinstance(value, (str, bytes))):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if number is not None:
            if not math.isfinite(number):
                raise ContractError(f"{what} returned {number}: expected a finite number", where)
            return number
    raise ContractError(f"{what} returned {_shown(value)}: expected a finite number", where)


def as_observation(value: Any, env: Any) -> Observation:
    """What `env.reset` returned, as an observation: one, or gymnasium's (observation, info).
    An empty one is refused: the episode's first turn needs a prompt (vLLM refuses an empty one,
    which would fail the replica, not the episode)."""
    if isinstance(value, tuple) and len(value) == 2 and is_observation(value[0]) and isinstance(value[1], dict):
        value = value[0]
    if is_observation(value) and len(value) == 0:
        raise ContractError(
            f"env {callable_name(type(env))}: reset returned an empty observation: the first turn needs a prompt", _where(getattr(env, "reset", None))
        )
    if is_observation(value):
        return value
    raise ContractError(
        f"env {callable_name(type(env))}: reset returned {_shown(value)}: expected {OBSERVATION}, or gymnasium's (observation, info)",
        _where(getattr(env, "reset", None)),
    )


def env_budget(env: Any) -> int | None:
    """The env's `max_new_tokens` for the next model turn: None (the generator's), or a
    non-negative int (0: the episode ends, out of length). Anything else is a ContractError
    (a negative budget reached the generator, which refused it as a replica's failure)."""
    asked = getattr(env, "max_new_tokens", None)
    if asked is None:
        return None
    whole = isinstance(asked, numbers.Integral) or (isinstance(asked, float) and asked.is_integer())  # numpy's, 512.0 from a data file
    if whole and not isinstance(asked, bool) and asked >= 0:
        return int(asked)
    raise ContractError(f"env {callable_name(type(env))}: max_new_tokens is {_shown(asked)}: expected a non-negative int, or None", _where(type(env)))


def as_step_result(value: Any, env: Any) -> StepResult:
    """What `env.step` returned, as a StepResult: one, a gym 4-tuple or a gymnasium 5-tuple."""
    name, where = f"env {callable_name(type(env))}", _where(getattr(env, "step", None))
    cut = False
    if isinstance(value, StepResult):
        observation, reward, done, info, cut = value.observation, value.reward, value.done, value.info, value.truncated
    elif isinstance(value, tuple) and len(value) == 4:
        observation, reward, done, info = value
        cut = isinstance(info, dict) and info.get("TimeLimit.truncated") is True  # gym's TimeLimit wrapper
    elif isinstance(value, tuple) and len(value) == 5:
        observation, reward, terminated, truncated, info = value
        if not (_is_bool(terminated) and _is_bool(truncated)):
            raise ContractError(f"{name}: step returned terminated={_shown(terminated)}, truncated={_shown(truncated)}: expected bools", where)
        done = bool(terminated) or bool(truncated)
        cut = bool(truncated) and not bool(terminated)
    else:
        raise ContractError(
            f"{name}: step returned {_shown(value)}: expected a StepResult, the gym tuple (observation, reward, done, info) "
            "or gymnasium's (observation, reward, terminated, truncated, info)",
            where,
        )
    reward = as_reward(reward, f"{name}: step's reward", where)
    if not _is_bool(done):
        raise ContractError(f"{name}: step returned done={_shown(done)}: expected a bool", where)
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise ContractError(f"{name}: step returned info={_shown(info)}: expected a dict or None", where)
    if not done and not is_observation(observation):
        raise ContractError(f"{name}: step returned done=False with observation {_shown(observation)}: expected {OBSERVATION} for the model's next turn", where)
    return StepResult(observation, reward, bool(done), info, truncated=bool(done) and bool(cut))


def _is_bool(value: Any) -> bool:
    try:
        return type(value).__name__ in ("bool", "bool_") or (isinstance(value, numbers.Integral) and value in (0, 1))
    except (TypeError, ValueError):
        return False


def env_maker(config) -> Callable[[], Any]:
    """`rollout.env` as a maker of fresh envs, as the rollout workers and preflight's probe
    both make them: `from_config(config, **rollout.env_args)` where it has that classmethod,
    else called with rollout.env_args."""
    from meshrl.imports import import_callable

    r = config.rollout
    make, args = env_constructor(import_callable(r.env), config)
    return lambda: make(*args, **r.env_args)


def env_constructor(maker, config) -> tuple[Callable[..., Any], tuple]:
    """What makes an env of `maker` (rollout.env imported) and its positional arguments before
    rollout.env_args: its `from_config` classmethod with the run's config, where it has one."""
    from_config = getattr(maker, "from_config", None)
    return (from_config, (config,)) if from_config is not None else (maker, ())


async def call_bounded(fn: Callable, *args: Any, timeout: float, late: Callable[[Any], None] | None = None) -> Any:
    """Call a sync or async function with a time limit. A sync function runs in a thread of
    its own, so a slow one cannot stall the worker's event loop; on timeout it is abandoned,
    and a call that never returns holds only its own thread (in asyncio's shared pool a few
    of them would leave every later call, the sandbox's too, queued behind them). `late` is
    called, on the loop, with what an abandoned call returns after all (an env to close)."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(_no_exit(fn(*args)), timeout)
    loop = asyncio.get_running_loop()
    slots = _LIVE.get(loop) or _LIVE.setdefault(loop, asyncio.Semaphore(LIVE_CALLS))
    # The bound is the call's own: a wait for a slot behind LIVE_CALLS others is not the user's
    # code being slow (and ends, as each of them holds its slot at most its own bound).
    await slots.acquire()
    try:
        result = await asyncio.wait_for(_in_own_thread(fn, *args, late=late), timeout)
    finally:
        slots.release()  # returned, raised, or abandoned at its bound: a hung thread holds no slot
    if inspect.isawaitable(result):
        result = await asyncio.wait_for(_no_exit(result), timeout)
    return result


def _exited(e: BaseException) -> RuntimeError:
    """What user code raised that would not read as its call's failure, as one: exit()
    (argparse, a tool running model-written code) would end the worker's event loop;
    StopIteration (a `next()` run dry) cannot be handed to a future, so the call read as timed
    out at its bound; a CancelledError of its own (it awaited a cancelled future) reads as the
    worker's task cancelled, and its group was never delivered nor handed out again."""
    if isinstance(e, SystemExit):
        return RuntimeError(f"it called exit({e.code!r}): user code returns or raises, it does not end the process")
    failure = RuntimeError(f"it raised {type(e).__name__}{': ' + first_line(str(e)) if str(e) else ''}")
    failure.where = user_location(e)  # where the user's code raised it
    return failure


async def _no_exit(awaitable) -> Any:
    try:
        return await awaitable
    except (SystemExit, StopIteration) as e:
        raise _exited(e) from e
    except asyncio.CancelledError as e:
        if asyncio.current_task().cancelling():  # this task cancelled (its bound, a stop): as it is
            raise
        raise _exited(e) from e


async def close_env(env: Any, timeout: float) -> None:
    """`env.close()` where it has one, bounded; a failing close is the env's problem alone."""
    close = getattr(env, "close", None)
    if close is not None:
        try:
            await call_bounded(close, timeout=timeout)
        except Exception:  # noqa: BLE001
            pass


LIVE_CALLS = 64
"""Sync calls of one event loop running at once, each on a thread of its own (the rest wait, and
their bounds start when they run); a call abandoned at its bound stops counting. (Each call may run on another thread: an env that needs one thread
for all of its calls, sqlite's connections, keeps an executor of its own, as openenv.py does.)"""
_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its slots


def _in_own_thread(fn: Callable, *args: Any, late: Callable[[Any], None] | None = None) -> asyncio.Future:
    """`fn(*args)` on a new daemon thread (with this context's variables, as asyncio.to_thread);
    what it returns after the future was abandoned goes to `late`."""
    loop, context = asyncio.get_running_loop(), contextvars.copy_context()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # abandoned: cancelled by its timeout
            if late is not None and error is None:
                late(result)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            outcome = (context.run(fn, *args), None)
        except (SystemExit, StopIteration, asyncio.CancelledError) as e:
            outcome = (None, _exited(e))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for it
            pass

    threading.Thread(target=run, name=f"meshrl-call-{callable_name(fn)}", daemon=True).start()
    return future


def prompt_text(observation: Observation) -> str:
    """A prompt as plain text for reward functions: the last user message of a chat."""
    if isinstance(observation, str):
        return observation
    if observation and isinstance(observation[0], dict):
        users = [m.get("content", "") for m in observation if m.get("role") == "user"]
        return str(users[-1]) if users else ""
    return ""


class SingleTurnEnv:
    """One prompt, one model turn, one reward: every single-turn task and reward function.

    `reset` hands out `sample["prompt"]` (text or chat messages), and the record's
    `max_new_tokens` (if any) budgets the reply; `step` scores the reply with
    `reward_fn(prompt, response, sample)`, where `sample` also carries the reference answer,
    the task's extra fields, `finish_reason` and `response_ids`.
    """

    def __init__(self, reward_fn: RewardFn, timeout_s: float = 30.0):
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self.step_timeout_s = timeout_s  # its reward's bound (scoring.timeout_s), not cut short by rollout.env_timeout_s

    async def reset(self, sample: dict) -> Observation:  # a coroutine: no thread hop for a dict lookup
        self.sample = sample
        self.max_new_tokens = sample.get("max_new_tokens")
        return sample["prompt"]

    async def step(self, turn: ModelTurn) -> StepResult:
        sample = {**self.sample, "finish_reason": turn.finish_reason, "response_ids": turn.token_ids}
        value = await call_reward(self.reward_fn, prompt_text(self.sample["prompt"]), turn.text, sample, self.timeout_s)
        return StepResult(reward=value, done=True)


async def call_reward(
    fn: RewardFn, prompt: str, response: str, sample: dict, timeout_s: float, bound: str = "scoring.timeout_s", steps: int | None = None
) -> float | list[float]:
    """One reward call under the contract: bounded by `timeout_s` (the knob `bound`), a
    finite number back; with `steps` (a process scorer, meshrl/scorers/process.py) a list
    of that many finite numbers, one per step."""
    name = f"reward function {callable_name(fn)}"
    try:
        value = await call_bounded(fn, prompt, response, sample, timeout=timeout_s)
    except (asyncio.TimeoutError, TimeoutError) as e:
        if not str(e):
            raise TimeoutError(f"{name} took longer than {bound}={timeout_s:g}s") from None
        raise
    except Exception as e:
        if getattr(e, "where", None) is None and user_location(e) is None:  # the call itself failed (a wrong signature): point at the function
            e.where = _where(fn)
        raise
    if steps is None:
        return as_reward(value, name, _where(fn))
    if not isinstance(value, (list, tuple)) or len(value) != steps:
        raise ContractError(f"{name} returned {_shown(value)}: expected a list of {steps} finite numbers, one per step", _where(fn))
    return [as_reward(v, f"{name}, step {k + 1}", _where(fn)) for k, v in enumerate(value)]
