"""placement=colocate: the generators and the trainer take turns on the same devices.

Before the trainer's call the batch is completed and the generators sleep (`sleep_for_trainer`);
after it the trainer frees its memory (colocated on GPUs) and the engines wake (`wake_for_generators`).
"""

from __future__ import annotations

import asyncio
import time

from meshrl.compat import awaited
from meshrl.config import Config


def wakes_on_new_version(config: Config, plan) -> bool:
    """placement=colocate: each version is loaded while the engines sleep, and they wake
    on it (on GPU they drop their weights when they sleep, instead of copying them to
    host memory and back). Always on GPUs: one step off would pay that round trip every
    step to gain nothing, since loading pauses the engine anyway. On CPU with max_lag >= 1
    (one step off) the engines wake on the weights they hold and the new version loads
    while they generate."""
    return config.placement == "colocate" and (config.buffer.max_lag == 0 or plan.layout == "colocated")


async def sleep_for_trainer(config: Config, plan, queue, generators, watching, t0: float) -> dict[str, float]:
    """Before the trainer's call (the previous weight load done, since `t0`): the batch
    complete (nothing more is admitted until the trainer's next version), then the
    generators asleep, their devices the trainer's until `wake_for_generators`. `watching`
    is the loop's wait that replaces dead replicas and workers meanwhile."""
    out = {}
    ready = await watching(asyncio.ensure_future(awaited(queue.wait_ready.call_one(config.batch_groups, config.buffer.get_timeout_s))))
    if not ready:  # the trainer's own wait reports it, with the queue's counts
        return out
    out["colocate/generate_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    await generators.sleep(keep_weights=not wakes_on_new_version(config, plan))
    out["colocate/sleep_s"] = time.monotonic() - t0
    return out


async def wake_for_generators(plan, trainer, generators, offload_optimizer: bool) -> dict[str, float]:
    """After the trainer's call: its memory freed where the GPU is shared, then the engines awake."""
    out = {}
    if plan.layout == "colocated":  # the GPU is the trainer's until the engines wake
        out.update(await trainer.release_memory(offload_optimizer))
    t0 = time.monotonic()
    await generators.wake()
    out["colocate/wake_s"] = time.monotonic() - t0
    return out
