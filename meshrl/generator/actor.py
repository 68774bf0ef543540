"""`GeneratorActor`: one vLLM generator replica on a Monarch proc mesh.

Monarch runs an actor's endpoints one at a time, so nothing here waits inside an endpoint
for long except `generate` (one-shot, for tests and the REPL) and the updates: continuous
generation runs as a background asyncio task started by `start_generation`, and every
other endpoint (updates, pause, stats, stop) stays responsive while it runs.

    gens = procs.spawn("generators", GeneratorActor)
    await gens.setup.call(config.to_dict(), checkpoint_dir, 0)
    await gens.start_generation.call(source, buffer)   # source.next_prompt(), buffer.put_completions()
    ...
    await gens.stop_generation.call()
    await gens.shutdown_engine.call()
"""

from __future__ import annotations

import asyncio
import gc
import os
import time

import torch
from monarch.actor import Actor, concurrent_endpoint, current_rank, endpoint

from meshrl.config import Config
from meshrl.generator.loop import Generator
from meshrl.placement import cpus_for, pin_this_process, vllm_threads_bind
from meshrl.rollout import Completion, Prompt

PROMPT_TIMEOUT_S = 120.0
"""Longest one `source.next_prompt()` call may take."""
PROMPT_POLL_S = 1.0
"""How long the source holds one `next_prompt` call before answering None (then re-asked)."""


class GeneratorActor(Actor):
    """One generator replica: a vLLM engine, its policy version and its generation loop."""

    def __init__(self):
        self.generator: Generator | None = None
        self.subscriber = None  # weight-sync Subscriber, created when the loop connects

    def _gen(self) -> Generator:
        if self.generator is None:
            raise RuntimeError("GeneratorActor.setup() has not been called")
        return self.generator

    @endpoint
    async def setup(self, config_dict: dict, checkpoint_dir: str, version: int = 0, replica: int | None = None) -> dict:
        """Start the engine on `checkpoint_dir` as policy `version`; returns start-up info."""
        if self.generator is not None:
            raise RuntimeError("GeneratorActor is already set up")
        config = Config.from_dict(config_dict)
        if replica is None:
            replica = current_rank().rank
        cpus = cpus_for(config.generator.cpus, replica)
        if cpus is not None:
            # vLLM's engine-core process inherits the affinity; its CPU workers bind their
            # OpenMP threads to exactly these cores (one list per tensor-parallel worker).
            pin_this_process(cpus)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = vllm_threads_bind(cpus, config.generator.tp)
        generator = Generator(config, checkpoint_dir, replica)
        startup_s = await generator.start(version)
        # This process is vLLM's front-end: it makes Python objects for every decoded token.
        # A full collection then walks everything loaded so far (torch, vLLM, Monarch), about
        # 0.3 s on one core every few hundred steps: 8% of decode time, measured. Freezing
        # the start-up heap leaves the collector only what is made afterwards (as vLLM does
        # in its engine core).
        gc.collect()
        gc.freeze()
        self.generator = generator
        return {"replica": replica, "startup_s": startup_s, "version": version, "processes": _process_tree()}

    @endpoint
    async def generate(
        self, prompts: list[Prompt], temperature: float | None = None, max_new_tokens: int | None = None
    ) -> list[Completion]:
        """One-shot generation of every prompt's group (blocks this actor's other endpoints)."""
        return await self._gen().generate(prompts, temperature, max_new_tokens)

    @endpoint
    async def start_generation(self, source, sink) -> None:
        """Continuous generation in the background until stopped.

        `source.next_prompt(poll_s, replica)` returns a Prompt, or None when it has none to
        give within poll_s (asked again); `sink.put_completions(list)` takes
        each finished group and may block (backpressure) without holding up other groups.
        """
        gen = self._gen()
        put_timeout = gen.config.buffer.put_timeout_s + 60.0

        async def next_prompt() -> Prompt | None:
            # None: nothing now (the trainer is too far behind, or the source is closed).
            return await asyncio.wait_for(_awaited(source.next_prompt.call_one(PROMPT_POLL_S, gen.replica)), PROMPT_TIMEOUT_S)

        async def put(completions: list[Completion]) -> None:
            await asyncio.wait_for(_awaited(sink.put_completions.call_one(completions)), put_timeout)

        gen.start_loop(next_prompt, put)

    @endpoint
    async def pause_generation(self) -> None:
        """Freeze generation (requests stay in place) until resume_generation."""
        await self._gen().pause()

    @endpoint
    async def resume_generation(self) -> None:
        await self._gen().resume()

    @endpoint
    async def stop_generation(self, timeout_s: float = 30.0) -> dict:
        """Stop the background loop (in-flight groups are aborted and dropped); returns stats."""
        await self._gen().stop(timeout_s)
        return self._gen().stats()

    @endpoint
    async def version(self) -> int:
        return self._gen().version

    # Concurrent: read-only, so it need not queue behind a weight update (a sequential
    # endpoint). The proc is busy during an update all the same, so the controller reads
    # stats off its critical path (RLLoop._collect_metrics).
    @concurrent_endpoint
    async def stats(self) -> dict:
        return {**self._gen().stats(), "pid": os.getpid()}

    # ---- weight sync ----------------------------------------------------------------------
    @endpoint
    async def weight_sync_handle(self):
        """This replica's weight-sync subscriber handle (see meshrl.weightsync)."""
        if self.subscriber is None:
            from meshrl.weightsync import Subscriber

            # shared memory: the fetched tensors are handed on to vLLM's engine-core process
            self.subscriber = Subscriber(self._gen().config.weight_sync, shared_memory=True)
        return self.subscriber.handle

    @endpoint
    async def sync_weights(self, version: int) -> dict:
        """Fetch policy `version` (or newer) over weight sync and apply it in the configured
        update mode; returns the version now running and the seconds spent."""
        if self.subscriber is None:
            raise RuntimeError("weight sync is not connected: call weight_sync_handle and connect first")
        t0 = time.monotonic()
        got, tensors = await self.subscriber.fetch(version=version)
        fetch_s = time.monotonic() - t0
        held_s = await self.update_weights(got, tensors)
        return {"version": got, "fetch_s": fetch_s, "held_s": held_s}

    @endpoint
    async def load_weights(self, version: int, tensors: dict[str, torch.Tensor], mode: str | None = None) -> float:
        """Endpoint form of `update_weights` (tensors travel in the message: small models, tests)."""
        return await self.update_weights(version, tensors, mode)

    @endpoint
    async def load_weights_from_files_fallback(self, version: int, checkpoint_dir: str, mode: str | None = None) -> float:
        """Named fallback: reload from a safetensors directory on disk as `version`."""
        return await self._gen().update_weights_from_files_fallback(version, checkpoint_dir, mode)

    @endpoint
    async def weights_checksum(self) -> float:
        return await self._gen().engine.weights_checksum()

    @endpoint
    async def shutdown_engine(self) -> None:
        """Stop the loop if running and shut the vLLM engine down (its processes exit)."""
        if self.generator is None:
            return
        try:
            if self.generator.loop_running:
                await self.generator.stop(10.0)
        finally:
            self.generator.shutdown()
            self.generator = None

    async def update_weights(self, version: int, tensors: dict[str, torch.Tensor], mode: str | None = None) -> float:
        """Apply full, unsharded, HF-named tensors as policy `version` (local call, e.g. from a
        weight-sync subscriber in this process); `mode` overrides generator.update_mode.
        Returns the seconds generation was held."""
        return await self._gen().update_weights(version, tensors, mode)


def _process_tree() -> dict:
    """This proc and the engine processes vLLM started under it, as (pid, start time) on this
    host: if this proc is killed, its engine processes are orphaned, and the controller
    uses this list to stop them."""
    import socket

    import psutil

    me = psutil.Process()
    return {"host": socket.gethostname(), "pids": [(p.pid, p.create_time()) for p in [me, *me.children(recursive=True)]]}


async def _awaited(future):
    """Monarch futures start when awaited; wrap one in a coroutine for asyncio.wait_for."""
    return await future
