"""One step's metrics row, collected from the trainer's answer, the episode queue, the
rollout workers and the generator replicas (meshrl/metrics.py writes the rows; this file
only gathers them, hence its own name).

Generator stats are read in the background, right after the previous step: a replica is
busy applying the weight update just sent to it, and waiting for its answer at the step's
end would put that on the trainer's critical path every step.
"""

from __future__ import annotations

import asyncio
import time

from meshrl.futures import bounded


class StepMetrics:
    """Collects each step's row; made when the run has started (the first step's wall time
    counts from then)."""

    def __init__(self, queue, generators, workers, scorers=None):
        self.queue, self.generators, self.workers, self.scorers = queue, generators, workers, scorers
        self.last_step_end = time.monotonic()
        self.snapshot: asyncio.Task | None = None  # the generators' stats, read after the previous step

    async def row(self, out: dict) -> dict[str, float]:
        """The step's row from the trainer's answer `out` and everything else read now."""
        now = time.monotonic()
        wall = now - self.last_step_end
        self.last_step_end = now
        row = {k: float(v) for k, v in out.items() if isinstance(v, (int, float))}
        row["trained_groups"] = out.get("trained_groups", [])  # kept in history, not in metrics.jsonl
        row["time/step_s"] = wall
        row["time/controller_s"] = max(0.0, wall - out.get("time/trainer_call_s", wall))  # the step's time outside the trainer's call
        row["trainer/idle_frac"] = min(1.0, out.get("trainer/wait_s", 0.0) / max(wall, 1e-9))
        snapshot = self.snapshot or asyncio.create_task(self.generators.read_stats())
        self.snapshot = None
        queue_metrics, worker_metrics, stats_read = await asyncio.gather(
            bounded(self.queue.metrics.call_one(), 60, "the episode queue, its metrics"), self.workers.metrics(), snapshot
        )
        row.update(queue_metrics)
        row.update(worker_metrics)
        idle, tokens, seconds, versions = [], 0.0, 0.0, []
        for r, at, stats in stats_read:
            if stats is None or r not in self.generators.replicas:
                continue
            versions.append(stats.get("version", 0))
            prev, r.last_stats = r.last_stats, stats
            window, r.last_stats_at = (at - r.last_stats_at if r.last_stats_at is not None else wall), at
            busy = stats.get("busy_s", 0.0) - prev.get("busy_s", 0.0)
            idle.append(1.0 - min(1.0, busy / max(window, 1e-9)))
            tokens += stats.get("tokens_generated", 0) - prev.get("tokens_generated", 0)
            seconds = max(seconds, window)
        if idle:
            row["generator/idle_frac"] = sum(idle) / len(idle)
            row["generator/version"] = float(min(versions))  # the oldest replica's weights, read after the previous step
        row["generator/tokens_per_s"] = tokens / max(seconds or wall, 1e-9)
        row["generator/replicas_replaced"] = float(self.generators.replaced)
        if self.scorers is not None:
            row["scoring/replicas_replaced"] = float(self.scorers.replaced)
        self.snapshot = asyncio.create_task(self.generators.read_stats())  # for the next step
        return row

    def cancel(self) -> None:
        if self.snapshot is not None:
            self.snapshot.cancel()
