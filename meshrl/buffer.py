"""The bounded replay buffer between generators and the trainer, and its staleness policy.

Items are whole GRPO groups (a rollout TensorDict whose rows share one group id), so a
group is never split. The policy, in one place:

- depth: the buffer holds at most `max(depth, 1) * batch_groups` groups. depth 0 is
  synchronous on-policy training (one batch, and nothing older than the current version is
  accepted), 1 a double buffer, K a bounded queue of K batches. A put into a full buffer
  waits (backpressure, with a timeout) or evicts the oldest group, by config.
- version rejection: with `max_lag` set, a group whose tokens are too many versions behind
  the trainer is rejected at put and again at sample time. `lag_granularity="sequence"`
  drops a whole group when its oldest token is too stale; `"token"` masks only the stale
  tokens out of the loss and drops the group when nothing is left.
- importance-sampling correction happens in the loss (meshrl.trainer.losses); the buffer
  keeps the sampler log-probs and per-token versions it needs untouched.

`ReplayBuffer` is the pure, thread-safe logic; `ReplayBufferActor` serves it on a Monarch
proc mesh.
"""

from __future__ import annotations

import asyncio
import importlib
import random
import threading
import time
from collections import Counter, deque
from typing import Callable, Sequence

from monarch.actor import Actor, concurrent_endpoint
from tensordict import TensorDict

from meshrl import rollout
from meshrl.config import BufferConfig

SamplingPolicy = Callable[[Sequence[TensorDict], int, random.Random], list[int]]
"""A plain callable choosing which `n` of the buffered groups (oldest first) a batch takes."""


def fifo(groups: Sequence[TensorDict], n: int, rng: random.Random) -> list[int]:
    """The oldest `n` groups."""
    return list(range(n))


def uniform(groups: Sequence[TensorDict], n: int, rng: random.Random) -> list[int]:
    """`n` groups uniformly at random, without replacement."""
    return sorted(rng.sample(range(len(groups)), n))


def resolve_policy(name: str) -> SamplingPolicy:
    if name == "fifo":
        return fifo
    if name == "random":
        return uniform
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


class BufferClosed(RuntimeError):
    """The buffer was closed while a producer or consumer waited on it."""


class ReplayBuffer:
    """Bounded, staleness-aware store of rollout groups. Safe to share between threads."""

    def __init__(self, cfg: BufferConfig, batch_groups: int, seed: int = 0):
        self.cfg = cfg
        self.batch_groups = batch_groups
        self.capacity = max(cfg.depth, 1) * batch_groups
        # depth 0 means on-policy: nothing behind the current version may be trained on.
        self.max_lag = 0 if cfg.depth == 0 else cfg.max_lag
        self.policy = resolve_policy(cfg.sampling)
        self._groups: deque[TensorDict] = deque()
        self._cond = threading.Condition()
        self._rng = random.Random(seed)
        self._version = 0
        self._closed = False
        self._stats = Counter()
        self._lag_hist: Counter[int] = Counter()

    # ---- producers ----------------------------------------------------------------------
    def put(self, group: TensorDict, timeout: float | None = None) -> bool:
        """Add one group. Returns False if it was rejected as stale.

        Waits for room while the buffer is full (when_full="block"), at most `timeout`
        seconds (default: buffer.put_timeout_s), then raises TimeoutError.
        """
        _check_one_group(group)
        timeout = self.cfg.put_timeout_s if timeout is None else timeout
        start = time.monotonic()
        with self._cond:
            group = self._admit(group)
            if group is None:
                self._stats["rejected_at_put"] += 1
                return False
            while len(self._groups) >= self.capacity and not self._closed:
                if self.cfg.when_full == "evict_oldest":
                    self._groups.popleft()
                    self._stats["evicted"] += 1
                    continue
                left = timeout - (time.monotonic() - start)
                if left <= 0:
                    raise TimeoutError(
                        f"replay buffer full ({self.capacity} groups) for {timeout:.0f}s: the trainer is not consuming; "
                        "raise buffer.put_timeout_s or check the trainer"
                    )
                self._cond.wait(left)
            if self._closed:
                raise BufferClosed("replay buffer closed")
            group = self._admit(group)  # the trainer may have moved on while we waited
            if group is None:
                self._stats["rejected_at_put"] += 1
                return False
            self._groups.append(group)
            self._stats["puts"] += 1
            self._stats["producer_wait_s"] += time.monotonic() - start
            self._cond.notify_all()
            return True

    # ---- the trainer ----------------------------------------------------------------------
    def sample(self, num_groups: int, current_version: int, timeout: float | None = None) -> TensorDict:
        """Take `num_groups` groups as one rollout batch for training version `current_version`.

        Stale groups are dropped (or their stale tokens masked) first; waits until enough
        fresh groups are there, at most `timeout` seconds (default: buffer.get_timeout_s).
        """
        if num_groups > self.capacity:
            raise ValueError(f"cannot sample {num_groups} groups from a buffer holding at most {self.capacity}")
        timeout = self.cfg.get_timeout_s if timeout is None else timeout
        start = time.monotonic()
        with self._cond:
            self._set_version(current_version)
            while len(self._groups) < num_groups and not self._closed:
                left = timeout - (time.monotonic() - start)
                if left <= 0:
                    raise TimeoutError(
                        f"replay buffer had {len(self._groups)} of {num_groups} groups after {timeout:.0f}s: "
                        "generators are not producing; raise buffer.get_timeout_s or check the generators"
                    )
                self._cond.wait(left)
                self._set_version(current_version)
            if self._closed:
                raise BufferClosed("replay buffer closed")
            chosen = self.policy(list(self._groups), num_groups, self._rng)
            if len(set(chosen)) != num_groups or not all(0 <= i < len(self._groups) for i in chosen):
                raise ValueError(f"sampling policy {self.cfg.sampling!r} returned bad indices {chosen}")
            picked = [self._groups[i] for i in chosen]
            for i in sorted(chosen, reverse=True):
                del self._groups[i]
            batch = rollout.concat(picked)
            lag = rollout.staleness(batch, current_version)[batch["response_mask"]]
            self._lag_hist.update(lag.tolist())
            self._stats["samples"] += 1
            self._stats["consumer_wait_s"] += time.monotonic() - start
            self._cond.notify_all()
            return batch

    def set_version(self, version: int) -> None:
        """Tell the buffer the trainer's current policy version (drops what is now too stale)."""
        with self._cond:
            self._set_version(version)
            self._cond.notify_all()

    def set_max_lag(self, max_lag: int | None) -> None:
        """Change the staleness bound (not below 0; depth 0 stays on-policy). Applies to
        groups already buffered at the next version change or sample."""
        if max_lag is not None and max_lag < 0:
            raise ValueError(f"max_lag must be at least 0, got {max_lag}")
        with self._cond:
            self.max_lag = 0 if self.cfg.depth == 0 else max_lag
            self._groups = deque(g for g in (self._admit(g) for g in self._groups) if g is not None)
            self._cond.notify_all()

    def evict_oldest(self, n: int = 1) -> int:
        """Drop up to `n` of the oldest groups; returns how many were dropped."""
        with self._cond:
            n = min(n, len(self._groups))
            for _ in range(n):
                self._groups.popleft()
            self._stats["evicted"] += n
            self._cond.notify_all()
            return n

    def close(self) -> None:
        """Wake every waiting producer and consumer with BufferClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    # ---- staleness --------------------------------------------------------------------------
    def _set_version(self, version: int) -> None:
        if version < self._version:
            raise ValueError(f"policy version went backwards: {version} < {self._version}")
        if version == self._version:
            return  # every buffered group was admitted at this version already
        self._version = version
        kept = deque()
        for group in self._groups:
            group = self._admit(group)
            if group is not None:
                kept.append(group)
            else:
                self._stats["dropped_at_sample"] += 1
        self._groups = kept

    def _admit(self, group: TensorDict) -> TensorDict | None:
        """The group as it may be trained on at the current version, or None if too stale."""
        if self.max_lag is None:
            return group
        lag = rollout.staleness(group, self._version)
        real = group["response_mask"]
        stale = (lag > self.max_lag) & real
        if not stale.any():
            return group
        if self.cfg.lag_granularity == "sequence" or stale.sum() == real.sum():
            self._stats["dropped_stale_groups"] += 1
            self._stats["dropped_stale_tokens"] += int(real.sum())
            return None
        group = group.clone()
        group["response_mask"] = real & ~stale
        self._stats["masked_stale_tokens"] += int(stale.sum())
        return group

    # ---- observability and resume ------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        with self._cond:
            s = self._stats
            hist = self._lag_hist
            tokens = sum(hist.values())
            return {
                "buffer/occupancy": len(self._groups) / self.capacity,
                "buffer/groups": float(len(self._groups)),
                "buffer/puts": float(s["puts"]),
                "buffer/samples": float(s["samples"]),
                "buffer/rejected_at_put": float(s["rejected_at_put"]),
                "buffer/dropped_stale_groups": float(s["dropped_stale_groups"]),
                "buffer/dropped_stale_tokens": float(s["dropped_stale_tokens"]),
                "buffer/masked_stale_tokens": float(s["masked_stale_tokens"]),
                "buffer/evicted": float(s["evicted"]),
                "buffer/producer_wait_s": s["producer_wait_s"],
                "buffer/consumer_wait_s": s["consumer_wait_s"],
                "buffer/lag_mean": sum(k * v for k, v in hist.items()) / tokens if tokens else 0.0,
                "buffer/lag_max": float(max(hist, default=0)),
                **{f"buffer/lag_hist/{k}": float(v) for k, v in sorted(hist.items())},
            }

    def state_dict(self) -> dict:
        with self._cond:
            return {
                "groups": [g.to_dict() for g in self._groups],
                "version": self._version,
                "stats": dict(self._stats),
                "lag_hist": dict(self._lag_hist),
                "rng": self._rng.getstate(),
            }

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self._groups = deque(
                TensorDict.from_dict(g, batch_size=[len(g["group_id"])]) for g in state["groups"]
            )
            self._version = state["version"]
            self._stats = Counter(state["stats"])
            self._lag_hist = Counter(state["lag_hist"])
            self._rng.setstate(state["rng"])
            self._cond.notify_all()


def _check_one_group(group: TensorDict) -> None:
    gids = group["group_id"]
    if gids.numel() == 0 or not bool((gids == gids[0]).all()):
        raise ValueError("the replay buffer takes one whole group per put (rows with one group_id)")


# ---- the actor ------------------------------------------------------------------------------
class ReplayBufferActor(Actor):
    """Serves a ReplayBuffer on a proc mesh. Every endpoint is concurrent and blocking waits run
    off the event loop, so a producer held by backpressure never blocks the trainer's sample."""

    def __init__(self, cfg: dict, batch_groups: int, seed: int = 0):
        self.buffer = ReplayBuffer(BufferConfig(**cfg), batch_groups, seed)

    @concurrent_endpoint
    async def put(self, group: TensorDict, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self.buffer.put, group, timeout)

    @concurrent_endpoint
    async def sample(self, num_groups: int, current_version: int, timeout: float | None = None) -> TensorDict:
        return await asyncio.to_thread(self.buffer.sample, num_groups, current_version, timeout)

    @concurrent_endpoint
    async def set_version(self, version: int) -> None:
        self.buffer.set_version(version)

    @concurrent_endpoint
    async def set_max_lag(self, max_lag: int | None) -> None:
        self.buffer.set_max_lag(max_lag)

    @concurrent_endpoint
    async def evict_oldest(self, n: int = 1) -> int:
        return self.buffer.evict_oldest(n)

    @concurrent_endpoint
    async def num_groups(self) -> int:
        return len(self.buffer)

    @concurrent_endpoint
    async def metrics(self) -> dict[str, float]:
        return self.buffer.metrics()

    @concurrent_endpoint
    async def state_dict(self) -> dict:
        return self.buffer.state_dict()

    @concurrent_endpoint
    async def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)

    @concurrent_endpoint
    async def close(self) -> None:
        self.buffer.close()
