"""The replay buffer actor on a real local Monarch proc mesh, fed by producers in another mesh."""

import asyncio
import time

import pytest
from monarch.actor import Actor, endpoint, this_host

from meshrl.buffer import ReplayBufferActor
from meshrl.config import BufferConfig
from tests.test_buffer import check_batch, make_group


class Producer(Actor):
    """Puts `count` groups into the buffer actor, recording how long each put waited."""

    @endpoint
    async def produce(self, buffer, rank_offset: int, count: int, n: int) -> list[float]:
        waits = []
        for i in range(count):
            t0 = time.monotonic()
            await buffer.put.call_one(make_group(rank_offset + i, n, [0, 0]), 30.0)
            waits.append(time.monotonic() - t0)
        return waits


async def _wait(future):
    return await future


@pytest.mark.timeout(120)
def test_buffer_actor_with_producer_mesh():
    async def main():
        buffer_procs = this_host().spawn_procs(per_host={"procs": 1})
        producer_procs = this_host().spawn_procs(per_host={"procs": 2})
        try:
            cfg = BufferConfig(depth=1, max_lag=0)
            buffer = buffer_procs.spawn("buffer", ReplayBufferActor, cfg.__dict__, 2)
            producers = producer_procs.spawn("producers", Producer)
            # Each producer rank puts 3 groups of 2: 6 groups into a buffer of 2 -> backpressure.
            # Monarch futures start when awaited: run the producers as tasks.
            p0 = asyncio.create_task(_wait(producers.slice(procs=0).produce.call_one(buffer, 0, 3, 2)))
            p1 = asyncio.create_task(_wait(producers.slice(procs=1).produce.call_one(buffer, 100, 3, 2)))
            deadline = time.monotonic() + 60  # first calls into fresh procs import torch: slow on 2 cores
            while await buffer.num_groups.call_one() < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.5)
            assert await buffer.num_groups.call_one() == 2  # full, producers held back
            sizes = {g: 2 for g in [0, 1, 2, 100, 101, 102]}
            seen = []
            for _ in range(3):
                batch = await buffer.sample.call_one(2, 0, 30.0)
                check_batch(batch, sizes, 0, 0)
                seen += batch["group_id"].unique().tolist()
            assert sorted(seen) == sorted(sizes)
            waits = (await p0) + (await p1)
            assert max(waits) > 1.0, "some put must have waited for room"
            # state survives a round trip through the actor
            await buffer.put.call_one(make_group(7, 3, [0]), 5.0)
            state = await buffer.state_dict.call_one()
            other = buffer_procs.spawn("buffer2", ReplayBufferActor, cfg.__dict__, 2)
            await other.load_state_dict.call_one(state)
            again = await other.sample.call_one(1, 0, 5.0)
            assert again["group_id"].tolist() == [7, 7, 7]
            metrics = await buffer.metrics.call_one()
            assert metrics["buffer/puts"] == 7 and metrics["buffer/producer_wait_s"] > 1.0
        finally:
            await producer_procs.stop()
            await buffer_procs.stop()

    asyncio.run(main())
