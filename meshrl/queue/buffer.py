"""The episode queue: the one place that owns admission, in-flight work and staleness.

Every group of episodes (one prompt, `generator.group_size` episodes) is in one state:

    PENDING --claim--> RUNNING --put--> READY --sample--> trained
       ^                  |
       +-----requeue------+   (its worker, generator or env failed; its worker gave the claim up, `abandon`; or the run resumed)

- Admission. A rollout worker claims a group only while the run may start more work: the
  trainer at version v trains batch v next, and a group admitted now is trained at the
  latest `ahead` versions later, so at most (v + 1 + ahead) batches are ever admitted
  (plus replacements for dropped groups). ahead = min(depth, max_lag): depth 0
  is synchronous (a batch is admitted only once the trainer is at its version), 1 a double
  buffer, K a bounded queue. Under placement=colocate ahead is 0 (the roles take turns),
  and with max_lag 1 a claim accepts weights one version old (`_min_version`).
- Versions. A claim carries the queue's version, and the generator serves its requests
  only with weights at least that new, so every token of a group admitted at v is from a
  version >= v. With admission bounded as above, no trained token is more than `max_lag`
  versions old; the check at sample time (mask stale tokens, or drop the group, by
  `lag_granularity`; a model held by `trainer.pace` counts its own weight updates) guards
  what admission cannot know: stragglers overtaken by later groups, a bound tightened mid-run.
- Dynamic sampling (`buffer.dynamic_sampling`). A group whose episodes all scored the same
  carries no gradient (`episode.without_signal`): `put` drops it, as it drops a stale one,
  and admission starts a replacement. At most `max_dropped_per_batch` are dropped between
  two batches the trainer takes; past that they are kept and trained, so a task on which
  everything scores the same costs a bounded amount of extra generation and never stalls.
  Dropped groups were played by the current policy: their rewards still count in
  `buffer/sampled_reward_mean`.
- The policy version comes from the trainer alone (`sample` and `set_version`). `state_dict`
  keeps READY groups and re-queues RUNNING ones on load: none lost or trained twice on resume.
- The batches taken since the trainer's newest restorable version (`set_version`'s
  `durable`) are held: a healed trainer retakes them (`retake`, controller/heal.py), each step
  it lost trained again from its own batch whatever `buffer.sampling` picks (bar stale groups).
- The user's code here (a data source's records, a `buffer.sampling` policy) failing closes the
  queue on one line (`failure`), which every claim and sample then raises as a `UserCodeError`.

`EpisodeQueue` is plain, thread-safe Python (no Monarch); `meshrl/queue/actor.py`'s
`EpisodeQueueActor` serves it on a proc mesh.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Sequence

from tensordict import TensorDict

from meshrl import episode
from meshrl.config import Config
from meshrl.queue.prompts import PromptNode
from meshrl.queue.sampling import check_one_group, insert_oldest_first, resolve_policy, straggler_wait
from meshrl.errors import BatchTimeout, PolicyWentBack, QueueClosed, UserCodeError, describe
from meshrl.logs import role_log

COUNTS = "puts samples requeued retaken_groups late_puts dropped_stale_groups dropped_stale_tokens masked_stale_tokens".split()
COUNTS += ["dropped_zero_variance_groups", "kept_zero_variance_groups", "dropped_failed_groups"]  # the counters `metrics` reports as buffer/NAME
MAX_FAILED_PLAYS = 4
"""Plays of one group its workers may give up on (`requeue` with a failure) before it is dropped, as a stale one is: a record nothing can play."""


@dataclass
class Claim:
    """One group handed to a rollout worker."""

    group_id: int
    sample: dict
    """The data record: `prompt` (text or chat messages), `answer` and the task's fields."""
    version: int
    """Its tokens must come from this policy version or newer (the generator waits for it)."""
    token: int = -1
    """Names this claim: only a put with it is taken (a re-claimed group's earlier holder is refused)."""


class EpisodeQueue:
    """Admission, the in-flight ledger, READY groups and the staleness bound. Thread-safe."""

    def __init__(self, config: Config):
        b = config.buffer
        self.cfg = b
        self.batch_groups = config.batch_groups
        self.colocated = config.placement == "colocate"
        if self.colocated:  # nothing is generated during a training step: a batch is admitted at its version
            self.depth, self.max_lag = 0, 0 if b.max_lag == 0 else 1
        else:
            self.depth, self.max_lag = b.depth, 0 if b.depth == 0 else b.max_lag
        self.policy = resolve_policy(b.sampling)
        self.paces = config.paces()  # a held model's lag counts its own weight updates
        self.node = PromptNode(config.data, config.seed)
        self.node.reset()
        self.version = 0
        self.next_group_id = 0
        self.dropped = 0  # groups dropped (stale, or without signal): admission replaces them
        self.dynamic_sampling = b.dynamic_sampling
        self.max_dropped_per_batch = config.batch_groups if b.max_dropped_per_batch is None else b.max_dropped_per_batch
        self._flat_dropped = 0  # groups dropped without signal since the trainer's last batch
        self._flat_reward = [0.0, 0]  # their episodes' reward sum and count (failed ones left out)
        self._sampled_reward: float | None = None  # the last batch's, with the groups dropped while it filled
        self.pending: deque[tuple[int, dict]] = deque()  # re-queued (group id, sample), handed out first
        self.running: dict[int, tuple[dict, int, int, int]] = {}  # group id -> (sample, worker, claim version, token)
        self._tokens, self._gone = itertools.count(), set()  # claims' tokens; workers presumed dead (`requeue`)
        self._answered: dict[int, tuple] = {}  # worker -> (request, group id, token) of its last claim answered; `abandon`
        self._abandoned: dict[int, int] = {}  # worker -> the claim request it stopped waiting for
        self.ready: deque[TensorDict] = deque()
        self._ready_at: dict[int, float] = {}  # group id -> when it was put (READY)
        self._straggler_s = 0.0
        self.consumed: list[int] = []  # group ids trained, in order
        self.held: list[tuple[int, list[TensorDict]]] = []  # batches taken since the trainer's restorable version, by version (`retake`)
        self.dropped_ids: list[int] = []  # group ids dropped (stale, or without signal), in order
        self.partners = len(config.models) - len(config.frozen_models())  # they train on the policy's batch, their own rows (`shared`)
        self._shared: dict[int, TensorDict] = {}
        self._partner_durable: dict[int, int] = {}  # model index -> the newest version its trainer can be restored to
        self._retaken: deque[list[int]] = deque()  # the group ids of each batch `retake` put back, for `sample`
        self._heals = 0  # `retake`s so far: a sample waiting since before one was the replaced trainer's
        self._back_from: int | None = None  # the version a heal took the policy back from, until it is there again
        self._cond = threading.Condition()
        self._rng = random.Random(config.seed)
        self._closed = False
        self._stats: Counter = Counter()
        self._failed_plays: Counter[int] = Counter()  # group id -> plays its workers gave up on
        self._lag_hist: Counter[int] = Counter()  # the last batch's trained tokens by their lag (buffer/lag_*)
        self.failure: str | None = None
        self._log = role_log(config, "queue")

    def _failed(self, exc: BaseException) -> UserCodeError:
        """The user's code failed (the lock held): close the queue on its one line."""
        self.failure = describe(exc, "queue", self._log)
        logging.getLogger("meshrl").error("the episode queue stops: %s", self.failure, exc_info=exc)
        self._closed = True
        self._cond.notify_all()
        return UserCodeError(self.failure)

    def _raise_closed(self) -> None:
        if self.failure is not None:
            raise UserCodeError(self.failure)
        raise QueueClosed("episode queue closed")

    # ---- admission ----------------------------------------------------------------------------
    @property
    def ahead(self) -> int:
        """Batches admitted beyond the one the trainer trains next."""
        return self.depth if self.max_lag is None else min(self.depth, self.max_lag)

    def _admissible(self) -> bool:
        return self.next_group_id < (self.version + 1 + self.ahead) * self.batch_groups + self.dropped

    def claim(self, worker: int, timeout: float, request: int | None = None) -> Claim | None:
        """The next group for `worker`; None when nothing may start within `timeout` s (the worker asks again). Raises QueueClosed once closed.
        `request`: the worker's name for this call, which `abandon` gives up on."""
        with self._cond:
            given_up = lambda: worker in self._gone or (request is not None and self._abandoned.get(worker) == request)  # noqa: E731
            if not self._cond.wait_for(lambda: self._closed or self.pending or self._admissible(), timeout) or given_up():
                return None  # (a claim its worker stopped waiting for takes nothing: its answer would be lost)
            if self._closed:
                self._raise_closed()
            if self.pending:
                gid, sample = self.pending.popleft()
            else:
                try:
                    sample = next(self.node)
                except Exception as e:  # noqa: BLE001 - a bad record of the user's source ends the run, in one line
                    raise self._failed(e) from None
                gid = self.next_group_id
                self.next_group_id += 1
            token = next(self._tokens)
            self.running[gid] = (sample, worker, self.version, token)
            self._answered[worker] = (request, gid, token)
            return Claim(gid, sample, self._min_version(), token)

    def abandon(self, worker: int, request: int) -> None:
        """`worker` stopped waiting for its claim `request` (a slow answer): the group it took, if any, is handed out again
        (no failed play), else that claim takes nothing when it wakes. Without this a group answered late stays RUNNING for good."""
        with self._cond:
            self._abandoned[worker] = request
            answered, gid, token = self._answered.get(worker, (None, -1, -1))
            if answered == request:
                self.requeue(None, [gid], None, token)

    def _min_version(self) -> int:
        """The oldest weights a claim's tokens may come from: the queue's version, except one
        step off the policy under placement=colocate, where the batch of version v starts on
        the weights the generators hold while v is still being loaded."""
        return max(0, self.version - self.max_lag) if self.colocated else self.version

    def put(self, group_id: int, group: TensorDict, token: int | None = None) -> bool:
        """A finished group, delivered under its claim's `token`. False if it is no longer
        this claim's to deliver (re-queued, and perhaps claimed again, after its worker was
        presumed dead) or it is too stale to train on. Without a token any holder may put.
        A group dropped by dynamic sampling is True: delivered, its episodes count, it is
        only not trained."""
        check_one_group(group, group_id)
        with self._cond:
            entry = self.running.get(group_id)
            if entry is None or (token is not None and entry[3] != token):
                self._stats["late_puts"] += 1
                return False
            del self.running[group_id]
            group = self._admit(group)
            if group is None:
                self._cond.notify_all()  # dropped as stale: admission replaces it, wake a waiting worker
                return False
            if self.dynamic_sampling and episode.without_signal(group):
                if self._flat_dropped < self.max_dropped_per_batch:
                    self._flat_dropped += 1
                    self.dropped += 1
                    self.dropped_ids.append(group_id)
                    self._stats["dropped_zero_variance_groups"] += 1
                    ok = episode.policys_played(group)
                    self._flat_reward[0] += float(group["reward"][ok].sum())
                    self._flat_reward[1] += int(ok.sum())
                    self._cond.notify_all()  # admission replaces it: wake a waiting worker
                    return True  # delivered, and its episodes count; it is only not trained
                self._stats["kept_zero_variance_groups"] += 1
            insert_oldest_first(self.ready, group)
            self._ready_at[group_id] = time.monotonic()
            self._stats["puts"] += 1
            self._cond.notify_all()
            return True

    def requeue(self, worker: int | None = None, group_ids: Sequence[int] | None = None, failure: str | None = None, token: int | None = None) -> int:
        """Hand RUNNING groups out again, first: those of `worker` (presumed dead), or the given ids, or all.
        `failure`: why a live worker gave them up; the MAX_FAILED_PLAYS-th time (a dead worker's counting), the group is dropped.
        `token`: only under that claim (a worker presumed dead gives up no claim another has taken since)."""
        with self._cond:
            self._gone |= {worker} - {None}
            ids = sorted(
                gid
                for gid, (_, holder, _, held) in self.running.items()
                if (worker is None or holder == worker) and (group_ids is None or gid in group_ids) and token in (None, held)
            )
            for gid in ids:
                sample = self.running.pop(gid)[0]
                self._failed_plays[gid] += failure is not None or worker is not None  # (a record that kills its worker's proc, too)
                if self._failed_plays[gid] < MAX_FAILED_PLAYS:
                    self.pending.append((gid, sample))
                    self._stats["requeued"] += 1
                    continue
                self.dropped, self._stats["dropped_failed_groups"] = self.dropped + 1, self._stats["dropped_failed_groups"] + 1
                self.dropped_ids.append(gid)  # admission replaces it
                logging.getLogger("meshrl").warning("group %d dropped after %d failed plays, the last: %s", gid, MAX_FAILED_PLAYS, failure or "its worker died")
            self._cond.notify_all()
            return len(ids)

    # ---- the trainer ----------------------------------------------------------------------------
    def sample(self, num_groups: int, current_version: int, timeout: float | None = None) -> TensorDict:
        """`num_groups` READY groups as one batch for training version `current_version`; waits for them at most
        `timeout` s (default buffer.get_timeout_s). A wait a `retake` overtook (a healed trainer's) raises, taking nothing."""
        if num_groups > (1 + self.ahead) * self.batch_groups:
            raise ValueError(f"cannot sample {num_groups} groups when at most {(1 + self.ahead) * self.batch_groups} are admitted")
        timeout = self.cfg.get_timeout_s if timeout is None else timeout
        start = time.monotonic()
        with self._cond:
            heals = self._heals
            self._set_version(current_version)
            while len(self.ready) < num_groups and not self._closed:
                left = timeout - (time.monotonic() - start)
                if left <= 0:
                    raise BatchTimeout(
                        f"episode queue had {len(self.ready)} of {num_groups} groups after {timeout:.0f}s "
                        f"({len(self.running)} running): rollouts are not arriving; raise buffer.get_timeout_s or check the generators"
                    )
                self._cond.wait(left)
                if self._heals != heals:  # its trainer is gone: it takes no batch, nor moves the version on again
                    raise RuntimeError(f"a sample for version {current_version} outlived its trainer, replaced by a heal")
                self._set_version(current_version)
            if self._closed:
                self._raise_closed()
            try:
                retaken = self._retaken.popleft() if self._retaken else []  # a retaken batch first, as it was
                again = [next((i for i, g in enumerate(self.ready) if int(g["group_id"][0]) == gid), None) for gid in retaken]
                chosen = again if len(again) == num_groups and None not in again else list(self.policy(list(self.ready), num_groups, self._rng))
                if len(set(chosen)) != num_groups or not all(isinstance(i, int) and 0 <= i < len(self.ready) for i in chosen):
                    raise ValueError(
                        f"sampling policy {self.cfg.sampling!r} returned {str(chosen)[:80]}: expected {num_groups} "
                        f"distinct indices into the {len(self.ready)} ready groups"
                    )
            except Exception as e:  # noqa: BLE001 - the user's policy: the run ends, in one line
                raise self._failed(e) from None
            picked = [self.ready[i] for i in chosen]
            batch = episode.concat(picked)  # before the groups leave READY: a batch that cannot form loses none
            for i in sorted(chosen, reverse=True):
                del self.ready[i]
            self.held.append((current_version, picked))
            if self.partners:  # kept back to the oldest version a healed model's trainer would train again
                keep_from = min([current_version - 1, *self._partner_durable.values()])
                self._shared = {v: b for v, b in self._shared.items() if v >= keep_from}
                self._shared[current_version] = batch
                self._cond.notify_all()  # the models waiting for it (`shared`)
            ids = [int(g["group_id"][0]) for g in picked]
            self.consumed += ids
            self._straggler_s = straggler_wait(start, [self._ready_at.pop(gid, start) for gid in ids])
            self._lag_hist = Counter(episode.staleness(batch, current_version, self.paces)[batch["loss_mask"]].tolist())  # this batch's
            ok = episode.policys_played(batch)
            total, count = float(batch["reward"][ok].sum()) + self._flat_reward[0], int(ok.sum()) + self._flat_reward[1]
            self._sampled_reward = total / count if count else 0.0
            self._flat_dropped, self._flat_reward = 0, [0.0, 0]
            self._stats["samples"] += 1
            self._stats["consumer_wait_s"] += time.monotonic() - start
            return batch

    def shared(self, version: int, timeout: float | None = None) -> TensorDict:
        """The batch the policy's trainer took for `version` (waits for it at most `timeout` s, default
        buffer.get_timeout_s): what each trained model beside the policy trains its step `version` on. The
        policy's trainer may be a step ahead, so the last two versions' batches are kept, and those since each
        model's restorable version (`set_partner_durable`), which its healed trainer trains again. One let go
        raises at once, PolicyWentBack once the policy's heal took it back before it took the batch, and a
        closed queue only when none is stored. A heal of the policy's trainer (`retake`) restarts the wait."""
        timeout = self.cfg.get_timeout_s if timeout is None else timeout
        with self._cond:
            if self._shared and version < min(self._shared):  # no model's trainer could be restored to it any more
                raise LookupError(f"no batch for version {version}: let go (the oldest kept: {min(self._shared)}; see trainer.snapshot_every)")
            behind = lambda: self._back_from is not None and self.version < version  # noqa: E731 (taken back below it)
            heals, end = self._heals, time.monotonic() + timeout
            while not (self._closed or version in self._shared or behind()):
                if self._heals != heals:  # the policy's new trainer takes the batch: its wait starts now
                    heals, end = self._heals, time.monotonic() + timeout
                if end <= time.monotonic():
                    raise BatchTimeout(f"no batch for version {version} after {timeout:.0f}s: the policy's trainer has not taken it")
                self._cond.wait(end - time.monotonic())
            if version in self._shared:  # stored: handed out even once the queue closed (the model ends its step)
                return self._shared[version]
            if self._closed:
                self._raise_closed()
            # (`retake`) it takes this batch later, as it reaches the version again
            raise PolicyWentBack(f"the policy's trainer went back to version {self.version} before taking the batch of {version}")

    def set_partner_durable(self, model: int, durable: int) -> None:
        """The newest version trained model `model`'s trainer can be restored to (its newest
        complete snapshot): the batches from it on are kept for its heal (`shared`)."""
        with self._cond:
            self._partner_durable[model] = durable

    def wait_ready(self, num_groups: int, timeout: float) -> bool:
        """Wait until `num_groups` groups are READY (a batch the trainer can take at once);
        False after `timeout` s. Raises if the queue closes."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._closed or len(self.ready) >= num_groups, timeout)
            if self._closed:
                self._raise_closed()
            return ok

    def set_version(self, version: int, durable: int | None = None) -> None:
        """The trainer's policy version: opens admission, re-checks READY groups. `durable`:
        the newest version the trainer can be restored to (default `version`); the batches
        taken for versions before it are let go, the later ones held for `retake`."""
        with self._cond:
            self._set_version(version)
            keep_from = version if durable is None else durable
            self.held = [(v, groups) for v, groups in self.held if v >= keep_from]
            self._cond.notify_all()

    def retake(self, version: int) -> list[int]:
        """A trainer restored to `version`: the batches taken for it and later go back to the
        front of READY, in the order they were taken, and out of `consumed` (they are trained
        again, once); the version goes back to `version`. Returns their group ids. Those let go since
        `version` (restored from older than `durable` said) are replaced by admission with new groups."""
        with self._cond:
            taken = {v for v, _ in self.held}
            self.dropped += self.batch_groups * sum(v not in taken for v in range(version, self.version))
            back = [g for v, groups in self.held if v >= version for g in groups]
            self._retaken = deque([*([int(g["group_id"][0]) for g in groups] for v, groups in self.held if v >= version), *self._retaken])
            self.held = [(v, groups) for v, groups in self.held if v < version]
            ids = [int(g["group_id"][0]) for g in back]
            gone = set(ids)
            self.consumed = [gid for gid in self.consumed if gid not in gone]
            if version < self.version and self.partners:  # the models beside it waiting for a later batch are told (`shared`)
                self._back_from = max(self.version, self._back_from or 0)
            self.version, self._heals = min(self.version, version), self._heals + 1
            now = time.monotonic()
            for g in reversed([g for g in map(self._admit, back) if g is not None]):  # under the bound now (Session.set may have tightened it)
                self.ready.appendleft(g)
                self._ready_at[int(g["group_id"][0])] = now
            self._stats["retaken_groups"] += len(back)
            self._cond.notify_all()
            return ids

    def set_max_lag(self, max_lag: int | None) -> None:
        """Change the staleness bound; admission follows at once (depth 0 stays on-policy)."""
        if max_lag is not None and max_lag < 0:
            raise ValueError(f"max_lag must be at least 0, got {max_lag}")
        with self._cond:
            if self.colocated:
                self.max_lag = 0 if max_lag == 0 else 1
            else:
                self.max_lag = 0 if self.depth == 0 else max_lag
            self._recheck_ready()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- staleness --------------------------------------------------------------------------------
    def _set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went backwards: {version} < {self.version}")
        if version == self.version:
            return
        self.version = version
        self._back_from = None if self._back_from is None or version >= self._back_from else self._back_from
        self._recheck_ready()
        self._cond.notify_all()  # admission opened (the trainer's sample can move the version too)

    def _recheck_ready(self) -> None:
        """Apply the current version and bound to every READY group (mask or drop)."""
        self.ready = deque(g for g in map(self._admit, self.ready) if g is not None)
        kept = {int(g["group_id"][0]) for g in self.ready}
        self._ready_at = {gid: t for gid, t in self._ready_at.items() if gid in kept}

    def _admit(self, group: TensorDict) -> TensorDict | None:
        """The group as it may be trained on at the current version, or None (dropped)."""
        if self.max_lag is None:
            return group
        real = group["loss_mask"]
        stale = (episode.staleness(group, self.version, self.paces) > self.max_lag) & real
        if not stale.any():
            return group
        if self.cfg.lag_granularity == "sequence" or stale.sum() == real.sum():
            self._stats["dropped_stale_groups"] += 1
            self._stats["dropped_stale_tokens"] += int(real.sum())
            self.dropped += 1
            self.dropped_ids.append(int(group["group_id"][0]))
            return None
        group = group.clone()
        group["loss_mask"] = real & ~stale
        self._stats["masked_stale_tokens"] += int(stale.sum())
        return group

    # ---- observability and resume ---------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        with self._cond:
            s, hist = self._stats, self._lag_hist
            tokens = sum(hist.values())
            return {
                "buffer/groups": float(len(self.ready)),
                "buffer/running": float(len(self.running)),
                "buffer/pending": float(len(self.pending)),
                "buffer/admitted": float(self.next_group_id),
                **{f"buffer/{k}": float(s[k]) for k in COUNTS},
                "buffer/consumer_wait_s": s["consumer_wait_s"],
                "buffer/straggler_s": self._straggler_s,
                "buffer/lag_mean": sum(k * v for k, v in hist.items()) / tokens if tokens else 0.0,
                "buffer/lag_max": float(max(hist, default=0)),
                **{f"buffer/lag_hist/{k}": float(v) for k, v in sorted(hist.items())},
                # the mean reward of the last batch's episodes and of the groups dropped without signal while it filled:
                # the sampling policy's reward, which trainer/reward_mean (groups with signal only) misstates under dynamic sampling
                **({"buffer/sampled_reward_mean": self._sampled_reward} if self._sampled_reward is not None else {}),
            }

    def state_dict(self) -> dict:
        """Everything a resumed run needs; RUNNING groups are saved as pending."""
        with self._cond:
            pending = list(self.pending) + [(gid, entry[0]) for gid, entry in self.running.items()]
            return {
                "node": self.node.state_dict(),
                "version": self.version,
                "next_group_id": self.next_group_id,
                "dropped": self.dropped,
                "batch_groups": self.batch_groups,
                "flat_dropped": self._flat_dropped,
                "flat_reward": list(self._flat_reward),
                "pending": [{"group_id": gid, "sample": sample} for gid, sample in sorted(pending, key=lambda p: p[0])],
                "ready": [g.to_dict() for g in self.ready],
                "consumed": list(self.consumed),
                "dropped_ids": list(self.dropped_ids),
                "stats": dict(self._stats),
                "lag_hist": dict(self._lag_hist),
                "rng": self._rng.getstate(),
            }

    def load_state_dict(self, state: dict) -> str | None:
        """Restore a saved state; returns why its prompt position no longer holds (PromptNode.reset), if it does not."""
        with self._cond:
            self.node.reset(state["node"])
            self.version = state["version"]
            self.next_group_id = state["next_group_id"]
            self.dropped = state["dropped"] + self.version * (state.get("batch_groups", self.batch_groups) - self.batch_groups)  # in flight as saved
            self._flat_dropped, self._flat_reward = state.get("flat_dropped", 0), list(state.get("flat_reward", [0.0, 0]))  # (older checkpoints: absent)
            self.pending = deque((p["group_id"], p["sample"]) for p in state["pending"])
            self.running = {}
            self.ready = deque(TensorDict.from_dict(g, batch_size=[len(g["group_id"])]) for g in state["ready"])
            self.consumed = list(state["consumed"])
            self.dropped_ids = list(state.get("dropped_ids", []))  # absent from older checkpoints
            self._stats = Counter(state["stats"])
            self._lag_hist = Counter(state["lag_hist"])
            self._rng.setstate(state["rng"])
            self._recheck_ready()  # under this run's bound: a resume may have changed buffer.max_lag or lag_granularity
            self._cond.notify_all()
            return self.node.changed
