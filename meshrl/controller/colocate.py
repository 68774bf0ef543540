"""placement=colocate: the generators and the trainer take turns on the same devices.

Before the trainer's call the batch is completed and the generators sleep (`sleep_for_trainer`);
after it the trainer frees its memory (colocated on GPUs), the engines load the new version
where they load it asleep, and wake (`after_step`).
Trained models beside the policy (`config.models`) share the same devices: every model's
engines sleep and wake together, and the trainers step in turn, the policy's first, each
freeing its memory before the next (`release`), so each step has the devices to itself. Each
trainer frees it too before its engines first start, which size their KV cache by what is free.
A trainer healed outside the step (the policy's or a trained model's) is restored with the
engines asleep too (`asleep_while`).
"""

from __future__ import annotations

import asyncio
import time

from meshrl.config import Config
from meshrl.errors import BatchTimeout
from meshrl.futures import awaited
from meshrl.launch.memory import plan_memory


def wakes_on_new_version(config: Config, plan) -> bool:
    """placement=colocate: each version is loaded while the engines sleep, and they wake
    on it (on GPU they drop their weights when they sleep, instead of copying them to
    host memory and back). Always on GPUs: one step off would pay that round trip every
    step to gain nothing, since loading pauses the engine anyway. On CPU with max_lag >= 1
    (one step off) the engines wake on the weights they hold and the new version loads
    while they generate."""
    return config.placement == "colocate" and (config.buffer.max_lag == 0 or plan.layout == "colocated")


async def sleep_for_trainer(config: Config, plan, queue, pools: list, watching, t0: float) -> dict[str, float]:
    """Before the trainer's call (the previous weight loads done, since `t0`): the batch
    complete (nothing more is admitted until the trainer's next version), then every
    generator pool in `pools` asleep, their devices the trainers' until `wake_for_generators`.
    `watching` is the loop's wait that replaces dead replicas and workers meanwhile."""
    out = {}
    ready = await watching(asyncio.ensure_future(awaited(queue.wait_ready.call_one(config.batch_groups, config.buffer.get_timeout_s))))
    if not ready:  # the loop's line for it (rollouts not arriving); the trainer would have waited as long again beside awake engines
        raise BatchTimeout(f"no complete batch of {config.batch_groups} groups within buffer.get_timeout_s={config.buffer.get_timeout_s:g}s")
    out["colocate/generate_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    await asyncio.gather(*(pool.sleep(keep_weights=not wakes_on_new_version(config, plan)) for pool in pools))
    out["colocate/sleep_s"] = time.monotonic() - t0
    return out


def offloads_optimizer(config: Config, plan) -> bool:
    """Colocated on GPUs, whether a trainer that frees its memory for the engines also moves
    AdamW's state to host memory: where the memory plan needs it, or `trainer.offload_optimizer=always`."""
    memory = plan_memory(config, plan=plan) if plan.layout == "colocated" else None
    return memory is not None and memory.offload_optimizer or config.trainer.offload_optimizer == "always"


async def release(plan, trainer, offload_optimizer: bool) -> dict[str, float]:
    """After a trainer's step, where the GPU is shared: its memory freed for the next trainer
    (a trained model's, in turn) or for the engines."""
    return await trainer.release_memory(offload_optimizer) if plan.layout == "colocated" else {}


async def wake_for_generators(plan, trainer, pools: list, offload_optimizer: bool) -> dict[str, float]:
    """After the trainers' calls: the policy `trainer`'s memory freed where the GPU is shared
    (None: freed already, before the trained models' turns), then every pool's engines awake."""
    out = await release(plan, trainer, offload_optimizer) if trainer is not None else {}
    t0 = time.monotonic()
    await asyncio.gather(*(pool.wake() for pool in pools))
    out["colocate/wake_s"] = time.monotonic() - t0
    return out


async def after_step(loop, weights_id) -> dict[str, float]:
    """placement=colocate, after the trainers' calls: the policy trainer's memory freed (with
    trained models: freed already, before their turns), the new versions loaded where the
    engines load asleep (`wakes_on_new_version`), then every engine awake. Freed before the
    load, which gives the engines their weights back: the trainer's step and the engines'
    weights never share the GPU."""
    c, plan, out = loop.config, loop.alloc.plan, {}
    if c.placement != "colocate":
        return out
    if not loop.partners:
        out.update(await release(plan, loop.trainer, loop._offload_optimizer))
    if wakes_on_new_version(c, plan):
        out["colocate/load_s"] = await loop._update_generators(loop.version, weights_id)
        out.update(await load_models(loop.partners))
    return {**out, **await wake_for_generators(plan, None, loop._pools(), loop._offload_optimizer)}


async def models_in_turn(plan, trainer, partners: list, train, offload_optimizer: bool) -> dict[str, float]:
    """After the policy `trainer`'s step: its memory freed, then each trained model's step
    (`train(model)`, on the policy's batch) in turn, each freeing its memory after it."""
    out = await release(plan, trainer, offload_optimizer)
    for p in partners:
        out.update(await train(p))
        out.update({f"{p.name}/{k}": v for k, v in (await release(plan, p.trainer, offload_optimizer)).items()})
    return out


async def settle_updates(loop, but=None, policy: bool = True) -> dict[str, float]:
    """The weight loads under way done, the policy's (unless `policy` is False) and each trained
    model's (one step off, in the background since the last step), but the model `but`'s: its
    trainer died, and its heal cancels its load, which would wait on the dead trainer (the
    policy's likewise when its trainer died). Their seconds, by name."""
    out = {"sync/previous_update_s": await loop._finish_update()} if policy and loop._update_task is not None else {}
    for p in loop.partners:
        if p is not but:
            out[f"{p.name}/sync/previous_update_s"] = await p.finish_update()
    return out


async def asleep_while(loop, partner, heal) -> None:
    """A trainer that died in a call outside the step (a checkpoint, an export) is restored
    as a step trains, its restore never beside awake engines: the weight loads under way done
    (none wakes an engine's weights meanwhile, but the dead trainer's own, which the heal
    cancels), every engine asleep keeping its weights, then the heal (`heal`: a trained
    model's `heal_outside_step`, which trains the steps it lost; `partner` None: the policy's,
    which starts the load of its restored version), its memory freed and its version loaded
    into its engines, then every engine awake."""
    t0 = time.monotonic()
    await settle_updates(loop, but=partner, policy=partner is not None)
    pools = loop._pools()
    await asyncio.gather(*(pool.sleep(keep_weights=True) for pool in pools))
    try:
        await heal
        await release(loop.alloc.plan, loop.trainer if partner is None else partner.trainer, loop._offload_optimizer)
        if partner is not None:
            await load_models([partner])
        elif loop._update_task is not None:
            await loop._finish_update()
    finally:
        await asyncio.gather(*(pool.wake() for pool in pools))
    (loop.healer.pending_metrics if partner is None else partner.pending)["colocate/heal_asleep_s"] = time.monotonic() - t0


async def load_models(partners: list) -> dict[str, float]:
    """Each trained model's version, the one its trainer holds, loaded into its generators
    while they sleep (after a step, or after the policy's heal)."""
    for p in partners:
        p.update(p.trainer.version)
    return {f"{p.name}/colocate/load_s": await p.finish_update() for p in partners}
