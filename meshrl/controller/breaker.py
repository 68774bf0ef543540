"""What the controller does when a run goes wrong: the failure breaker, when episodes fail
(docs/contracts.md), and the cliff alarm's console lines (meshrl/stability.py watches).

The breaker: a warning line when more than contracts.warn_failed_frac of a step's episodes failed (once
per distinct failure, at most MAX_FAILURE_WARNINGS in a run), and a stop (a checkpoint,
then EpisodesFailed) when every episode of contracts.stop_after_failed_steps steps in a
row failed. A step in which no episode finished counts neither way.
"""

from __future__ import annotations

import logging
import re

from meshrl.config import Config
from meshrl.errors import EpisodesFailed

log = logging.getLogger("meshrl")
MAX_FAILURE_WARNINGS = 5
"""Distinct episode failures shown on the console in one run; later ones are in the metrics and logs."""


class FailureBreaker:
    def __init__(self, config: Config):
        self.contracts = config.contracts
        self.failed_steps = 0  # consecutive steps in which every episode failed
        self.warned: set[str] = set()  # failures already shown on the console

    def tripped(self, version: int, row: dict) -> str | None:
        """Take step `version`'s metrics row: warn where due; the first failure's line when
        the run must stop, else None."""
        k = self.contracts
        # every model's episodes (a game's other models as NAME/episode/...): a game may fail before the policy speaks
        count, failed = (sum(v for key, v in row.items() if key == f"episode/{what}" or key.endswith(f"/episode/{what}")) for what in ("count", "failed"))
        if count <= 0:
            return None
        first = row.get("episode/first_failure") or "(no reason reported)"
        if failed > k.warn_failed_frac * count:
            key = re.sub(r"\d+", "#", first.split(": ", 1)[-1])  # the same failure from another worker or record
            if key not in self.warned and len(self.warned) < MAX_FAILURE_WARNINGS:
                self.warned.add(key)
                log.warning("step %d: %d of %d episodes failed; the first: %s", version, failed, count, first)
        self.failed_steps = self.failed_steps + 1 if failed >= count else 0
        if k.stop_after_failed_steps and self.failed_steps >= k.stop_after_failed_steps:
            return first
        return None

    def stopped(self, first: str, version: int, resume: str) -> EpisodesFailed:
        """The error that stops the run, once it checkpointed (`resume`: how to go on from there)."""
        return EpisodesFailed(f"every episode of the last {self.failed_steps} steps failed; the first of step {version}: {first}; fix it, then {resume}")


def report_divergence(watch, rows: list[dict], row: dict, recorded: dict) -> list[str]:
    """The divergence alarm (meshrl/stability.py's DivergenceWatch) on `rows` (the history's new
    ones): each line logged and marked as `alarm/divergence` in the step's row and its
    `recorded` history row; the lines."""
    lines = [d.line() for r in rows for d in watch.update(int(r["step"]), r)]
    for line in lines:
        row["alarm/divergence"] = recorded["alarm/divergence"] = 1.0
        log.warning("%s", line)
    return lines


def report_cliffs(watch, version: int, row: dict, recorded: dict, alarm) -> None:
    """The run-level alarm (meshrl/stability.py's CliffWatch, config `alarm`): one console
    line per cliff at step `version`, marked in its row and in the `recorded` history row."""
    for cliff in watch.update(version, row):
        row[cliff.key] = recorded[cliff.key] = 1.0
        log.warning("%s", cliff.line(alarm.window, alarm.reward_drop))
