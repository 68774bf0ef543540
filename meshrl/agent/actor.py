"""A rollout worker on a proc mesh: `RolloutWorkerActor`, the Monarch shell around
`worker.py`'s `RolloutWorker`. `start(queue, generators)` runs it in the background."""

from __future__ import annotations

import os
import traceback

from monarch.actor import Actor, concurrent_endpoint, endpoint

from meshrl.agent.worker import RolloutWorker
from meshrl.config import Config
from meshrl.errors import UserCodeError, describe
from meshrl.host import started
from meshrl.logs import capture_role_output, role_log
from meshrl.pinning import place_light_process


class RolloutWorkerActor(Actor):
    """A rollout worker on a proc mesh: `start(queue, generators)` runs it in the background."""

    def __init__(self, config: dict, tokenizer_dir: str, worker: int, reward_fn=None):
        config = Config.from_dict(config)
        capture_role_output(config, f"worker-{worker}")
        place_light_process(config)
        try:
            self._worker, self.failure = RolloutWorker(config, tokenizer_dir, worker, reward_fn), None
        except Exception as e:  # noqa: BLE001 - the user's env or reward failed to load: `start` answers its one line
            traceback.print_exc()  # to this role's log
            self._worker, self.failure = None, describe(e, f"worker-{worker}", role_log(config, f"worker-{worker}"))

    @property
    def worker(self) -> RolloutWorker:
        if self._worker is None:
            raise UserCodeError(self.failure)
        return self._worker

    @endpoint
    async def start(self, queue, generators: list, teacher=None, scorers: dict | None = None, partners: list | None = None) -> dict:
        """Start playing; returns {"host", "pids": [(pid, start time)]} of this proc (the
        controller watches it). `partners`: the generators of each trained model beside the
        policy (config.models' order), for games."""
        import socket

        self.worker.set_generators(generators)
        for i, handles in enumerate(partners or []):
            self.worker.set_generators(handles, i + 1)
        self.worker.teacher = teacher
        self.worker.scorers.set_replicas(scorers or {})
        self.worker.start(queue)
        return {"host": socket.gethostname(), "pids": [(os.getpid(), started())]}

    @concurrent_endpoint
    async def set_generators(self, generators: list, model: int = 0) -> None:
        self.worker.set_generators(generators, model)

    @concurrent_endpoint
    async def set_teacher(self, teacher) -> None:
        self.worker.teacher = teacher

    @concurrent_endpoint
    async def set_scorers(self, scorers: dict) -> None:
        """The scorer replicas, {scoring.scorers index: [actor, ...]} (after a replacement)."""
        self.worker.scorers.set_replicas(scorers)

    @concurrent_endpoint
    async def evaluate(self, records: list[dict], version: int, k: int) -> list[dict]:
        return await self.worker.evaluate(records, version, k)

    @concurrent_endpoint
    async def health(self) -> str | None:
        """The last error of the claim loop, or None (the controller asks, to see the proc lives)."""
        return self.worker.error

    @concurrent_endpoint
    async def metrics(self) -> dict:
        w = self.worker
        return {
            "episodes": w.metrics(),
            "failed_total": w.failed_total,
            "requeued_total": w.requeued_total,
            "error": w.error,
            "first_failure": w.take_first_failure(),
        }

    @concurrent_endpoint
    async def stop_rollouts(self, timeout_s: float = 30.0) -> None:
        await self.worker.stop(timeout_s)
