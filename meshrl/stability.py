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

With trained models beside the policy (a game, docs/coevolve.md) each model is watched on
its own rows, so that one model's fall never hides under another's rise: the policy as alone
(the buffer's reward counts the policy's rows only), each model NAME on
`NAME/trainer/reward_mean` and `NAME/trainer/entropy`, its alarm named for it and marked
`NAME/alarm/KIND`.

Each kind raises one alarm and then stays quiet until its series is healthy again. The
alarm names the last good checkpoint: the newest one written before the first unhealthy
window began (the fall happened inside that window, and a checkpoint written during it
may hold the falling policy). Pure Python: the controller (meshrl/controller/loop.py)
feeds it each step's row and logs the line.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from meshrl.errors import RunFailed

REWARD_KEYS = ("buffer/sampled_reward_mean", "trainer/reward_mean")
ENTROPY_KEY = "trainer/entropy"
TOKENS_KEY = "trainer/tokens"


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
    model: str = ""
    """The trained model beside the policy whose series fell; empty: the policy."""

    @property
    def key(self) -> str:
        """Its mark in the step's metrics row."""
        return f"{self.model}/alarm/{self.kind}" if self.model else f"alarm/{self.kind}"

    def line(self, window: int, drop: float) -> str:
        """The one console line."""
        whose = f"{self.model}'s " if self.model else ""
        if self.kind == "reward":
            what = (
                f"{whose}reward fell off a cliff at step {self.step}: mean {self.value:.3f} over the last {window} steps, "
                f"under {drop:g} x the best window's {self.reference:.3f}"
            )
        else:
            what = (
                f"{whose or 'policy '}entropy collapsed at step {self.step}: {self.value:.4f} nats per token over the last {window} "
                f"steps, under alarm.entropy_floor={self.reference:g}"
            )
        if self.good_checkpoint is None:
            return f"ALARM: {what}; no checkpoint was written before it (trainer.checkpoint_every)"
        return (
            f"ALARM: {what}; last good checkpoint: step {self.good_checkpoint} "
            f"(checkpoints/step_{self.good_checkpoint:06d}_loop_state.pt; docs/stability.md: going back to it)"
        )


@dataclass
class _Series:
    """One model's watched series: the last window of each, the best reward window, and
    whether each kind is healthy (an alarm said once stays quiet until it is)."""

    reward_keys: tuple[str, ...]
    entropy_key: str
    tokens_key: str
    """A step where it is 0 trained none of the model's own rows (a stand-in row, masked): not a point of its series."""
    rewards: deque
    """(step, value) of its last window's points, as `entropies`."""
    entropies: deque
    best: float = float("-inf")
    healthy: dict = field(default_factory=lambda: {"reward": True, "entropy": True})


class CliffWatch:
    """Feeds on one metrics row per step; returns the alarms to raise at that step. `models`:
    the trained models beside the policy, each watched on its own series."""

    def __init__(self, window: int, reward_drop: float, min_best_reward: float, entropy_floor: float, models: Sequence[str] = ()):
        self.window, self.drop, self.min_best, self.floor = window, reward_drop, min_best_reward, entropy_floor

        def series(keys, entropy, tokens):
            return _Series(keys, entropy, tokens, deque(maxlen=window), deque(maxlen=window))

        self.series = {"": series(REWARD_KEYS, ENTROPY_KEY, TOKENS_KEY)}  # (the buffer's reward: the policy's rows alone, in a game too)
        self.series.update({m: series((f"{m}/{REWARD_KEYS[1]}",), f"{m}/{ENTROPY_KEY}", f"{m}/{TOKENS_KEY}") for m in models})
        self.checkpoints: list[int] = []
        self.raised: list[Alarm] = []

    @classmethod
    def from_config(cls, config) -> "CliffWatch":
        a = config.alarm
        return cls(a.window, a.reward_drop, a.min_best_reward, a.entropy_floor, [m.name for m in config.models if not m.frozen])

    def checkpointed(self, step: int) -> None:
        self.checkpoints.append(step)

    def update(self, step: int, row: dict) -> list[Alarm]:
        alarms = []
        for model, s in self.series.items():
            if row.get(s.tokens_key) == 0:
                continue
            reward = next((row[k] for k in s.reward_keys if k in row), None)
            if reward is not None and math.isfinite(reward):  # (a NaN reward is the trainer's to report, not a cliff's)
                s.rewards.append((step, float(reward)))
                if len(s.rewards) == self.window:
                    mean = sum(v for _, v in s.rewards) / self.window
                    s.best = max(s.best, mean)
                    cliff = s.best >= self.min_best and mean < self.drop * s.best
                    alarms += self._judge(s, model, "reward", step, cliff, mean, s.best)
            if s.entropy_key in row and self.floor > 0:
                s.entropies.append((step, float(row[s.entropy_key])))
                if len(s.entropies) == self.window:
                    mean = sum(v for _, v in s.entropies) / self.window
                    # NaN (a policy whose weights went NaN) is a collapse too, not a healthy window
                    alarms += self._judge(s, model, "entropy", step, not mean >= self.floor, mean, self.floor)
        self.raised += alarms
        return alarms

    def _judge(self, s: _Series, model: str, kind: str, step: int, cliff: bool, value: float, reference: float) -> list[Alarm]:
        if not cliff:
            s.healthy[kind] = True
            return []
        if not s.healthy[kind]:
            return []  # said already; quiet until the series recovers
        s.healthy[kind] = False
        # the fall began inside this first unhealthy window (its points, steps a model skipped
        # between them too): good checkpoints precede its first
        first = (s.rewards if kind == "reward" else s.entropies)[0][0]
        good = [c for c in self.checkpoints if c < first]
        return [Alarm(kind, step, value, reference, max(good) if good else None, model)]


# ---- the divergence alarm: the trained reward against a signal it does not train on ----------
def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of paired values; None under 3 pairs or when either side
    is constant (no order to compare)."""
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / (sxx * syy) ** 0.5


def signal_correlations(windows: Sequence[dict]) -> dict[str, float]:
    """Per signal of the step's episodes (each `scoring/NAME` value: the env's reward and every
    scorer's score): its rank correlation with the trained reward (`scoring/NAME/corr_trained`)
    and, for a scorer, with the env's reward (`scoring/NAME/corr_env`), over the episodes that
    did not fail; and its spread (`scoring/NAME/std`). A correlation is left out where it is
    undefined (a side constant, under 3 episodes)."""
    scored = [w for w in windows if not w.get("failed")]
    names = sorted({k.removeprefix("scoring/") for w in scored for k in w if k.startswith("scoring/") and k.count("/") == 1})
    row = {}
    for name in names:
        key = f"scoring/{name}"
        mine = [w for w in scored if key in w]
        values = [w[key] for w in mine]
        if len(values) > 1:
            mu = sum(values) / len(values)
            row[f"{key}/std"] = (sum((v - mu) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        pairs = {"trained": [(w[key], w["reward"]) for w in mine]}
        if name != "env":
            pairs["env"] = [(w[key], w["scoring/env"]) for w in mine if "scoring/env" in w]
        for other, xy in pairs.items():
            corr = rank_correlation([x for x, _ in xy], [y for _, y in xy])
            if corr is not None:
                row[f"{key}/corr_{other}"] = corr
    return row


TRAINED_KEY = "reward/mean"
SPREAD_KEY = "reward/std"
"""The trained reward of the step's episodes, a failed one as 0 (each `scoring/NAME/mean` covers the episodes it scored)."""
EVAL_KEY = "eval/reward_mean"
"""The env's reward on held-out prompts (controller/evaluation.py), one point per evaluation."""


@dataclass
class Reference:
    """A signal the run does not train on, watched against the trained reward."""

    name: str
    """As the console line names it."""
    key: str
    """Its metric; one point per row that has it."""
    corr_key: str | None
    """Its per-step rank correlation with the trained reward across the step's episodes (None: eval)."""
    std_key: str | None
    """Its spread across the step's episodes (None: eval, whose scale is taken as the trained reward's)."""


def references(config) -> list[Reference]:
    """The run's signals it does not train on: the env's reward beside scorers when
    `scoring.env_weight` is 0, each scorer at weight 0, and the held-out evaluation's reward."""
    s, out = config.scoring, []
    if s.scorers and s.env_weight == 0:
        out.append(Reference("env (the env's reward, the task's verifier; weight 0)", "scoring/env/mean", "scoring/env/corr_trained", "scoring/env/std"))
    for name, spec in zip(s.scorer_names(), s.scorers):
        if spec.weight == 0 and spec.model == "policy":  # another model's scores are not the policy's reward
            out.append(Reference(f"{name} (scorer, weight 0)", f"scoring/{name}/mean", f"scoring/{name}/corr_trained", f"scoring/{name}/std"))
    if config.eval.every:
        out.append(Reference("eval (the env's reward on held-out prompts)", EVAL_KEY, None, "eval/reward_std"))
    return out


def noise(values: Sequence[float]) -> float:
    """The step-to-step noise of a series: the spread of its first differences over sqrt(2)
    (a trend barely moves it; a steady series has none)."""
    diffs = [b - a for a, b in zip(values, values[1:])]
    if len(diffs) < 2:
        return 0.0
    mu = sum(diffs) / len(diffs)
    return (sum((d - mu) ** 2 for d in diffs) / (len(diffs) - 1) / 2) ** 0.5


def window_rows(points: Sequence[tuple], w: int) -> list[list[float]]:
    """Per window of `w` consecutive points (ending at each from the w-th on), the mean of each
    numeric field of the points (None counting as 0), by running sums: linear in the points."""
    sums, out = [0.0] * len(points[0]), []
    for i, p in enumerate(points):
        for k, v in enumerate(p):
            sums[k] += v or 0.0
            if i >= w:
                sums[k] -= points[i - w][k] or 0.0
        if i >= w - 1:
            out.append([v / w for v in sums])
    return out


@dataclass
class Divergence:
    reference: Reference
    step: int
    began: int
    """The first step after the reference's best window (the moves), or of the last window (the ranks)."""
    trained: tuple[float, float]
    """The trained reward's mean over the reference's best window and over the last window."""
    ref: tuple[float, float]
    """The reference's, likewise."""
    corr: float | None
    """The mean rank correlation of the last window (None: not measured)."""
    moved: bool
    """Whether the moves tripped it (else the correlation did)."""
    good_checkpoint: int | None

    def line(self) -> str:
        """The one console line."""
        (t0, t1), (r0, r1) = self.trained, self.ref
        name = self.reference.name.split(" ")[0]
        why = "rose while it fell" if self.moved else "ranks the episodes against it"
        corr = f"; their rank correlation across each step's episodes: {self.corr:+.2f}" if self.corr is not None else ""
        what = (
            f"the trained reward ({TRAINED_KEY}) is diverging from {self.reference.name} at step {self.step}: {why}: "
            f"trained {t0:.3f} -> {t1:.3f}, {name} {r0:.3f} -> {r1:.3f}{corr}; began at step {self.began}"
        )
        if self.good_checkpoint is None:
            return f"ALARM: {what}; no checkpoint was written before it (trainer.checkpoint_every)"
        return (
            f"ALARM: {what}; last checkpoint where they agreed: step {self.good_checkpoint} "
            f"(checkpoints/step_{self.good_checkpoint:06d}_loop_state.pt; docs/stability.md: a reward being gamed)"
        )


class DivergenceWatch:
    """Feeds on metrics rows (each step's, and each evaluation's); returns the divergences to
    raise. Per reference, over its last 2 x `window` points (`eval_window` for the held-out
    evaluation's, one point per evaluation): it trips when the trained reward's mean rose by
    at least `z` x the noise of that difference while the reference's fell by as much, or
    when the mean rank correlation across each step's episodes over the last `window` steps
    is under `corr_floor`. Quiet again until that reference agrees once more."""

    def __init__(self, refs: Sequence[Reference], window: int, eval_window: int, z: float, corr_floor: float, min_move: float = 0.0):
        self.refs, self.window, self.eval_window, self.z, self.corr_floor = list(refs), window, eval_window, z, corr_floor
        self.min_move = min_move
        self.points: dict[str, deque] = {r.key: deque(maxlen=HISTORY) for r in self.refs}
        self.trained: deque[float] = deque(maxlen=window)
        self.spread: deque[float] = deque(maxlen=window)  # the trained reward's spread across episodes
        self.healthy = {r.key: True for r in self.refs}
        self.checkpoints: list[int] = []
        self.raised: list[Divergence] = []

    @classmethod
    def from_config(cls, config) -> "DivergenceWatch | None":
        a, refs = config.alarm, references(config)
        if not (a.enabled and refs):
            return None
        every = max(config.eval.every, 1)
        return cls(refs, a.divergence_window, max(2, -(-a.divergence_window // every)), a.divergence_z, a.divergence_corr, a.divergence_min_move)

    def checkpointed(self, step: int) -> None:
        self.checkpoints.append(step)

    def update(self, step: int, row: dict) -> list[Divergence]:
        if TRAINED_KEY in row:
            self.trained.append(float(row[TRAINED_KEY]))
            self.spread.append(float(row.get(SPREAD_KEY, 0.0)))
        out = []
        for ref in self.refs:
            if ref.key not in row:
                continue
            if ref.corr_key is None:  # an evaluation: against the trained reward of the steps before it
                if not self.trained:
                    continue
                trained, spread = sum(self.trained) / len(self.trained), sum(self.spread) / len(self.spread)
                ref_spread = float(row.get(ref.std_key, 0.0))  # its own: a reward model's logits spread far wider than a verifier's 0 to 1
            elif TRAINED_KEY in row:
                trained, spread = float(row[TRAINED_KEY]), float(row.get(SPREAD_KEY, 0.0))
                ref_spread = float(row.get(ref.std_key, 0.0))
            else:
                continue
            corr = row.get(ref.corr_key) if ref.corr_key else None
            self.points[ref.key].append((step, trained, float(row[ref.key]), corr, spread, ref_spread))
            out += self._judge(ref, step)
        self.raised += out
        return out

    def _judge(self, ref: Reference, step: int) -> list[Divergence]:
        points = list(self.points[ref.key])
        w = self.window if ref.corr_key else self.eval_window
        if len(points) < 2 * w:
            return []
        means = window_rows(points, w)
        now = means[-1]
        # the moves: from the window where the reference was best (and did not overlap the last
        # one) to the last window; each beyond its noise and at least min_move x the signal's
        # size: its level then, or its spread across episodes where larger (a signal all but
        # constant has next to no noise, and a guard at 0.998 instead of 1.000 is no news)
        best = max(range(len(means) - w), key=lambda i: means[i][2])
        then, scale = means[best], (2 / w) ** 0.5  # scale: the noise of a difference of two window means, per unit of step-to-step noise
        rose = now[1] - then[1] > max(self.z * scale * noise([p[1] for p in points]), self.min_move * max(abs(then[1]), then[4], now[4]))
        fell = then[2] - now[2] > max(self.z * scale * noise([p[2] for p in points]), self.min_move * max(abs(then[2]), then[5], now[5]))
        corrs = [p[3] for p in points[-w:] if p[3] is not None]
        corr = sum(corrs) / len(corrs) if len(corrs) * 2 > w else None  # a mean over at least half the window
        diverged = (rose and fell) or (corr is not None and corr < self.corr_floor)
        if not diverged:
            self.healthy[ref.key] = True
            return []
        if not self.healthy[ref.key]:
            return []  # said already; quiet until they agree again
        self.healthy[ref.key] = False
        # it began after the reference's best window (the moves), or with the last window (the ranks)
        began = points[best + w][0] if rose and fell else points[-w][0]
        good = [c for c in self.checkpoints if c < began]
        return [Divergence(ref, step, began, (then[1], now[1]), (then[2], now[2]), corr, rose and fell, max(good) if good else None)]


HISTORY = 200
"""Points kept per reference: the step-to-step noise is measured over them."""


class RewardDiverged(RunFailed):
    """alarm.on_divergence=stop: the trained reward diverged from a reference; the run
    checkpointed and stopped with the alarm's line."""
