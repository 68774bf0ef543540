"""Sampling policies: which of the READY groups a batch takes (`buffer.sampling`)."""

from __future__ import annotations

import importlib
import random
from typing import Callable, Sequence

from tensordict import TensorDict

SamplingPolicy = Callable[[Sequence[TensorDict], int, random.Random], list[int]]
"""A plain callable choosing which `n` of the READY groups (oldest first) a batch takes."""


def fifo(groups: Sequence[TensorDict], n: int, rng: random.Random) -> list[int]:
    """The oldest `n` groups."""
    return list(range(n))


def uniform(groups: Sequence[TensorDict], n: int, rng: random.Random) -> list[int]:
    """`n` groups uniformly at random, without replacement."""
    return sorted(rng.sample(range(len(groups)), n))


def resolve_policy(name: str) -> SamplingPolicy:
    if name in ("fifo", "random"):
        return fifo if name == "fifo" else uniform
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)
