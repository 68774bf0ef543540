"""OpenEnv environments as meshrl envs: `rollout.env: meshrl.rollout.openenv:OpenEnvEnv`.

One meshrl episode is one OpenEnv episode. `env_args` pick where the env lives:

- `env: pkg.module:EnvironmentClass` (+ `env_kwargs`): a fresh instance in the rollout
  worker's process per episode, on a thread of its own (OpenEnv envs are sync and some
  are bound to the thread that made them, as OpenEnv's own server assumes);
- `base_url: http://host:port` (+ `client: pkg.module:ClientClass`, the env's EnvClient
  subclass; default OpenEnv's generic client, which speaks plain dicts): one WebSocket
  session per episode on a server the user started, closed in `close()`. The WebSocket is
  the only way to play more than one step: OpenEnv's POST /reset and /step build a fresh
  env per request.

Each model turn becomes one Action (its text in the action's one text field, or
`action_fn(turn)`), and each Observation becomes what the model reads next (its text
field as a user message, or `observation_fn(observation)`); reward and done are the
Observation's. The record reaches the env only through reset's keyword arguments: its
`seed` and `episode_id` fields by default, so the episodes of one group, which share a
record, play the same game and their rewards compare. docs/envs.md has the options.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import math
import typing
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from meshrl.compat import openenv_unread_message
from meshrl.imports import import_callable, missing_extra
from meshrl.rollout.env import ModelTurn, Observation, StepResult

_MISSING = missing_extra("openenv")
if _MISSING is not None:  # fail at preflight, where rollout.env is imported, not mid-run
    raise ImportError(f"meshrl.rollout.openenv {_MISSING}")

# Loading openenv takes seconds (its package imports its server side and gradio): here, at
# module import, it happens once when a rollout worker starts, not inside an episode.
from openenv.core.env_client import EnvClient  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action  # noqa: E402
from openenv.core.generic_client import GenericEnvClient  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402 - openenv's client library

TEXT_FIELDS = ("prompt", "messages", "text", "message", "content", "observation", "feedback", "output")
"""Observation fields read for the model, first non-empty one wins; else its only text field."""
_NOT_CONTENT = {"reward", "done", "metadata"}
_CAPACITY = "CAPACITY_REACHED"
"""The code an OpenEnv server answers when it holds its max_concurrent_envs sessions."""


class OpenEnvEnv:
    """A meshrl Env playing one episode of an OpenEnv environment (see the module docstring
    and docs/envs.md). Construction only checks and imports; the env or connection is made
    in `reset`, which the rollout worker bounds by `rollout.env_timeout_s`."""

    def __init__(
        self,
        env: str | None = None,
        env_kwargs: dict | None = None,
        base_url: str | None = None,
        client: str | None = None,
        client_kwargs: dict | None = None,
        action: str | None = None,
        action_field: str | None = None,
        action_fn: str | None = None,
        observation_field: str | None = None,
        observation_fn: str | None = None,
        chat: bool = True,
        system_prompt: str | None = None,
        prompt_from: str = "env",
        reset_fields: Sequence[str] = ("seed", "episode_id"),
        reset_kwargs: dict | None = None,
    ):
        if (env is None) == (base_url is None):
            raise ValueError(
                "OpenEnvEnv needs exactly one of env_args.env (an OpenEnv Environment class, played in "
                "this process) and env_args.base_url (a running OpenEnv server)"
            )
        if env is not None and (client or client_kwargs):
            raise ValueError("env_args.client and client_kwargs go with base_url, not with env")
        if base_url is not None and env_kwargs:
            raise ValueError("env_args.env_kwargs go with env; a server builds its envs itself")
        if prompt_from not in ("env", "record"):
            raise ValueError(f"env_args.prompt_from must be 'env' or 'record', got {prompt_from!r}")
        if system_prompt and not chat:
            raise ValueError("env_args.system_prompt needs chat: true (it is a system message)")
        self.base_url = base_url
        self.env_kwargs = dict(env_kwargs or {})
        self.client_kwargs = dict(client_kwargs or {})
        self.chat, self.system_prompt, self.prompt_from = chat, system_prompt, prompt_from
        self.reset_fields, self.reset_kwargs = list(reset_fields), dict(reset_kwargs or {})
        self.observation_field = observation_field
        self._make_env = import_callable(env) if env else None
        self._client_cls = (import_callable(client) if client else GenericEnvClient) if base_url else None
        if self._client_cls is not None and not (isinstance(self._client_cls, type) and issubclass(self._client_cls, EnvClient)):
            raise TypeError(f"env_args.client {client!r} is not an openenv EnvClient subclass")
        self._action_cls = import_callable(action) if action else None
        self._action_field = action_field
        self._action_fn = import_callable(action_fn) if action_fn else None
        self._observation_fn = import_callable(observation_fn) if observation_fn else None
        self._env: Any = None
        self._client: EnvClient | None = None
        self._thread: ThreadPoolExecutor | None = None
        self.max_new_tokens: int | None = None

    # ---- the meshrl Env protocol ---------------------------------------------------------------
    async def reset(self, sample: dict) -> Observation:
        self.max_new_tokens = sample.get("max_new_tokens")
        kwargs = {**self.reset_kwargs, **{k: sample[k] for k in self.reset_fields if sample.get(k) is not None}}
        if self._client_cls is not None:
            observation = (await self._connect_and_reset(kwargs)).observation
            self._bind_action(self._client_cls, "_step_payload")
        else:
            observation = await self._reset_in_process(kwargs)
            self._bind_action(type(self._env), "step")
        if self.prompt_from == "record":
            return self._for_model(sample["prompt"], first=True)
        return self._read(observation, first=True)

    async def step(self, turn: ModelTurn) -> StepResult:
        action = self._action_fn(turn) if self._action_fn else {self._action_field: turn.text}
        if inspect.isawaitable(action):
            action = await action
        if isinstance(action, dict) and self._action_cls is not None:
            action = self._action_cls.model_validate(action)
        if self._client is not None:
            result = await self._client.step(action)
            observation, reward, done = result.observation, result.reward, result.done
        else:
            if _own_async(self._env, "step_async"):
                observation = await self._env.step_async(action)
            else:
                observation = await self._in_thread(self._env.step, action)
            reward, done = observation.reward, observation.done
        reward = 0.0 if reward is None else float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"the OpenEnv env's reward is {reward}")
        if done:  # the worker reads no observation after the last turn: none is made
            return StepResult(reward=reward, done=True)
        return StepResult(observation=self._read(observation, first=False), reward=reward, done=False)

    async def close(self) -> None:
        """Close the WebSocket session (the server frees its env) or the in-process env.
        Called by the worker at the end of every episode, also a failed or timed-out one."""
        client, self._client = self._client, None
        thread, self._thread = self._thread, None
        try:
            if client is not None:
                await client.close()
            if thread is not None:
                # queued behind whatever the env's thread still runs, so an env still being made is closed too
                await asyncio.get_running_loop().run_in_executor(thread, self._close_env)
        finally:
            if thread is not None:
                thread.shutdown(wait=False, cancel_futures=True)

    def _close_env(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            env.close()

    @classmethod
    def from_config(cls, config, **env_args) -> "OpenEnvEnv":
        """As the rollout worker makes it (`rollout.env_args`): a server's client waits for an
        answer as long as `rollout.env_timeout_s` allows, unless `client_kwargs` says otherwise
        (openenv's own 60 s cut a longer step short, reported as the env timeout)."""
        env = cls(**env_args)
        if env._client_cls is not None and _accepted(env._client_cls.__init__, {"message_timeout_s": 0}):
            env.client_kwargs.setdefault("message_timeout_s", config.rollout.env_timeout_s)
        return env

    # ---- where the env lives -------------------------------------------------------------------
    async def _connect_and_reset(self, kwargs: dict):
        """A session on the server and its first observation. A server holding all its
        sessions answers CAPACITY_REACHED: the episode waits for one to free up (within the
        worker's bound on reset), so a server with fewer sessions than live episodes
        queues them instead of failing them."""
        self._client = self._client_cls(base_url=self.base_url, **self.client_kwargs)
        delay = 0.05
        while True:
            try:
                await self._client.connect()
                return await self._client.reset(**kwargs)
            except Exception as e:  # noqa: BLE001 - only a full server is waited on
                if not await _server_full(e, self._client):
                    raise
            await self._client.disconnect()
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)

    async def _reset_in_process(self, kwargs: dict):
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="openenv-episode")
        await self._in_thread(self._make)
        if _own_async(self._env, "reset_async"):
            return await self._env.reset_async(**_accepted(self._env.reset_async, kwargs))
        return await self._in_thread(self._env.reset, **_accepted(self._env.reset, kwargs))

    def _make(self) -> None:  # on the env's thread, so that close() finds the env even if reset timed out meanwhile
        self._env = self._make_env(**self.env_kwargs)

    async def _in_thread(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args, **kwargs))

    # ---- model text <-> env types --------------------------------------------------------------
    def _bind_action(self, owner: type, method: str) -> None:
        """The Action class (given, or the env's / client's declared one) and the field the
        model's text goes in, unless action_fn builds actions itself."""
        if self._action_cls is None:
            self._action_cls = action_class(owner, method)
        if self._action_fn is not None or self._action_field is not None:
            return
        if self._action_cls is None:
            raise ValueError(
                f"{owner.__name__} declares no Action class to put the model's text in: set env_args.action "
                "(its import path) or action_field (with the generic client), or action_fn"
            )
        self._action_field = text_field(self._action_cls)

    def _read(self, observation: Any, first: bool) -> Observation:
        if self._observation_fn is not None:
            return self._for_model(self._observation_fn(observation), first)
        return self._for_model(observation_text(observation, self.observation_field, first), first)

    def _for_model(self, value: Observation, first: bool) -> Observation:
        """Text becomes a user message (chat: true); the first observation gets the system prompt."""
        if isinstance(value, str) and self.chat:
            value = [{"role": "user", "content": value}]
        if first and self.system_prompt and isinstance(value, list) and value and isinstance(value[0], dict) and value[0].get("role") != "system":
            value = [{"role": "system", "content": self.system_prompt}, *value]
        return value


# ---- helpers (module level: the tests and action_fn / observation_fn writers can use them) -------
def action_class(owner: type, method: str) -> type | None:
    """The Action subclass `owner` is declared with: the first type argument of its
    Environment[...] / EnvClient[...] base, else the annotation of `method`'s `action`."""
    for klass in owner.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and _is_action(args[0]):
                return args[0]
    try:
        hint = typing.get_type_hints(getattr(owner, method)).get("action")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve tells nothing
        return None
    return hint if _is_action(hint) else None


def _is_action(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, Action) and t is not Action


@functools.lru_cache(maxsize=None)
def text_field(action_cls: type) -> str:
    """The field of `action_cls` that takes the model's text: its only required text field,
    else its only text field."""
    fields = {n: f for n, f in action_cls.model_fields.items() if n != "metadata"}
    texts = [n for n, f in fields.items() if f.annotation in (str, typing.Optional[str])]
    required = [n for n in texts if fields[n].is_required()]
    for candidates in (required, texts):
        if len(candidates) == 1:
            return candidates[0]
    raise ValueError(
        f"cannot tell which field of {action_cls.__name__} ({', '.join(fields) or 'none'}) takes the model's "
        "text: set env_args.action_field, or env_args.action_fn to build the action"
    )


def observation_text(observation: Any, field: str | None = None, first: bool = True) -> str | list[dict]:
    """What the model reads of an OpenEnv observation (a pydantic Observation, or a dict from
    the generic client): `field`, else the first non-empty of TEXT_FIELDS, else its only text
    field. A list of chat messages is kept as messages; after the first turn only those
    after its last assistant message (envs that send the whole conversation each time)."""
    values = _content(observation)
    if field is not None:
        if field not in values:
            raise KeyError(f"the observation has no field {field!r} (env_args.observation_field); it has {sorted(values)}")
        found = [values[field]]
    else:
        found = [values[n] for n in TEXT_FIELDS if isinstance(values.get(n), str) or _is_chat(values.get(n))]
        texts = [v for v in values.values() if isinstance(v, str)]
        if not found and len(texts) == 1:
            found = texts
    if not found:
        raise ValueError(
            f"cannot tell what the model should read of the observation (fields {sorted(values)}): set env_args.observation_field or env_args.observation_fn"
        )
    value = next((v for v in found if v), found[0])
    if _is_chat(value):
        if not first:
            last = max((i for i, m in enumerate(value) if m["role"] == "assistant"), default=-1)
            value = value[last + 1 :]
        return [{"role": m["role"], "content": m["content"]} for m in value]
    return value if isinstance(value, str) else str(value)


def _content(observation: Any) -> dict:
    if isinstance(observation, dict):
        return {k: v for k, v in observation.items() if k not in _NOT_CONTENT}
    if hasattr(observation, "model_dump"):
        return observation.model_dump(exclude=_NOT_CONTENT)
    if dataclasses.is_dataclass(observation):
        return {k: v for k, v in dataclasses.asdict(observation).items() if k not in _NOT_CONTENT}
    return {k: v for k, v in vars(observation).items() if k not in _NOT_CONTENT}


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _own_async(env: Any, name: str) -> bool:
    """Whether `env` has its own async `name` (Environment's default one just calls the sync
    method on the event loop, which would stall the worker)."""
    impl = getattr(type(env), name, None)
    return impl is not None and impl is not getattr(Environment, name, None)


def _accepted(fn, kwargs: dict) -> dict:
    """The reset kwargs `fn` takes (OpenEnv's server filters them the same way)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


async def _server_full(error: Exception, client: EnvClient) -> bool:
    """Whether a failed connect-and-reset met a full server (its refusal may be left unread
    on the closed connection: meshrl.compat.openenv_unread_message)."""
    if _CAPACITY in str(error):
        return True
    return isinstance(error, ConnectionClosed) and _CAPACITY in (await openenv_unread_message(client) or "")
