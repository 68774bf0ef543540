"""The rollout worker's side of scoring: one finished episode in, its rewards out.

    scorers = EpisodeScorers(config, tokenizer)
    scorers.set_replicas({index: [actor, ...]})      # the controller's ScorerPool hands them out
    await scorers.score(episode, record)             # as soon as the episode is played

Every scorer of `scoring.scorers` scores the episode at once (a `function` in this worker,
the others on their replicas). The episode's reward becomes

    env_weight x (the env's reward) + sum over scorers of weight x score

(the env's part stays on each model turn, the scorers' part goes to the last one), and each
raw signal is kept in `episode.signals` for the metrics. A process scorer's step scores go
to `episode.process` (meshrl/scorers/process.py); its outcome score is its last step's.

Failures: a scorer that answers with a failure (its backend raised, a remote server kept
failing, a judge reply was unparsable with `unparsable: null`) or takes longer than its
`timeout_s` fails the episode (reward 0, out of the loss), counted as
`scoring/NAME/failed`. A replica that dies is not the episode's fault: the call is asked
again of the others, or of its replacement, for as long as a replica takes to start; only
then does it raise GenerationFailed, and the worker re-queues the whole group, so no
episode is lost. A replica dies two ways for its caller: the call raises, or the replica
leaves the controller's list with the call unanswered (a sharded PRM's rank 0 whose peer
died may never answer). Replicas are listed as (incarnation, actor): the incarnation, not
the handle (a fresh object each time the list is sent), says whether the one asked is still
listed. A listed replica is never asked twice for one item: an implicit PRM trains on what
it scores.
"""

from __future__ import annotations

import asyncio
import time

from meshrl.config import Config, ScorerConfig
from meshrl.episode import Episode
from meshrl.futures import awaited
from meshrl.rollout.env import call_reward, prompt_text
from meshrl.scorers.process import step_ends, step_texts
from meshrl.tokenizer import reply_text

RETRY_S = 1.0
"""Pause before asking again after a replica failed a call."""
COALESCE_S = 0.002
"""Items for one scorer asked for within this long of the first go in one message."""


class ScorerUnavailable(Exception):
    """No replica of a scorer answered within its start-up bound: the group is played again."""


class ReplicaGone(Exception):
    """The replica asked left the controller's list (it died) before it answered."""


class EpisodeScorers:
    def __init__(self, config: Config, tokenizer):
        from meshrl.imports import import_callable

        self.config, self.tokenizer = config, tokenizer
        self.specs: list[ScorerConfig] = list(config.scoring.scorers)
        self.names = config.scoring.scorer_names()
        self.models = config.model_names()  # a row's `model` index -> the name its scorers carry
        self.functions = {i: import_callable(s.path) for i, s in enumerate(self.specs) if s.kind == "function"}
        self.per_group = [i for i, s in enumerate(self.specs) if s.kind == "prm"]  # scored a whole group at a time
        self.versions: dict[int, int] = {}  # per-group scorer index -> newest version it has answered with
        self.replicas: dict[int, list[tuple]] = {}  # scorer index -> [(incarnation, actor)]
        self._load: dict = {}  # incarnation -> calls in flight
        self._wedged: set = set()  # incarnations that said they are wedged: asked only while no other is listed
        self._changed = asyncio.Event()
        self._waiting: dict[int, list] = {}  # scorer index -> items not yet sent, with their futures
        self._calls: set[asyncio.Task] = set()  # score calls in flight
        # a dead replica's calls are asked again for as long as its replacement may take to start
        self.replace_s = config.generator.startup_timeout_s + 60

    def __bool__(self) -> bool:
        return bool(self.specs)

    def set_replicas(self, replicas: dict[int, list]) -> None:
        """{scoring.scorers index: [(incarnation, actor), ...]}, from the controller's ScorerPool."""
        self.replicas = {int(k): [(ident, actor) for ident, actor in v] for k, v in replicas.items()}
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- one episode ---------------------------------------------------------------------------
    def items(self, ep: Episode, record: dict) -> list[dict | None]:
        """What each scorer is sent for `ep`, a row of the trained model `ep.model` (backends.py
        has the fields): None for a scorer of another model or one scored with its group (a
        prm); a process scorer's item also holds the steps, and the positions of their last
        tokens (`step_ends`, kept by this worker). A game's thread is sent with the observation
        that opened it as the prompt."""
        if ep.opening is not None:
            record = {**record, "prompt": ep.opening}
        base = scoring_item(record, reply_text(self.tokenizer, ep.token_ids[ep.prompt_len :]))
        base["sample"]["finish_reason"] = ep.model_turns[-1].finish_reason  # as an env's reward reads it
        items = []
        for spec in self.specs:
            if spec.kind == "prm" or spec.model != self.models[ep.model]:
                items.append(None)  # another model's, or scored with its group (score_group)
                continue
            item = dict(base)
            if spec.process != "none":
                item["step_ends"] = step_ends(ep, self.tokenizer, spec.process, spec.step_delimiter)
                item["steps"] = step_texts(ep, self.tokenizer, item["step_ends"])
            items.append(item)
        return items

    async def score(self, ep: Episode, record: dict) -> None:
        """Score `ep` with every scorer of its model and set its rewards (in place); a game's
        episode thread by thread, each with the scorers of the model that speaks in it. A
        failed episode is left as it is; a failed score fails the episode (every thread)."""
        if ep.finish_reason == "failed":
            return
        if not ep.threads:
            return await self._score_row(ep, record)
        await asyncio.gather(*(self._score_row(row, record) for row in ep.threads))
        fail_with_threads(ep)

    async def _score_row(self, ep: Episode, record: dict) -> None:
        """`score` of one row: an env's episode, or a game's thread."""
        if not any(spec.model == self.models[ep.model] for spec in self.specs):
            return  # a thread of a model nobody scores keeps the game's reward as it is
        if not ep.model_turns:
            return  # nothing was generated (a prompt that fills model.max_seq_len): nothing to score, nothing to train
        items = self.items(ep, record)
        mine = [i for i, item in enumerate(items) if item is not None]
        results = await asyncio.gather(*(self._one(i, items[i]) for i in mine))
        env_reward = sum(t.reward for t in ep.model_turns)
        ep.signals["env"] = env_reward
        outcome, process = 0.0, []
        for (name, spec, item), result in zip([(self.names[i], self.specs[i], items[i]) for i in mine], results):
            for key in ("queue_s", "score_s", "wait_s"):
                if key in result:
                    ep.signals[f"{name}/{key}"] = result[key]
            score = result.get("score")
            if score is None and result.get("unparsable") and spec.unparsable is not None:
                score = spec.unparsable
                ep.signals[f"{name}/unparsable"] = 1.0
            if score is None:
                ep.signals[f"{name}/failed"] = 1.0
                ep.finish_reason = "failed"
                ep.failure = ep.failure or f"scorer {name}: {result.get('error') or 'no score'}"
                continue
            if isinstance(score, list):  # process: one score per step, the last one the outcome
                if spec.weight:  # (at 0 it is watched, not trained on: its step ends would still move the baseline)
                    process += [(pos, spec.weight * s) for pos, s in zip(item["step_ends"], score)]
                score = score[-1]
            ep.signals[name] = float(score)
            outcome += spec.weight * float(score)
        if ep.finish_reason == "failed":
            return
        weight = self.config.scoring.env_weight
        turns = ep.model_turns
        for t in turns:
            t.reward *= weight
        turns[-1].reward += outcome
        ep.process = process

    async def score_group(self, episodes: list[Episode], seen: dict[int, int]) -> None:
        """Score the group's played episodes with each per-group scorer (an implicit PRM), all
        in one request, so one PRM version scores them all (meshrl/scorers/prm.py); its
        per-token rewards join `episode.process`. A game's episodes are scored by their
        threads of the model the PRM names (a failed score fails the whole episode).
        `seen`: `versions` when the group began."""
        from meshrl.scorers.prm import group_items

        for index in self.per_group:
            spec, name = self.specs[index], self.names[index]
            played = [row for ep in episodes if ep.finish_reason != "failed" for row in ep.rows if self.models[row.model] == spec.model]
            if not played:
                continue
            items = group_items(played)
            futures = [asyncio.get_running_loop().create_future() for _ in items]
            await self._call(index, list(zip(items, futures)))
            for ep, item, future in zip(played, items, futures):
                result = future.result()
                for key in ("queue_s", "score_s"):
                    if key in result:
                        ep.signals[f"{name}/{key}"] = result[key]
                if result.get("score") is None:
                    ep.signals[f"{name}/failed"] = 1.0
                    ep.finish_reason = "failed"
                    ep.failure = ep.failure or f"scorer {name}: {result.get('error') or 'no score'}"
                    continue
                self.versions[index] = result["latest"]  # (a replaced PRM restores an older version)
                ep.process += [(pos, spec.weight * q) for pos, q in zip(item["positions"], result["score"])]
                ep.signals[name] = result["prob"]  # the PRM's P(outcome = 1): sigmoid of its summed rewards
                ep.signals[f"{name}/version"] = float(result["version"])
                if index in seen:  # not for a group begun before this worker heard from the PRM (after a start or resume)
                    ep.signals[f"{name}/version_lag"] = float(result["version"] - seen[index])
                for key in ("loss", "accuracy", "train_loss", "grad_norm", "trained_frac", "skipped_nonfinite"):
                    if key in result:
                        ep.signals[f"{name}/{key}"] = result[key]
        for ep in episodes:
            fail_with_threads(ep)

    async def _one(self, index: int, item: dict) -> dict:
        spec = self.specs[index]
        start = time.monotonic()
        if spec.kind == "function":
            result = await self._function(index, item)
        else:
            result = await self._remote_call(index, item)
        result["wait_s"] = time.monotonic() - start
        return result

    async def _function(self, index: int, item: dict) -> dict:
        spec, steps = self.specs[index], item["steps"]
        try:
            score = await call_reward(
                self.functions[index],
                item["prompt"],
                item["response"],
                {**item["sample"], "answer": item["answer"], "steps": steps},
                spec.timeout_s,
                f"scoring.scorers[{index}].timeout_s",
                None if steps is None else len(steps),
            )
        except Exception as e:  # noqa: BLE001 - the function's failure (a raise, a timeout, a wrong return) fails its episode
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        return {"score": score}

    async def _remote_call(self, index: int, item: dict) -> dict:
        """The item's result from a replica of scorer `index`. Items asked for within
        COALESCE_S of the first (a group's episodes tend to finish together) go in one
        message, as model turns do (meshrl/agent/turns.py)."""
        future = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(index, [])
        waiting.append(({k: v for k, v in item.items() if k != "step_ends"}, future))  # positions stay with the worker
        if len(waiting) == 1:
            asyncio.get_running_loop().call_later(COALESCE_S, self._send, index)
        return await future

    def _send(self, index: int) -> None:
        batch = self._waiting.pop(index, [])
        if batch:
            task = asyncio.ensure_future(self._call(index, batch))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _call(self, index: int, batch: list) -> None:
        """Ask the least-loaded replica; a replica that fails the call (it died) is not the
        episodes' fault: ask again until one answers or replace_s has passed."""
        spec, items = self.specs[index], [item for item, _ in batch]
        deadline = time.monotonic() + self.replace_s
        last, results, error = "no replica", None, None
        while results is None and error is None:
            replicas = self.replicas.get(index) or []
            if replicas:
                ident, actor = min([r for r in replicas if r[0] not in self._wedged] or replicas, key=lambda r: self._load.get(r[0], 0))
                self._load[ident] = self._load.get(ident, 0) + 1
                try:
                    results = await self._ask(index, ident, actor, items)
                    break
                except (asyncio.TimeoutError, TimeoutError):
                    results = [{"error": f"took longer than scoring.scorers[{index}].timeout_s={spec.timeout_s:g}s"}] * len(batch)
                    break
                except asyncio.CancelledError:  # the worker is stopping
                    for _, future in batch:
                        future.cancel()
                    raise
                except Exception as e:  # noqa: BLE001 - a dead replica: asked again below
                    last = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                    if ident in self._wedged and any(r[0] not in self._wedged for r in replicas):
                        continue  # (its `finally` runs first) another is listed: asked at once
                finally:
                    self._load[ident] -= 1
            left = deadline - time.monotonic()
            if left <= 0:
                error = ScorerUnavailable(f"scorer {self.names[index]}: no replica answered in {self.replace_s:g}s ({last})")
                break
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), min(RETRY_S, left))
            except asyncio.TimeoutError:
                pass
        for k, (_, future) in enumerate(batch):
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(dict(results[k]))

    async def _ask(self, index: int, ident, actor, items: list) -> list:
        """The replica's answers, within the scorer's timeout_s; ReplicaGone as soon as the
        controller's list of replicas no longer holds this one."""
        call = asyncio.ensure_future(asyncio.wait_for(awaited(actor.score.call_one(items)), self.specs[index].timeout_s))
        try:
            while True:
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait({call, changed}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                if call.done():
                    results = call.result()
                    if results and all(r.get("wedged") for r in results):  # (it answers at once: least loaded, it drew every call)
                        self._wedged.add(ident)
                        raise ReplicaGone(f"replica {ident} of scorer {self.names[index]} is wedged: {results[0].get('error')}")
                    return results
                if all(other != ident for other, _ in self.replicas.get(index, [])):
                    raise ReplicaGone(f"replica {ident} of scorer {self.names[index]} left the list unanswered")
        finally:
            call.cancel()  # no-op once done


def fail_with_threads(ep: Episode) -> None:
    """A game's episode with a thread that failed its score fails whole, every thread with it
    (in place; an env's episode, or a game's with no failed thread, is left as it is)."""
    failed = next((row for row in ep.threads if row.finish_reason == "failed"), None)
    if failed is not None and ep.finish_reason != "failed":
        ep.finish_reason, ep.failure = "failed", failed.failure
        for row in ep.threads:
            row.finish_reason = "failed"


def scoring_item(record: dict, response: str) -> dict:
    """What a scorer is sent for `record` answered by `response` (backends.py has the fields)."""
    prompt, answer = record.get("prompt"), record.get("answer")
    return {
        "prompt": prompt_text(prompt),
        "messages": prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) else None,
        "response": response,
        "answer": "" if answer is None else str(answer),
        "sample": {k: v for k, v in record.items() if k != "prompt" and _jsonable(v)},
        "steps": None,
    }


def _jsonable(value) -> bool:
    return isinstance(value, (str, int, float, bool, type(None), list, dict))
