"""The game protocol: an env whose turns are spoken by several trained models.

    ask = await game.reset(sample)                # Ask(model, thread, observation), or a list of them
    while True:
        reply = <model ask.model's turn, in thread ask.thread, after ask.observation>
        result = await game.step(reply)           # the next Ask (or list), or an Outcome
        if isinstance(result, Outcome): break

A list of Asks is played at once (k independent attempts, several players moving together:
their turns batch in the engines), and `step` then gets the list of Replies, in its order.

A thread is one conversation: the tokens one model sees and answers, kept apart from the
other threads, so a proposer's instructions never reach the solver unless the game puts
them into the solver's thread. Each thread is spoken by one model and becomes one
training row of that model, scored by the Outcome's reward for the thread (0 if it gives
none). A proposer and a solver, two players, a writer and k independent readers: each is
threads and who speaks next. One model may speak in several threads (self-play is a game
whose every Ask names `policy`, each thread's `role` keeping its advantage baseline apart).

A game is told from an env by what `reset` returns: an `Ask`. Its methods may be sync or
async and are bounded by `rollout.env_timeout_s`, as an env's are; what breaks the
contract below fails the episode in one line (`ContractError`), as an env's does:
- `Ask.model` is one of the run's trained models (`policy`, then `models[*].name`);
- a thread keeps the model that first spoke in it;
- `step` returns an Ask, a list of Asks in distinct threads, or an Outcome, whose rewards
  are finite numbers keyed by threads the game opened.
The model names a game uses are the config's: the env takes them from `rollout.env_args`
when it is meant to be reused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from meshrl.rollout.env import ContractError, Observation, _shown, _where, as_reward, callable_name, is_observation

MAX_THREADS = 64
"""Threads in one episode at most; row ids are the episode's id x MAX_THREADS + the thread's index."""


@dataclass
class Ask:
    """Who speaks next, in which conversation, after what."""

    model: str
    """The trained model that speaks: `policy`, or a `models[*].name`."""
    thread: str
    """The conversation: a new name opens one (`observation`: its prompt); a known one goes on (`observation` follows the model's last turn there)."""
    observation: Observation
    """Text, chat messages or token ids, as an env's observation."""
    max_new_tokens: int | None = None
    """This turn's token budget (None: generator.max_new_tokens, which also caps it)."""
    role: str | None = None
    """The part the thread plays, set when it opens: its rows take their advantage baseline
    apart from other roles' (self-play's proposer against proposers, solver against solvers:
    SPIRAL's role-conditioned baselines). None: its model's rows share one, as without roles."""


@dataclass
class Reply:
    """What the model said, as the game sees it."""

    model: str
    thread: str
    text: str
    token_ids: list[int]
    finish_reason: str
    index: int = 0
    """0 for the episode's first turn, counting every model's."""


@dataclass
class Outcome:
    """The episode is over: each thread's reward, and `info`, whose numbers the run reports as
    `game/KEY` (each one's mean over the step's games that gave it)."""

    rewards: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def is_ask(value: Any) -> bool:
    """Whether `reset` returned a game's start (an Ask, or a list of them), not an env's observation."""
    return isinstance(value, Ask) or (isinstance(value, list) and bool(value) and all(isinstance(v, Ask) for v in value))


def as_asks(value: Any, game: Any, models: list[str], threads: dict[str, str], method: str) -> list[Ask]:
    """`game.reset` or `game.step`'s Ask, or list of Asks (in distinct threads), checked."""
    if isinstance(value, list) and value:
        asks = [as_ask(v, game, models, threads, method) for v in value]
        name, where = f"game {callable_name(type(game))}", _where(getattr(game, method, None))
        if len({a.thread for a in asks}) != len(asks):
            raise ContractError(f"{name}: {method} asked twice in one thread at once", where)
        if len(threads.keys() | {a.thread for a in asks}) > MAX_THREADS:  # each Ask was checked against the threads before the list
            raise ContractError(f"{name}: {method} opened a thread past the {MAX_THREADS} an episode may have", where)
        return asks
    return [as_ask(value, game, models, threads, method)]


def as_ask(value: Any, game: Any, models: list[str], threads: dict[str, str], method: str) -> Ask:
    """`game.reset` or `game.step`'s Ask, checked against the run's models and the threads so far."""
    name, where = f"game {callable_name(type(game))}", _where(getattr(game, method, None))
    if not isinstance(value, Ask):
        raise ContractError(
            f"{name}: {method} returned {_shown(value)}: expected an Ask, a list of Asks" + (" or an Outcome" if method == "step" else ""), where
        )
    if value.model not in models:
        raise ContractError(f"{name}: {method} asked model {value.model!r}: the run trains {', '.join(models)}", where)
    if not isinstance(value.thread, str) or not value.thread:
        raise ContractError(f"{name}: {method} asked in thread {_shown(value.thread)}: expected a non-empty string", where)
    if threads.get(value.thread, value.model) != value.model:
        speaker = threads[value.thread]
        raise ContractError(f"{name}: {method} asked {value.model!r} in thread {value.thread!r}, where {speaker!r} speaks: one model per thread", where)
    if value.thread not in threads and len(threads) >= MAX_THREADS:
        raise ContractError(f"{name}: {method} opened a thread past the {MAX_THREADS} an episode may have", where)
    if not is_observation(value.observation):
        raise ContractError(f"{name}: {method} asked with observation {_shown(value.observation)}: expected text, chat messages or token ids", where)
    if value.thread not in threads and len(value.observation) == 0:  # as an env's reset (vLLM refuses an empty prompt)
        raise ContractError(f"{name}: {method} opened thread {value.thread!r} with an empty observation: its first turn needs a prompt", where)
    if value.role is not None and not (isinstance(value.role, str) and value.role):
        raise ContractError(f"{name}: {method} asked with role {_shown(value.role)}: expected a non-empty string or None", where)
    if value.max_new_tokens is not None and not (isinstance(value.max_new_tokens, int) and value.max_new_tokens >= 1):
        raise ContractError(f"{name}: {method} asked max_new_tokens={_shown(value.max_new_tokens)}: expected a positive integer or None", where)
    return value


def as_outcome(value: Any, game: Any, threads: dict[str, str]) -> Outcome:
    """`game.step`'s Outcome, its rewards checked (keyed by threads the game opened, finite)."""
    name, where = f"game {callable_name(type(game))}", _where(getattr(game, "step", None))
    if not isinstance(value.rewards, dict):
        raise ContractError(f"{name}: step returned Outcome(rewards={_shown(value.rewards)}): expected a dict of thread -> reward", where)
    unknown = [t for t in value.rewards if t not in threads]
    if unknown:
        raise ContractError(f"{name}: step's Outcome rewards thread {unknown[0]!r}, which was never asked in", where)
    if not isinstance(value.info or {}, dict):
        raise ContractError(f"{name}: step returned Outcome(info={_shown(value.info)}): expected a dict (its numbers are reported as game/KEY)", where)
    return Outcome({t: as_reward(r, f"{name}: step's reward for thread {t!r}", where) for t, r in value.rewards.items()}, value.info or {})


def info_numbers(info: dict) -> dict[str, float]:
    """An Outcome's `info` as metrics: its finite numbers (numpy's and bools too), the rest left out."""
    out = {}
    for key, value in info.items():
        if isinstance(value, (str, bytes)):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            continue
        if math.isfinite(number):
            out[str(key)] = number
    return out
