"""Playing a game (meshrl/rollout/game.py): turns spoken by several trained models.

    asks = game.reset(record)                    # Ask(model, thread, observation), or a list
    loop: for each ask, at once:
            thread <- its tokens + ask.observation (the chat renderer's, as an env's)
            turn   <- generators of ask.model (its replica for this group, at >= version v)
          result <- game.step(Reply, or the list) # the next Ask(s), or an Outcome
    every thread -> one row of its model, its reward at its last turn

Each model's turns go to its own generator replicas (its TurnBatcher): a proposer's
engine holds the proposer's weights, the solver's the solver's, and each tags its tokens
with its own version. The claim's version gates every trained model's generators alike: the
models step in lockstep (one batch, one step each; a step off a model's `trainer.pace` keeps its
weights), so version v means v steps of each. A
frozen model's generators serve its checkpoint at version 0, and its threads train nothing.
"""

from __future__ import annotations

import time

from meshrl.agent.summary import succeeded
from meshrl.episode import Episode, Turn
from meshrl.errors import UserCodeError
from meshrl.futures import all_or_none
from meshrl.rollout.chat import prompt_too_long
from meshrl.rollout.game import MAX_THREADS, Ask, Outcome, Reply, as_asks, as_outcome, info_numbers
from meshrl.tokenizer import reply_text


async def play_game(worker, env, ask, ep: Episode, version: int, replicas: list[int], temperature: float | None) -> None:
    """Play `env` (a game whose reset said `ask`: an Ask or a list) into `ep.threads`; the env's
    failure raises (the worker fails the episode), a generator's raises GenerationFailed (the
    group is played again). A list of Asks is played at once, each in its thread."""
    c = worker.config
    names = c.model_names()
    speakers: dict[str, str] = {}  # thread -> its model's name
    threads: dict[str, Episode] = {}
    last: dict[str, list[int]] = {}  # thread -> its last model turn's ids (the renderer's glue)
    asks, many = as_asks(ask, env, names, speakers, "reset"), isinstance(ask, list)
    k = 0
    while k < c.rollout.max_turns * max(1, len(names)):
        # one turn failing stops its siblings: none generates on, or joins a thread, for an episode that failed
        turns = (_turn(worker, env, a, ep, threads, speakers, last, version, replicas, temperature, k + i, reset=k == 0) for i, a in enumerate(asks))
        replies = await all_or_none(*turns)
        if any(r is None for r in replies):  # a thread out of room
            break
        k += len(asks)
        t0 = time.monotonic()
        result = await worker._env_call(env, "step", list(replies) if many else replies[0])
        ep.env_s += time.monotonic() - t0
        if isinstance(result, Outcome):
            outcome = as_outcome(result, env, speakers)
            ep.info = info_numbers(outcome.info)
            for name, row in threads.items():
                row.model_turns[-1].reward = outcome.rewards.get(name, 0.0)
                row.finish_reason = row.model_turns[-1].finish_reason or "stop"
            return
        asks, many = as_asks(result, env, names, speakers, "step"), isinstance(result, list)
    ep.finish_reason = "length"
    for row in threads.values():  # out of turns or room: unscored, as an env's episode cut short
        row.finish_reason = "length"


async def _turn(worker, env, ask: Ask, ep: Episode, threads, speakers, last, version, replicas, temperature, k: int, reset: bool) -> Reply | None:
    """One model turn in its thread (opened by it, or gone on with); None when the thread is out
    of room. A thread whose opening leaves no room is not opened (it would be a row with nothing
    to train in its model's group): from the game's reset, its prompts are too long for the
    model, said as the env path says it (the episode fails); opened later (a proposer's long
    problem), the game ends cut short."""
    from meshrl.agent.turns import GenerationFailed

    c = worker.config
    renderer = worker._renderer(env)
    model = c.model_names().index(ask.model)
    max_seq_len, max_new_tokens = model_limits(c, model)
    thread = threads.get(ask.thread)
    if thread is None:
        opening = renderer.initial_ids(ask.observation)
        if len(opening) >= max_seq_len:
            if not reset:
                return None
            field = f"models[{model - 1}].model.max_seq_len" if model else "model.max_seq_len"
            raise UserCodeError(f"{ask.model}'s thread {ask.thread!r}: {prompt_too_long(len(opening), max_seq_len, max_new_tokens, field)}")
        thread = Episode(ep.group_id, ep.sample_id * MAX_THREADS + len(threads), model=model, opening=ask.observation, role=ask.role)
        threads[ask.thread], speakers[ask.thread] = thread, ask.model
        ep.threads.append(thread)
        thread.turns.append(Turn("env", opening))
    else:
        thread.turns.append(Turn("env", renderer.continuation_ids(last[ask.thread], ask.observation)))
    room = max_seq_len - len(thread)
    if room <= 0:
        thread.turns.pop()
        return None
    budget = min(max_new_tokens, room, ask.max_new_tokens or room)
    floor = 0 if model in c.frozen_models() else version  # a frozen model's generators stay at version 0
    out = await worker.model_turns[model].generate(replicas[model], thread.token_ids, budget, floor, temperature)
    thread.turns.append(Turn("model", out.token_ids, out.logprobs, out.versions, finish_reason=out.finish_reason, routed_experts=out.routed_experts))
    last[ask.thread] = list(out.token_ids)
    if out.finish_reason == "abort":
        raise GenerationFailed(f"{ask.model}'s generator replica {replicas[model]} is stopping")
    return Reply(ask.model, ask.thread, reply_text(worker.tokenizer, out.token_ids), list(out.token_ids), out.finish_reason, k)


def model_limits(c, model: int) -> tuple[int, int]:
    """The `model.max_seq_len` and `generator.max_new_tokens` of the model at index `model` of
    `c.model_names()`: its own overrides (`models[i].model`, `models[i].generator`), else the run's."""
    if model == 0:
        return c.model.max_seq_len, c.generator.max_new_tokens
    spec = c.models[model - 1]
    return spec.model.get("max_seq_len", c.model.max_seq_len), spec.generator.get("max_new_tokens", c.generator.max_new_tokens)


def thread_windows(ep: Episode, names: list[str]) -> list[dict]:
    """A game episode's per-row stats for the worker's metrics window, each under its model's name."""
    out = []
    for i, row in enumerate(ep.rows):
        failed = ep.finish_reason == "failed"
        out.append(
            {
                "model": names[row.model],
                "reward": 0.0 if failed else row.reward,
                "success": succeeded(row, failed),
                "failed": float(failed),
                "response_len": float(sum(len(t.token_ids) for t in row.model_turns)),
                "turns": float(len(row.model_turns)),
                "tool_calls": 0.0,
                "env_tokens": float(row.env_tokens),
                "env_s": ep.env_s if i == 0 else 0.0,
                "truncated": float(row.finish_reason == "length"),
                **{f"scoring/{k}": v for k, v in row.signals.items()},
                **({f"game/{k}": v for k, v in ep.info.items()} if i == 0 else {}),  # once per game
            }
        )
    return out
