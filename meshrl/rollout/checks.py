"""The env and reward contracts (meshrl/rollout/env.py), checked before a run starts.

`check_env` refuses a `rollout.env` that is neither an env class nor a function that can
make one from `rollout.env_args`, and `check_reward_signature` a reward function that
cannot be called as (prompt, response, sample). With `contracts.probe`, `probe_user_code`
runs the user's code once on the data source's first record: the env constructed, its
`reset` and one `step` on an empty model turn (only a return that breaks the contract
counts there: the turn is not a real one), or else the reward function called with the
record's answer as the response. Each problem is one `ConfigError` of kind `contract
error` (exit 2); docs/contracts.md has the table. meshrl/scorers/checks.py probes the
scorers with the same `probe_reward` and `run_probe`.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any, Callable

from meshrl.config import Config, ConfigError
from meshrl.errors import first_line, source_location, user_location
from meshrl.imports import check_import, import_callable
from meshrl.rollout.env import (
    ContractError,
    ModelTurn,
    RewardFn,
    as_observation,
    as_step_result,
    call_bounded,
    call_reward,
    callable_name,
    env_constructor,
    env_maker,
    prompt_text,
)
from meshrl.rollout.game import Outcome, Reply, as_asks, as_outcome, is_ask


def check_env(c: Config) -> None:
    """`rollout.tool_parser`, when not built in, must import; `rollout.env` must import and
    name an env class (with `reset` and `step`) or a function that makes an env from
    rollout.env_args."""
    r = c.rollout
    if r.tool_parser not in ("hermes", "compact"):
        check_import("rollout.tool_parser", r.tool_parser, "'hermes', 'compact' or a parser function")
    if r.env is None:
        if r.env_args:
            raise ConfigError("rollout.env_args", "only rollout.env is made with env_args (a task's own env takes none): set rollout.env, or drop them")
        return
    path, env_args = r.env, r.env_args
    maker = check_import("rollout.env", path, "an env class")
    if inspect.isclass(maker):
        missing = [m for m in ("reset", "step") if not callable(getattr(maker, m, None))]
        if missing:
            raise ConfigError(
                "rollout.env",
                f"{path!r} is a class without {' and '.join(missing)}: expected an env class "
                "(reset(sample) -> observation, step(turn) -> StepResult or a gym tuple; see docs/contracts.md)",
                kind="contract error",
            )
    elif not callable(maker):
        raise ConfigError("rollout.env", f"{path!r} is a {type(maker).__name__}, not an env class or a function returning an env", kind="contract error")
    make, args = env_constructor(maker, c)  # as the workers make it (rollout/env.py `env_maker`)
    try:
        inspect.signature(make).bind(*args, **env_args)
    except TypeError as e:
        what = "its from_config" if args else "its constructor" if inspect.isclass(maker) else "it"
        raise ConfigError(
            "rollout.env",
            f"{path!r} cannot make an env from rollout.env_args {env_args}: {what} says {e}; "
            "expected an env class, or a function returning an env, that takes rollout.env_args as keyword arguments",
            kind="contract error",
        ) from None
    except ValueError:
        pass  # no signature to read (some builtins): the probe calls it


def check_reward_path(field: str, path: str) -> None:
    """`path` must import as a reward function callable as fn(prompt, response, sample)."""
    check_reward_signature(check_import(field, path, "a reward function"), field)


def check_reward_signature(fn: Callable, field: str) -> None:
    """A reward function must be callable as fn(prompt, response, sample)."""
    if not callable(fn):
        raise ConfigError(field, f"{callable_name(fn)} is a {type(fn).__name__}, not a function", kind="contract error")
    try:
        inspect.signature(fn).bind("prompt", "response", {})
    except TypeError as e:
        raise ConfigError(
            field,
            f"reward function {callable_name(fn)} cannot be called as (prompt, response, sample): {e}; "
            "expected def reward(prompt: str, response: str, sample: dict) -> float",
            kind="contract error",
        ) from None
    except ValueError:
        pass  # no signature to read: the probe calls it


def probe_user_code(c: Config, record: dict, reward_fn: RewardFn | None = None) -> None:
    """The env on `record` when there is one, else the reward function (`reward_fn`: one
    passed in code, else scoring.reward_fn) when there is one."""
    if c.rollout.env is not None:
        probe_env(c, record)
    elif reward_fn is not None or c.scoring.reward_fn is not None:
        fn, field = (reward_fn, "reward_fn") if reward_fn is not None else (import_callable(c.scoring.reward_fn), "scoring.reward_fn")
        probe_reward(c, fn, field, record)


def run_probe(make: Callable[[], Any], limit_s: float) -> Any:
    """`asyncio.run(make())` on a thread of its own, abandoned after `limit_s` (a hung user
    call cannot hold the command); its exception is raised here."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(make())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=target, name="meshrl-preflight-probe", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise TimeoutError(f"took longer than {limit_s:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _raised(e: BaseException, what: str) -> str:
    where = getattr(e, "where", None) or user_location(e)
    return f"{what} raised {type(e).__name__}: {first_line(str(e)) or '(no message)'}" + (f" ({where})" if where else "")


def probe_env(c: Config, record: dict) -> None:
    """Construct the env, reset it on `record`, step it once on an empty model turn, close it."""
    r = c.rollout
    make, timeout = env_maker(c), r.env_timeout_s
    source = c.data.source

    def fail(message: str) -> ConfigError:
        return ConfigError("rollout.env", message, kind="contract error")

    async def probe() -> None:
        try:  # on a thread of its own, as a worker makes it (no running event loop there)
            env = await call_bounded(make, timeout=timeout)
        except (asyncio.TimeoutError, TimeoutError) as e:
            if str(e):
                raise fail(_raised(e, f"making the env {r.env!r} with rollout.env_args {r.env_args}")) from None
            raise fail(f"making the env {r.env!r} took longer than rollout.env_timeout_s={timeout:g}s") from None
        except Exception as e:  # noqa: BLE001 - the user's constructor
            raise fail(_raised(e, f"making the env {r.env!r} with rollout.env_args {r.env_args}")) from None
        name = f"env {callable_name(type(env))}"
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        if missing:
            raise fail(f"{r.env!r} made {str(env)[:60]!r} ({type(env).__name__}), which has no {' or '.join(missing)} method: expected an env")
        try:
            try:
                first = await call_bounded(env.reset, dict(record), timeout=timeout)
                if is_ask(first):  # a game (meshrl/rollout/game.py): its asks, and one step on empty replies
                    return await _probe_game(c, env, first, timeout)
                as_observation(first, env)
            except ContractError as e:
                raise fail(f"{e} ({e.where})" if e.where else str(e)) from None
            except (asyncio.TimeoutError, TimeoutError):
                raise fail(f"{name}: reset of the first record of {source} took longer than rollout.env_timeout_s={timeout:g}s") from None
            except Exception as e:  # noqa: BLE001 - the user's reset
                raise fail(_raised(e, f"{name}: reset of the first record of {source}")) from None
            if c.models:  # without a game every row would be the policy's, and the other models would train on them
                others = ", ".join(m.name for m in c.models)
                raise fail(
                    f"{name}: reset returned an observation, not an Ask: the models beside the policy ({others}) speak only in a game (docs/coevolve.md)"
                )
            try:
                as_step_result(await call_bounded(env.step, ModelTurn("", [], "stop", 0), timeout=timeout), env)
            except ContractError as e:
                raise fail(f"{e}, on an empty first model turn" + (f" ({e.where})" if e.where else "")) from None
            except Exception:  # noqa: BLE001 - an empty turn is not a real one: the run's own calls are checked
                pass
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    await call_bounded(close, timeout=timeout)
                except Exception:  # noqa: BLE001 - a failing close is the env's problem alone
                    pass

    try:
        run_probe(probe, 4 * timeout + 10)
    except TimeoutError as e:  # the whole probe (a constructor that hangs)
        raise fail(f"trying env {r.env!r} on the first record {e}: raise rollout.env_timeout_s, or set contracts.probe=false") from None


async def _probe_game(c: Config, env, first, timeout: float) -> None:
    """A game's reset checked against the run's models, then one step on empty replies (only a
    return that breaks the contract fails: an empty turn is not a real one)."""
    names, speakers = c.model_names(), {}
    asks = as_asks(first, env, names, speakers, "reset")
    speakers.update({a.thread: a.model for a in asks})
    replies = [Reply(a.model, a.thread, "", [], "stop", i) for i, a in enumerate(asks)]
    try:
        result = await call_bounded(env.step, replies if isinstance(first, list) else replies[0], timeout=timeout)
    except Exception:  # noqa: BLE001 - the run's own calls are checked
        return
    if isinstance(result, Outcome):
        as_outcome(result, env, speakers)
    else:
        as_asks(result, env, names, speakers, "step")


def probe_reward(c: Config, fn: RewardFn, field: str, record: dict, timeout: float | None = None, bound: str = "scoring.timeout_s") -> None:
    """Call the reward function on `record`, its answer as the response, under the contract
    and its bound (`timeout`, the knob `bound`; default scoring.timeout_s)."""
    answer = record.get("answer")
    sample = {**record, "finish_reason": "stop", "response_ids": []}
    timeout = c.scoring.timeout_s if timeout is None else timeout
    name = f"reward function {callable_name(fn)}"

    async def probe() -> float:
        return await call_reward(fn, prompt_text(record["prompt"]), answer if isinstance(answer, str) else "", sample, timeout, bound)

    try:
        run_probe(probe, timeout + 10)
    except ContractError as e:
        where = e.where or source_location(fn)
        raise ConfigError(field, f"{e}, on the first record of {c.data.source}" + (f" ({where})" if where else ""), kind="contract error") from None
    except (asyncio.TimeoutError, TimeoutError) as e:
        raise ConfigError(field, f"{first_line(str(e)) or name + ' timed out'}, on the first record of {c.data.source}", kind="contract error") from None
    except Exception as e:  # noqa: BLE001 - the user's function
        raise ConfigError(field, _raised(e, f"{name}, on the first record of {c.data.source},"), kind="contract error") from None
