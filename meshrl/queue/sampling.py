"""Sampling policies: which of the READY groups a batch takes (`buffer.sampling`), and the
queue's helpers around a batch: the check of a put group, the straggler wait."""

from __future__ import annotations

import importlib
import random
from collections import deque
from typing import Callable, Sequence

from tensordict import TensorDict

from meshrl.episode import PAD_VERSION

SamplingPolicy = Callable[[Sequence[TensorDict], int, random.Random], list[int]]
"""A plain callable choosing which `n` of the READY groups (oldest first, `insert_oldest_first`) a batch takes."""


def oldest_version(group: TensorDict) -> int:
    """The oldest policy version among a group's model tokens (masked ones too: the staleness
    bound masks the oldest first); -1 for a group with none (every episode failed before its
    first turn), which has nothing to wait for."""
    versions = group["versions"][group["versions"] != PAD_VERSION]
    return int(versions.min()) if versions.numel() else -1


def insert_oldest_first(ready: deque, group: TensorDict) -> None:
    """Put a finished group in READY, which is kept oldest first: by the oldest version among its
    model tokens (`oldest_version`), then by arrival. A group claimed earlier that finished later (long replies) is
    not overtaken by the later claims that finished before it, so it is trained before the
    staleness bound would mask or drop it, and `fifo` does not train long replies less often."""
    age, i = oldest_version(group), len(ready)
    while i > 0 and oldest_version(ready[i - 1]) > age:
        i -= 1
    ready.insert(i, group)


def fifo(groups: Sequence[TensorDict], n: int, rng: random.Random) -> list[int]:
    """The oldest `n` groups: the nearest their staleness bound."""
    return list(range(n))


def uniform(groups: Sequence[TensorDict], n: int, rng: random.Random) -> list[int]:
    """`n` groups uniformly at random, without replacement."""
    return sorted(rng.sample(range(len(groups)), n))


def resolve_policy(name: str) -> SamplingPolicy:
    if name in ("fifo", "random"):
        return fifo if name == "fifo" else uniform
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def straggler_wait(asked_at: float, ready_at: list[float]) -> float:
    """The part of the trainer's wait for a batch spent after half of its groups were READY:
    time lost to the batch's longest episodes. Zero when the batch was complete before the
    trainer asked (async at its best); the last group minus the median one when the trainer
    waited for the whole batch to be generated (sync)."""
    if not ready_at:
        return 0.0
    times = sorted(ready_at)
    half = times[(len(times) - 1) // 2]
    return max(0.0, times[-1] - max(asked_at, half))


def check_one_group(group: TensorDict, group_id: int) -> None:
    gids = group["group_id"]
    if gids.numel() == 0 or not bool((gids == group_id).all()):
        raise ValueError(f"a put takes one whole group: every row with group_id {group_id}")
