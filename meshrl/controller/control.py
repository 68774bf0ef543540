"""The Session's calls between steps (meshrl/api.py): sample from the current policy, pause
and resume generation, change knobs, scale the generators. Each takes the started `RLLoop`
and runs on its event loop; the training loop itself never calls them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import numbers
import os

from meshrl.futures import awaited


async def generate_text(loop, prompts: list[str], temperature: float | None = None) -> list[list[str]]:
    """A group of completions (generator.group_size) per prompt text, from the current
    policy on replica 0. Refused while generation is paused (it would wait for `resume`)."""
    from meshrl.tokenizer import load_tokenizer, prompt_ids, reply_text

    if loop.generators.paused:
        raise RuntimeError("generation is paused: call resume() first (a paused replica serves no request)")

    tok = load_tokenizer(loop.tokenizer_dir)
    gen, version = loop.generators.replicas[0].actor, loop.version  # the step's weights: its update may still be on its way
    n = loop.config.generator.group_size

    async def one(text: str) -> str:
        out = await awaited(gen.generate.call_one(prompt_ids(tok, text), None, temperature, version))
        return reply_text(tok, out.token_ids)

    return [list(await asyncio.gather(*(one(t) for _ in range(n)))) for t in prompts]


async def wait_for_generators(loop) -> None:
    """Until every replica runs the trainer's current version: each step starts the update to
    its new version (the policy's, each trained model's), so waiting for those is enough.
    Shielded, and left for the next step to finish: a Session call cut short by its bound
    leaves the updates going (cancelling them would leave replicas behind, to be replaced)."""
    ended = await asyncio.shield(
        asyncio.gather(*(t for t in (loop._update_task, *(p.pending_update for p in loop.partners)) if t is not None), return_exceptions=True)
    )
    loop._update_task = None  # all ended, a failure said here: no step waits for them again
    for p in loop.partners:
        p.forget_update()
    for result in ended:
        if isinstance(result, BaseException):
            raise result


async def pause_generation(loop) -> None:
    loop.generators.paused = True
    try:
        await asyncio.gather(*(awaited(r.actor.pause_generation.call_one()) for r in loop.generators.replicas))
    except BaseException:  # (a dead replica, the Session's bound) not paused: the rest go on, and the flag says so
        with contextlib.suppress(Exception):
            await resume_generation(loop)
        loop.generators.paused = False
        raise


async def resume_generation(loop) -> None:
    try:
        await asyncio.gather(*(awaited(r.actor.resume_generation.call_one()) for r in loop.generators.replicas))
    finally:  # a dead replica's failure: the live ones resumed, and the next health check replaces it
        loop.generators.paused = False


async def set_knobs(loop, lr: float | None = None, max_lag: int | None = None) -> None:
    """Change the learning rate (the policy's) or the staleness bound (admission follows it)
    between steps; both are checked before either changes, and kept for a resume (`remember`)."""
    if lr is not None and not (isinstance(lr, numbers.Real) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite positive number, got {lr!r}")
    if max_lag is not None and not (isinstance(max_lag, numbers.Integral) and not isinstance(max_lag, bool) and max_lag >= 0):
        raise ValueError(f"max_lag must be a whole number at least 0, got {max_lag!r}")  # (1.7 was taken as 1)
    max_lag = None if max_lag is None else int(max_lag)  # numpy's, as a notebook computes them: plain for the YAML
    if max_lag and loop.config.buffer.depth == 0 and loop.config.placement != "colocate":  # kept on-policy: said, not recorded
        raise ValueError(f"max_lag={max_lag} does nothing in a synchronous run (buffer.depth=0); resume it with buffer.depth above 0 to go asynchronous")
    previous = loop.config.trainer.lr
    if lr is not None:  # each kept as soon as it holds: a failure of the other leaves it the run's
        await loop.trainer.set_lr(float(lr))
        loop.config.trainer.lr = float(lr)
        remember(loop.run_dir, float(lr), None, previous)
    if max_lag is not None:
        await awaited(loop.queue.set_max_lag.call_one(max_lag))
        loop.config.buffer.max_lag = max_lag
        remember(loop.run_dir, None, max_lag, previous)


def remember(run_dir: str, lr: float | None, max_lag: int | None, previous_lr: float, replicas: int | None = None) -> None:
    """Knobs changed between steps (and a rescale's replicas) are the run's from then on: RUN_DIR/config.yaml, which
    `meshrl run --resume` reads (a checkpoint restores the trainer's state, then the
    configured learning rate), says so. The knob is the policy's: a trained model beside it
    that took the run's rate keeps the one it had (`models[i].trainer.lr`)."""
    from meshrl.config.loading import dump_yaml, load_yaml
    from meshrl.trainer.checkpoint import write_atomic

    path = os.path.join(run_dir, "config.yaml")
    data = load_yaml(path)
    if lr is not None:
        data.setdefault("trainer", {})["lr"] = lr
        for entry in data.get("models") or []:
            if not entry.get("frozen") and "lr" not in (entry.get("trainer") or {}):
                entry["trainer"] = {**(entry.get("trainer") or {}), "lr": previous_lr}
    if max_lag is not None:
        data.setdefault("buffer", {})["max_lag"] = max_lag
    if replicas is not None:
        data.setdefault("generator", {})["replicas"] = replicas
    write_atomic(path, dump_yaml(data))


async def scale_generators(loop, replicas: int) -> None:
    """Add or remove generator replicas; groups on a removed replica are played again."""
    await loop.generators.scale(replicas, loop.version)
    loop.config.generator.replicas = replicas
    remember(loop.run_dir, None, None, loop.config.trainer.lr, replicas=replicas)  # a resume starts as many
