"""The episode queue on a proc mesh: `EpisodeQueueActor`, the Monarch shell around
`meshrl/queue/buffer.py`'s `EpisodeQueue`."""

from __future__ import annotations

import asyncio
import traceback

from monarch.actor import Actor, concurrent_endpoint
from tensordict import TensorDict

from meshrl.compat import endpoint_for_callers_that_may_die
from meshrl.config import Config
from meshrl.errors import UserCodeError, describe
from meshrl.logs import capture_role_output, role_log
from meshrl.pinning import place_light_process
from meshrl.queue.buffer import Claim, EpisodeQueue


class EpisodeQueueActor(Actor):
    """Serves an EpisodeQueue. Every endpoint is concurrent and blocking waits run off the
    event loop, so a worker waiting for admission never holds up the trainer's sample; the
    endpoints workers and trainers call outlive a caller that dies while its call is answered."""

    def __init__(self, config: dict):
        config = Config.from_dict(config)
        capture_role_output(config, "queue")
        place_light_process(config)
        try:
            self._queue, self.failure = EpisodeQueue(config), None
        except Exception as e:  # noqa: BLE001 - a bad data source: every call answers its one line, no supervision trace
            traceback.print_exc()  # to this role's log
            self._queue, self.failure = None, describe(e, "queue", role_log(config, "queue"))

    @property
    def queue(self) -> EpisodeQueue:
        if self._queue is None:
            raise UserCodeError(self.failure)
        return self._queue

    @endpoint_for_callers_that_may_die
    async def claim(self, worker: int, timeout: float, request: int | None = None) -> Claim | None:
        return await asyncio.to_thread(self.queue.claim, worker, timeout, request)

    @endpoint_for_callers_that_may_die
    async def abandon(self, worker: int, request: int) -> None:
        self.queue.abandon(worker, request)

    @endpoint_for_callers_that_may_die
    async def put(self, group_id: int, group: TensorDict, token: int | None = None) -> bool:
        return self.queue.put(group_id, group, token)

    @endpoint_for_callers_that_may_die  # a worker that dies as it is answered
    async def requeue(self, worker: int | None = None, group_ids: list[int] | None = None, failure: str | None = None, token: int | None = None) -> int:
        return self.queue.requeue(worker, group_ids, failure, token)

    @endpoint_for_callers_that_may_die  # a trainer killed while it waits is healed: the queue outlives its answer
    async def sample(self, num_groups: int, current_version: int, timeout: float | None = None) -> TensorDict:
        return await asyncio.to_thread(self.queue.sample, num_groups, current_version, timeout)

    @endpoint_for_callers_that_may_die
    async def shared(self, version: int, timeout: float | None = None) -> TensorDict:
        return await asyncio.to_thread(self.queue.shared, version, timeout)

    @concurrent_endpoint
    async def wait_ready(self, num_groups: int, timeout: float) -> bool:
        return await asyncio.to_thread(self.queue.wait_ready, num_groups, timeout)

    @endpoint_for_callers_that_may_die  # a trainer killed in its step is healed
    async def set_version(self, version: int, durable: int | None = None) -> None:
        self.queue.set_version(version, durable)

    @endpoint_for_callers_that_may_die  # a trainer killed in its step is healed
    async def set_partner_durable(self, model: int, durable: int) -> None:
        self.queue.set_partner_durable(model, durable)

    @concurrent_endpoint
    async def retake(self, version: int) -> list[int]:
        return self.queue.retake(version)

    @concurrent_endpoint
    async def set_max_lag(self, max_lag: int | None) -> None:
        self.queue.set_max_lag(max_lag)

    @concurrent_endpoint
    async def metrics(self) -> dict[str, float]:
        return self.queue.metrics()

    @concurrent_endpoint
    async def state_dict(self) -> dict:
        return self.queue.state_dict()

    @concurrent_endpoint
    async def load_state_dict(self, state: dict) -> str | None:
        return self.queue.load_state_dict(state)

    @concurrent_endpoint
    async def close(self) -> None:
        self.queue.close()
