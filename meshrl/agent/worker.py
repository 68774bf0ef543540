"""Rollout workers: play groups of episodes and hand them to the episode queue.

    claim = queue.claim(worker)                        # a group: one record, admitted at version v
    for each of generator.group_size episodes, concurrently:
        obs = env.reset(record)
        loop: model turn  <- generator.generate(episode ids, min_version=v)
              env turn    <- env.step(model turn)       (observation, reward, done)
    queue.put(group)                                    # packed TensorDict with advantages

A worker runs many groups at once, so the generators see every live episode's model turn
as one continuously batched stream. Each episode sticks to one generator replica (its
prefix cache stays warm) and keeps its env instance in this process: the worker procs are
the env pool (`rollout.workers`). Failures stay small:
- an env that raises, exceeds `rollout.env_timeout_s` or breaks its contract (a `reset`
  or `step` that returns what meshrl/rollout/env.py does not allow) fails its episode
  (reward 0, finish_reason `failed`, counted in `episode/failed`): it leaves the loss and
  its group's statistics, and the rest of its group still trains. The first failure of a
  metrics window is kept as one line (meshrl/errors.py), for the controller's warning
  and its breaker (`contracts.*`);
- a generator call that fails (a dead replica) re-queues the whole group, which is played
  again from its start: no episode is lost or trained twice;
- a dead worker proc is replaced by the controller, and the queue re-queues its groups.

`RolloutWorker` is plain asyncio (no Monarch): the actor in `actor.py` serves it on a
proc, tests drive it directly. Turns reach the generators through `turns.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time

import torch

from meshrl.config import Config
from meshrl.errors import QueueClosed, UserCodeError, describe, find, first_line, one_line, source_location, user_location
from meshrl.futures import all_or_none, awaited
from meshrl.logs import role_log
from meshrl.distill import assign_distill_advantages, attach_teacher_logprobs
from meshrl.episode import Episode, Turn, assign_advantages, leave_out, pack
from meshrl.rollout.chat import ChatRenderer, prompt_too_long
from meshrl.rollout.env import Env, ModelTurn, as_observation, as_step_result, call_bounded, callable_name, close_env, env_budget
from meshrl.agent.envs import env_factory, eval_view
from meshrl.agent.summary import succeeded
from meshrl.agent.game import play_game, thread_windows
from meshrl.agent.turns import ABORT_TIMEOUT_S, GenerationFailed, TurnBatcher
from meshrl.rollout.game import is_ask
from meshrl.scorers.client import EpisodeScorers, ScorerUnavailable
from meshrl.trainer.checks import policy_vocabulary
from meshrl.scorers.process import assign_process_advantages, process_tensors, split_process
from meshrl.tokenizer import reply_text

log = logging.getLogger("meshrl")

CLAIM_POLL_S = 1.0
"""How long the queue holds one claim before answering None (then asked again)."""
CLAIM_GRACE_S = 60.0
"""How much longer than that a worker waits for the answer (a busy queue) before giving the claim up (`abandon`)."""
RETRY_AFTER_S = 1.0
"""Pause of a slot whose group was re-queued after a generator failure."""


class RolloutWorker:
    """Plays groups of episodes: plain asyncio, usable in the actor and in tests alike."""

    def __init__(self, config: Config, tokenizer_dir: str, worker: int = 0, reward_fn=None):
        from meshrl.tokenizer import load_tokenizer

        self.config = config
        self.worker = worker
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.vocab = policy_vocabulary(config) or len(self.tokenizer)  # token ids an env may send (every model's covers the policy's)
        self.make_env = env_factory(config, reward_fn)
        view = eval_view(config)  # (a task's own eval source: not the reward passed in code either)
        self.make_eval_env = env_factory(view, reward_fn if view is config else None) if config.eval.source else self.make_env
        self.turns = TurnBatcher(config)
        self._closing: set[asyncio.Task] = set()  # closes of envs made past their bound
        # a game's models (meshrl/agent/game.py): the policy's turns, then each models[*]'s generators, bounded by its own start
        # (from its overrides: a whole `for_model` view checks its cores against this proc's, pinned to the trainer's)
        starts = [m.generator.get("startup_timeout_s", config.generator.startup_timeout_s) for m in config.models]
        self.model_turns = [self.turns] + [TurnBatcher(config, float(s)) for s in starts]
        self.teacher = None  # on-policy distillation: the teacher's scoring replica (meshrl/distill.py)
        self._teacher_calls = itertools.count()  # its score_many calls' ids, for abort_many
        self.scorers = EpisodeScorers(config, self.tokenizer)  # scoring.scorers (meshrl/scorers/)
        self.advantages = config.advantage_modes()  # each model's group advantage, by its `model` index
        self._renderers: dict[str, ChatRenderer] = {}
        self._task: asyncio.Task | None = None
        self._free: asyncio.Semaphore | None = None  # free group slots, `slots()` of them
        self._slots = 0
        self._groups: set[asyncio.Task] = set()
        self._requests, self._owed = itertools.count(), []  # claims' names (`abandon`); calls to the queue still owed (`_hand_back`)
        self._stopping = False
        self.window: list[dict[str, float]] = []  # per-episode stats since the last metrics()
        self.failed_total = 0
        self.requeued_total = 0
        self.error: str | None = None
        self.first_failure: str | None = None  # the first failed episode's reason since the last metrics()
        self.role = f"worker-{worker}"  # as its actor names its log (meshrl/agent/actor.py)
        self.log = role_log(config, self.role)

    def set_generators(self, generators: list, model: int = 0) -> None:
        """The replicas to send model turns to (after a replacement or a rescale); `model`:
        whose (its index in config.model_names(), the policy's by default)."""
        self.model_turns[model].set_generators(generators)
        if model == 0 and generators and len(generators) != self.config.generator.replicas:  # a rescale: more groups at once to keep them busy
            self.config.generator.replicas = len(generators)
            grow = self.slots() - self._slots
            for _ in range(grow if self._free is not None else 0):  # (never fewer: a group in play is not taken back)
                self._free.release()
            self._slots += max(0, grow)

    def _renderer(self, env: Env) -> ChatRenderer:
        tools = getattr(env, "tools_schema", None) or None
        key = json.dumps(tools, sort_keys=True)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, tools=tools, vocab=self.vocab)
        return self._renderers[key]

    # ---- one episode, one group ------------------------------------------------------------------
    async def play_episode(
        self, group_id: int, sample_id: int, record: dict, version: int, replica: int | list[int], temperature: float | None = None, make_env=None
    ) -> Episode:
        """One episode of `record`, model turns on generator `replica` at `version` or newer
        (at `temperature`; None: generator.temperature), with an env from `make_env` (None:
        the run's). A game (its reset returns an Ask) is played into the episode's threads,
        each model on its replica in `replica` (a list, one per trained model)."""
        c = self.config
        env = None
        ep = Episode(group_id, sample_id)
        timeout = c.rollout.env_timeout_s
        try:
            env = await self._make_env(make_env or self.make_env)  # a constructor that raises (bad env_args) fails the episode, not the group
            t0 = time.monotonic()
            first = await self._env_call(env, "reset", dict(record))
            ep.env_s += time.monotonic() - t0
            replicas = replica if isinstance(replica, list) else [replica]
            if is_ask(first):
                await play_game(self, env, first, ep, version, replicas, temperature)
                return ep
            replica = replicas[0]
            obs = as_observation(first, env)
            renderer = self._renderer(env)
            ep.turns.append(Turn("env", renderer.initial_ids(obs)))
            for k in range(c.rollout.max_turns):
                room = c.model.max_seq_len - len(ep)
                if room <= 0 and k == 0:  # the episode would end with nothing to train: said, as a failure
                    raise UserCodeError(prompt_too_long(len(ep), c.model.max_seq_len, c.generator.max_new_tokens))
                if room <= 0:
                    ep.finish_reason = "length"
                    break
                asked = env_budget(env)
                if asked == 0:
                    ep.finish_reason = "length"  # the env gives the model no more tokens
                    break
                budget = min(c.generator.max_new_tokens, room, room if asked is None else asked)
                out = await self.turns.generate(replica, ep.token_ids, budget, version, temperature)
                turn = Turn("model", out.token_ids, out.logprobs, out.versions, finish_reason=out.finish_reason, routed_experts=out.routed_experts)
                ep.turns.append(turn)
                if out.finish_reason == "abort":
                    raise GenerationFailed(f"generator replica {replica} is stopping")
                t0 = time.monotonic()
                step = as_step_result(
                    await self._env_call(
                        env,
                        "step",
                        ModelTurn(reply_text(self.tokenizer, out.token_ids), list(out.token_ids), out.finish_reason, k),
                    ),
                    env,
                )
                ep.env_s += time.monotonic() - t0
                turn.reward = step.reward
                ep.tool_calls += int(step.info.get("tool_calls", 0) or 0)
                if step.done:
                    ep.finish_reason = "length" if step.truncated else out.finish_reason
                    break
                if k + 1 == c.rollout.max_turns:
                    # rollout.max_turns model turns and the env is not done: its reply would go
                    # unanswered, so it is not appended (an episode ends on a model turn)
                    ep.finish_reason = "length"
                    break
                more = renderer.continuation_ids(out.token_ids, step.observation)
                if len(ep) + len(more) >= c.model.max_seq_len:
                    ep.finish_reason = "length"  # no room for the env's reply and another model turn
                    break
                ep.turns.append(Turn("env", more))
        except GenerationFailed:
            raise
        except Exception as e:  # noqa: BLE001 - the env's failure fails its episode, not the run
            ep.failure = describe(e, self.role, self.log)
            log.warning("episode %d (group %d) failed: %s", sample_id, group_id, ep.failure)
            ep.finish_reason = "failed"
            for row in ep.threads:
                row.finish_reason = "failed"
        finally:
            await close_env(env, timeout)
        return ep

    async def _make_env(self, make):
        """A fresh env from `make`, on a thread of its own within rollout.env_timeout_s, as its
        calls are: a constructor that loads data or connects somewhere stalls no other episode of
        this worker, and one that hangs fails its episode alone."""
        bound = self.config.rollout.env_timeout_s

        def close_late(env) -> None:  # made after all, once its episode had failed: closed, not leaked
            task = asyncio.ensure_future(close_env(env, bound))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

        try:
            return await call_bounded(make, timeout=bound, late=close_late)
        except (asyncio.TimeoutError, TimeoutError) as e:
            if str(e):
                raise  # the constructor's own TimeoutError
            raise TimeoutError(f"making the env took longer than rollout.env_timeout_s={bound:g}s") from None

    async def _env_call(self, env: Env, method: str, arg):
        """`env.method(arg)`, bounded by rollout.env_timeout_s, plus for a step the time the
        env says its own bounded work may take (`step_timeout_s`: tools, sandbox runs, a
        reward); a timeout says which call."""
        timeout = self.config.rollout.env_timeout_s
        own = getattr(env, "step_timeout_s", None) if method == "step" else None
        if isinstance(own, (int, float)) and not isinstance(own, bool) and own > 0:
            timeout += own
        fn = getattr(env, method)
        try:
            return await call_bounded(fn, arg, timeout=timeout)
        except (asyncio.TimeoutError, TimeoutError) as e:
            if str(e):
                raise  # the env's own TimeoutError
            bound = f"rollout.env_timeout_s={self.config.rollout.env_timeout_s:g}s" + (
                f" + its step_timeout_s={own:g}s" if timeout != self.config.rollout.env_timeout_s else ""
            )
            raise TimeoutError(f"env {callable_name(type(env))}: {method} took longer than {bound}") from None
        except Exception as e:
            if getattr(e, "where", None) is None and user_location(e) is None:  # the call itself failed (a wrong signature): point at the method
                e.where = source_location(fn)
            raise

    async def play_scored(self, group_id: int, sample_id: int, record: dict, version: int, replica: int | list[int]) -> Episode:
        """One training episode, scored by scoring.scorers as soon as it is played."""
        ep = await self.play_episode(group_id, sample_id, record, version, replica)
        if self.scorers:
            await self.scorers.score(ep, record)
        return ep

    async def play_group(self, claim) -> list[Episode]:
        n = self.config.generator.group_size
        replicas: list[int] = []  # one per trained model (a game's); those taken are handed back, whatever fails
        seen = dict(self.scorers.versions)  # the implicit PRM's version as the group starts (its version lag)
        try:
            for turns in self.model_turns:
                replicas.append(turns.acquire())  # (GenerationFailed where a model has no replica left)
            # one episode failing stops the others (their envs closed): the group is played again from its start
            episodes = await all_or_none(*(self.play_scored(claim.group_id, claim.group_id * n + i, claim.sample, claim.version, replicas) for i in range(n)))
            if self.scorers.per_group:  # an implicit PRM scores the whole group with one version
                await self.scorers.score_group(episodes, seen)
            return episodes
        finally:
            for turns, r in zip(self.model_turns, replicas):
                turns.release(r)

    async def evaluate(self, records: list[dict], version: int, k: int) -> list[dict]:
        """Each record played once greedily and `k` times at generator.temperature, beside
        the training groups, on generators at `version` or newer: per record, the greedy
        and sampled episodes' rewards and the versions their tokens came from. An episode
        whose generator call fails is played again (on the least-loaded replica)."""

        async def one(i: int, record: dict, temperature: float | None) -> Episode:
            for attempt in range(3):
                replica = self.turns.acquire()
                try:
                    return await self.play_episode(-1, i, record, version, replica, temperature, self.make_eval_env)
                except GenerationFailed:
                    if attempt == 2:
                        raise
                    await asyncio.sleep(RETRY_AFTER_S)
                finally:
                    self.turns.release(replica)

        async def record_result(i: int, record: dict) -> dict:
            episodes = await all_or_none(one(i, record, 0.0), *(one(i, record, None) for _ in range(k)))
            if any(ep.threads for ep in episodes):  # (its rewards are its threads': every score would read 0)
                raise ValueError("the evaluation's env plays a game: evaluate the policy alone on a task of its own (eval.source, e.g. task:digits)")
            versions = [v for ep in episodes for t in ep.model_turns for v in t.versions]
            return {
                "greedy": episodes[0].reward,
                "samples": [ep.reward for ep in episodes[1:]],
                "failed": sum(ep.finish_reason == "failed" for ep in episodes),
                "greedy_text": reply_text(self.tokenizer, [x for t in episodes[0].model_turns for x in t.token_ids]),
                "version_min": min(versions, default=version),
                "version_max": max(versions, default=version),
            }

        return await all_or_none(*(record_result(i, r) for i, r in enumerate(records)))  # a failed one stops the rest, their envs closed

    # ---- the loop ------------------------------------------------------------------------------
    def start(self, queue) -> None:
        if self._task is not None and not self._task.done():
            raise RuntimeError("rollout worker already running")
        self._stopping = False
        self._task = asyncio.create_task(self._run(queue))

    def slots(self) -> int:
        """Groups played at once: enough that the generators always have every slot busy."""
        c = self.config
        if c.rollout.groups_per_worker:
            return c.rollout.groups_per_worker
        seqs = 2 * c.generator.replicas * c.generator.max_num_seqs
        return max(1, seqs // c.generator.group_size // c.rollout.workers)

    async def _run(self, queue) -> None:
        self._slots = self.slots()
        self._free = free = asyncio.Semaphore(self._slots)
        while not self._stopping:
            await free.acquire()
            request = next(self._requests)
            try:
                await self._hand_back(queue)
                claim = await asyncio.wait_for(awaited(queue.claim.call_one(self.worker, CLAIM_POLL_S, request)), CLAIM_POLL_S + CLAIM_GRACE_S)
            except Exception as e:  # noqa: BLE001 - a slow or failed claim is asked again; a closed queue ends the loop
                free.release()
                if self._stopping or find(e, QueueClosed) is not None or one_line(e) is not None:
                    return  # closed, or failed on the user's data: the controller reports it
                self._owed.append(("abandon", (self.worker, request)))  # its answer, if it took a group, would be lost
                self.error = f"{type(e).__name__}: {str(e)[:300]}"
                log.warning("rollout worker %d: a claim failed (%s); asking again", self.worker, self.error)
                await asyncio.sleep(RETRY_AFTER_S)
                continue
            if claim is None:
                free.release()
                continue
            task = asyncio.create_task(self._deliver(queue, claim))
            self._groups.add(task)
            task.add_done_callback(lambda t: (self._groups.discard(t), free.release()))

    async def _hand_back(self, queue) -> None:
        """Tell the queue what an earlier call could not (a claim given up on, a group not re-queued),
        oldest first: otherwise that group stays RUNNING under this live worker and its batch never fills."""
        while self._owed:
            method, args = self._owed[0]
            await asyncio.wait_for(awaited(getattr(queue, method).call_one(*args)), CLAIM_GRACE_S)
            self._owed.pop(0)

    async def _deliver(self, queue, claim) -> None:
        """Play the claimed group and put it; on any failure hand it back to the queue, so it
        never stays RUNNING under a worker that is alive but gave it up."""
        try:
            episodes = await self.play_group(claim)
            group = leave_out(await self._packed(episodes), self.config.frozen_models())  # a frozen model's rows train nothing
            if self._stopping:
                return
            accepted = await asyncio.wait_for(awaited(queue.put.call_one(claim.group_id, group, claim.token)), 120)
        except Exception as e:  # noqa: BLE001 - a failed generator call, put or packing: played again
            if self._stopping:
                return
            log.warning("group %d re-queued: %s", claim.group_id, e)
            self.requeued_total += 1
            try:
                failure = None if _not_the_groups(e) else f"{type(e).__name__}: {first_line(str(e))}"  # (buffer.MAX_FAILED_PLAYS)
                await asyncio.wait_for(awaited(queue.requeue.call_one(None, [claim.group_id], failure, claim.token)), 60)
            except Exception as lost:  # noqa: BLE001 - asked again before the next claim (`_hand_back`)
                log.warning("group %d could not be re-queued yet: %s", claim.group_id, lost)
                self._owed.append(("requeue", (None, [claim.group_id], failure, claim.token)))
            await asyncio.sleep(RETRY_AFTER_S)
            return
        if not accepted:
            return  # re-queued meanwhile (this worker was presumed dead), or too stale: not ours to count
        for ep in episodes:
            failed = ep.finish_reason == "failed"
            self.failed_total += failed
            if failed and self.first_failure is None:
                self.first_failure = ep.failure
            if ep.threads:
                self.window += thread_windows(ep, self.config.model_names())
                continue
            self.window.append(
                {
                    "reward": ep.reward,
                    "success": succeeded(ep, failed),
                    "failed": float(failed),
                    "response_len": float(sum(len(t.token_ids) for t in ep.model_turns)),
                    "turns": float(len(ep.model_turns)),
                    "tool_calls": float(ep.tool_calls),
                    "env_tokens": float(ep.env_tokens),
                    "env_s": ep.env_s,
                    "truncated": float(ep.finish_reason == "length"),
                    **{f"scoring/{k}": v for k, v in ep.signals.items()},
                }
            )

    async def _packed(self, episodes: list[Episode]):
        """The group as the trainer reads it: advantages from the rewards or, under
        distillation, per token from the teacher's scores of every row of the policy that did
        not fail (a game's other models are not distilled; a failed call, the teacher lost or
        slow, plays the group again; an episode the teacher cannot score counts against the
        group, dropped after buffer.MAX_FAILED_PLAYS)."""
        if self.teacher is None:
            return self._with_process(assign_advantages(pack(episodes), self.advantages), episodes)
        scored = [row for ep in episodes for row in ep.rows if row.model == 0 and row.finish_reason != "failed"]
        scores = await self._teacher_scores([ep.token_ids for ep in scored]) if scored else []
        for ep, score in zip(scored, scores):
            if isinstance(score, str):  # this episode's own (a stopping replica fails the call): counts against the group
                raise RuntimeError(f"the teacher could not score episode {ep.sample_id}: {score}")
            attach_teacher_logprobs(ep, score)
        d = self.config.distill
        return self._with_process(assign_distill_advantages(pack(episodes), d.kl_weight, d.reward_weight, self.advantages), episodes)

    async def _teacher_scores(self, sequences: list[list[int]]) -> list:
        """The teacher's score_many of `sequences`, bounded as a weight update and a replica's
        start are; past the bound its call is aborted on the teacher (its requests would go on
        for nobody, behind every later group's) and the timeout raised."""
        call_id = f"{os.getpid()}.{id(self):x}.t{next(self._teacher_calls)}"
        timeout = self.config.weight_sync.timeout_s + self.config.generator.startup_timeout_s
        try:
            return await asyncio.wait_for(awaited(self.teacher.score_many.call_one(sequences, call_id)), timeout)
        except asyncio.TimeoutError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(awaited(self.teacher.abort_many.call_one(call_id)), ABORT_TIMEOUT_S)
            raise

    def _with_process(self, group, episodes: list[Episode]):
        """Under process scorers, the per-token advantages of meshrl/scorers/process.py (a
        game's: of its threads, the group's rows)."""
        s = self.config.scoring
        prm = any(spec.kind == "prm" for spec in s.scorers)
        if not prm and not any(spec.process != "none" for spec in s.scorers):
            return group
        rows = [row for ep in episodes for row in ep.rows]
        scores, ends = process_tensors(rows, group["tokens"].shape[1])
        before = group["token_advantage"].clone() if "token_advantage" in group.keys() else group["advantage"][:, None]  # a teacher's, or the outcome's
        modes = self.config.advantage_modes()
        gae = torch.tensor([modes[row.model] == "gae" for row in rows])
        if "gae" in modes:  # PPO's critic's rows: their step scores are rewards GAE adds up (`process_reward`)
            scores, ends = split_process(group, scores, ends, s.process_weight, gae)
        if any(mode != "gae" for mode in modes):  # from the config, not the group's rows: every group gets the same keys
            group = assign_process_advantages(group, scores, ends, s.process_weight, s.process_advantage, "loo" if prm else "mean")
        if prm:
            from meshrl.scorers.prm import note_process_terms

            term = group["token_advantage"] - before if "token_advantage" in group.keys() else torch.zeros_like(group["dense_reward"])
            term = torch.where(gae[:, None], group.get("process_reward", term), term)  # its share of the loss, or its rewards
            note_process_terms(term, group["loss_mask"], rows, s.scorer_names()[[spec.kind for spec in s.scorers].index("prm")])
        return group

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop claiming; groups in flight are dropped (the queue re-queues them on resume)."""
        self._stopping = True
        tasks = [t for t in [self._task, *self._groups] if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    def metrics(self) -> list[dict[str, float]]:
        window, self.window = self.window, []
        return window

    def take_first_failure(self) -> str | None:
        """The first failed episode's reason since the last call (one line), or None."""
        first, self.first_failure = self.first_failure, None
        return first


def _not_the_groups(e: BaseException) -> bool:
    """A failure that says nothing of the group that met it: a generator, teacher, scorer or the
    queue lost or slow (the group plays fine once they are back). Anything else, raised by an
    env, a scorer's answer or packing on this record, counts against the group."""
    from monarch.actor import ActorError

    return isinstance(e, (GenerationFailed, asyncio.TimeoutError, ScorerUnavailable)) or find(e, ActorError) is not None
