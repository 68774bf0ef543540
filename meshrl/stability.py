"""The run-level alarm: a reward or entropy cliff, said once on the console.

A run that learned something and then lost it (the async collapse of issue 34: a plateau of
0.5, then every episode at 0 within five steps, and no gradient left to come back) should
not go unnoticed until its summary line. `CliffWatch` follows two per-step series:

- reward: `buffer/sampled_reward_mean` (the policy's samples, dropped zero-variance groups
  included), else `trainer/reward_mean`. A cliff is the mean of the last `alarm.window`
  steps falling under `alarm.reward_drop` x the best such window mean so far, once that
  best has reached `alarm.min_best_reward`.
- entropy: `trainer/entropy` (nats per trained token). A cliff is the last window's mean
  under `alarm.entropy_floor`: no exploration left, every group scores the same.

Each kind raises one alarm and then stays quiet until its series is healthy again. The
alarm names the last good checkpoint: the newest one written before the first unhealthy
window began (the fall happened inside that window, and a checkpoint written during it
may hold the falling policy). Pure Python: the controller (meshrl/controller/loop.py)
feeds it each step's row and logs the line.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

REWARD_KEYS = ("buffer/sampled_reward_mean", "trainer/reward_mean")
ENTROPY_KEY = "trainer/entropy"


def window_means(values: Sequence[float], window: int) -> list[float]:
    """The mean of each full window of `window` consecutive values, ending at each step from
    the `window`-th on."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


def reward_cliff(rewards: Sequence[float], window: int, drop: float, min_best: float) -> bool:
    """Whether the last full window's mean reward is under `drop` x the best window mean of
    the series, and that best reached `min_best` (a pure function of the whole series)."""
    means = window_means(rewards, window)
    if not means:
        return False
    best = max(means)
    return best >= min_best and means[-1] < drop * best


def entropy_cliff(entropies: Sequence[float], window: int, floor: float) -> bool:
    """Whether the last full window's mean entropy is under `floor` (0: never)."""
    means = window_means(entropies, window)
    return floor > 0 and bool(means) and means[-1] < floor


@dataclass
class Alarm:
    kind: str
    """`reward` or `entropy`."""
    step: int
    value: float
    """The last window's mean."""
    reference: float
    """The best window's mean reward (reward), or the floor (entropy)."""
    good_checkpoint: int | None
    """Step of the newest checkpoint written before the alarm's window began; None if none was."""

    def line(self, window: int, drop: float) -> str:
        """The one console line."""
        if self.kind == "reward":
            what = (
                f"reward fell off a cliff at step {self.step}: mean {self.value:.3f} over the last {window} steps, "
                f"under {drop:g} x the best window's {self.reference:.3f}"
            )
        else:
            what = (
                f"policy entropy collapsed at step {self.step}: {self.value:.4f} nats per token over the last {window} "
                f"steps, under alarm.entropy_floor={self.reference:g}"
            )
        if self.good_checkpoint is None:
            return f"ALARM: {what}; no checkpoint was written before it (trainer.checkpoint_every)"
        return (
            f"ALARM: {what}; last good checkpoint: step {self.good_checkpoint} "
            f"(checkpoints/step_{self.good_checkpoint:06d}_loop_state.pt; docs/stability.md: going back to it)"
        )


class CliffWatch:
    """Feeds on one metrics row per step; returns the alarms to raise at that step."""

    def __init__(self, window: int, reward_drop: float, min_best_reward: float, entropy_floor: float):
        self.window, self.drop, self.min_best, self.floor = window, reward_drop, min_best_reward, entropy_floor
        self.rewards: deque[float] = deque(maxlen=window)
        self.entropies: deque[float] = deque(maxlen=window)
        self.best = float("-inf")
        self.healthy = {"reward": True, "entropy": True}
        self.checkpoints: list[int] = []
        self.raised: list[Alarm] = []

    @classmethod
    def from_config(cls, alarm) -> "CliffWatch":
        return cls(alarm.window, alarm.reward_drop, alarm.min_best_reward, alarm.entropy_floor)

    def checkpointed(self, step: int) -> None:
        self.checkpoints.append(step)

    def update(self, step: int, row: dict) -> list[Alarm]:
        alarms = []
        reward = next((row[k] for k in REWARD_KEYS if k in row), None)
        if reward is not None:
            self.rewards.append(float(reward))
            if len(self.rewards) == self.window:
                mean = sum(self.rewards) / self.window
                self.best = max(self.best, mean)
                cliff = self.best >= self.min_best and mean < self.drop * self.best
                alarms += self._judge("reward", step, cliff, mean, self.best)
        if ENTROPY_KEY in row and self.floor > 0:
            self.entropies.append(float(row[ENTROPY_KEY]))
            if len(self.entropies) == self.window:
                mean = sum(self.entropies) / self.window
                alarms += self._judge("entropy", step, mean < self.floor, mean, self.floor)
        self.raised += alarms
        return alarms

    def _judge(self, kind: str, step: int, cliff: bool, value: float, reference: float) -> list[Alarm]:
        if not cliff:
            self.healthy[kind] = True
            return []
        if not self.healthy[kind]:
            return []  # said already; quiet until the series recovers
        self.healthy[kind] = False
        # the fall began inside this first unhealthy window: good checkpoints precede it
        good = [c for c in self.checkpoints if c <= step - self.window]
        return [Alarm(kind, step, value, reference, max(good) if good else None)]
