"""`GeneratorActor`: one vLLM generator replica on a Monarch proc mesh, serving requests.

Every endpoint but `setup` is concurrent: rollout workers' `generate` calls for all live
episodes run at once (vLLM batches them), and a weight update or a stats read never
queues behind them. The replica's `Generator` (service.py) orders updates and requests.

    gen = procs.spawn("generator0", GeneratorActor)
    await gen.setup.call_one(config.to_dict(), checkpoint_dir, version, replica)
    result = await gen.generate.call_one(token_ids, max_new_tokens, temperature, min_version)
    await gen.sync_weights.call_one(version)          # over weight sync, in update_mode
    await gen.shutdown_engine.call_one()

A distillation teacher is the same actor set up with `teacher=True` on the teacher's
checkpoint (pinned to distill.cpus, scoring at generator.temperature, never updated):

    await teacher.setup.call_one(config.to_dict(), config.distill.teacher, 0, 0, teacher=True)
    scores = await teacher.score_many.call_one([episode.token_ids, ...])
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import time

from monarch.actor import Actor, concurrent_endpoint, current_rank, endpoint

from meshrl.compat import endpoint_for_callers_that_may_die
from meshrl.config import Config
from meshrl.generator.engine import RequestResult
from meshrl.generator.service import Generator
from meshrl.host import started
from meshrl.logs import capture_role_output
from meshrl.config.cpus import cpus_for
from meshrl.pinning import pin_this_process, vllm_threads_bind


class GeneratorActor(Actor):
    """One generator replica: a vLLM engine, its policy version and its requests."""

    def __init__(self):
        self.generator: Generator | None = None
        self.subscriber = None  # weight-sync Subscriber, created when the loop connects
        try:  # vLLM's import, the longest part of a start, while the controller starts other roles
            import vllm.v1.engine.async_llm  # noqa: F401
        except Exception:  # noqa: BLE001 - `setup` imports it again and reports why it fails
            pass

    def _gen(self) -> Generator:
        if self.generator is None:
            raise RuntimeError("GeneratorActor.setup() has not been called")
        return self.generator

    @endpoint
    async def setup(self, config_dict: dict, checkpoint_dir: str, version: int = 0, replica: int | None = None, teacher: bool = False) -> dict:
        """Start the engine on `checkpoint_dir` as policy `version`; returns start-up info.
        `teacher`: a distillation teacher's scoring replica (see Generator), pinned to
        distill.cpus instead of generator.cpus."""
        if self.generator is not None:
            raise RuntimeError("GeneratorActor is already set up")
        config = Config.from_dict(config_dict)
        if replica is None:
            replica = current_rank().rank
        capture_role_output(config, f"{'teacher' if teacher else 'generator'}-{replica}")
        cpus = cpus_for(config.distill.cpus if teacher else config.generator.cpus, replica)
        if cpus is not None:
            # vLLM's engine-core process inherits the affinity; its CPU workers bind their
            # OpenMP threads to exactly these cores (one list per tensor-parallel worker).
            pin_this_process(cpus)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = vllm_threads_bind(cpus, config.generator.tp)
        generator = Generator(config, checkpoint_dir, replica, teacher=teacher)
        startup_s = await generator.start(version)
        # This process is vLLM's front-end: it makes Python objects for every decoded token.
        # A full collection then walks everything loaded so far (torch, vLLM, Monarch), about
        # 8% of decode time on one core, measured. Freezing the start-up heap leaves the
        # collector only what is made afterwards (as vLLM does in its engine core).
        gc.collect()
        gc.freeze()
        self.generator = generator
        return {"replica": replica, "startup_s": startup_s, "version": version, "processes": _process_tree()}

    @endpoint_for_callers_that_may_die
    async def generate(self, token_ids: list[int], max_new_tokens: int | None = None, temperature: float | None = None, min_version: int = 0) -> RequestResult:
        """One sample continuing `token_ids` (see Generator.generate). Its caller, a rollout
        worker, may be gone by the time it is answered: the answer is then dropped."""
        return await self._gen().generate(token_ids, max_new_tokens, temperature, min_version)

    @endpoint_for_callers_that_may_die
    async def generate_many(self, requests: list[tuple], call_id: str | None = None) -> list[RequestResult | str]:
        """Several independent samples in one call, each `(token_ids, max_new_tokens,
        temperature, min_version)` as for `generate`: the model turns a rollout worker's
        episodes asked for in the same instant (a group's first turns, notably), so that one
        message carries them instead of one each (see Generator.generate_many)."""
        return await self._gen().generate_many(requests, call_id)

    @endpoint_for_callers_that_may_die  # (a worker asks it as it stops)
    async def abort_many(self, call_id: str) -> bool:
        """Stop the generate_many or score_many call `call_id`, whose caller gave up on it (Generator.abort_many)."""
        return self._gen().abort_many(call_id)

    @endpoint_for_callers_that_may_die
    async def score_many(self, sequences: list[list[int]], call_id: str | None = None) -> list[list[float] | str]:
        """For each token-id sequence, the log-prob of each token given the ones before it
        (position 0: 0.0; see Generator.score), all scored at once (vLLM batches them). A
        sequence that fails comes back as its error text; the others are not affected. A replica
        that is stopping fails the call (ReplicaStopping): the caller asks another. `call_id`:
        the caller's name for the call, which `abort_many` stops (its caller timed out)."""
        return await self._gen().score_many(sequences, call_id)

    @concurrent_endpoint
    async def pause_generation(self) -> None:
        """Freeze generation (requests stay in place) until resume_generation."""
        await self._gen().pause()

    @concurrent_endpoint
    async def resume_generation(self) -> None:
        await self._gen().resume()

    @concurrent_endpoint
    async def sleep(self, keep_weights: bool = True) -> None:
        """placement=colocate: give the devices to the trainer until `wake` (see Generator.sleep)."""
        await self._gen().sleep(keep_weights)

    @concurrent_endpoint
    async def wake(self) -> None:
        await self._gen().wake()

    @concurrent_endpoint
    async def version(self) -> int:
        return self._gen().version

    @concurrent_endpoint
    async def stats(self) -> dict:
        return {**self._gen().stats(), "pid": os.getpid()}

    # ---- weight sync ----------------------------------------------------------------------
    @concurrent_endpoint
    async def weight_sync_key(self) -> str:
        """This replica's weight-sync subscriber, by the key its sidecar agent finds it by
        (the controller spawns the agent: meshrl.weightsync.subscriber.subscriber_agent)."""
        if self.subscriber is None:
            from meshrl.weightsync.subscriber import Subscriber

            # shared memory: the fetched tensors are handed on to vLLM's engine-core process;
            # a collective group's ranks are the engine's workers themselves (on their GPUs)
            gen = self._gen()
            self.subscriber = Subscriber(gen.config.weight_sync, shared_memory=True, engine=gen.engine)
        return self.subscriber.key

    @concurrent_endpoint
    async def sync_weights(self, version: int, weights_id: str | None = None) -> dict:
        """Fetch policy `version` (or newer) over weight sync and apply it in the configured
        update mode; returns the version now running and the seconds spent. `weights_id`: the
        trainer's name of that version's weights; an engine holding them already is relabelled
        instead, nothing fetched or loaded (a version made by a step off trainer.pace)."""
        if self.subscriber is None:
            raise RuntimeError("weight sync is not connected: call weight_sync_key and connect first")
        t0 = time.monotonic()
        if weights_id is not None and await self._gen().relabel(version, weights_id):
            return {"version": version, "fetch_s": 0.0, "held_s": 0.0, "relabelled": True}
        connection = self.subscriber.connections
        try:
            return await self._sync(version, t0, weights_id)
        except Exception:
            if self.subscriber.connections == connection:
                raise
        # Reconnected under this call (a healed trainer's new publisher): what it took from
        # the old receivers is gone. Once more, from the new ones, when they have joined:
        # whatever they hold (the restored version), not `version`, which the healed trainer
        # makes only after training again; the wait for it would hold this replica's later updates.
        deadline = time.monotonic() + self.subscriber.cfg.timeout_s
        while self.subscriber.connecting and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return await self._sync(None, t0, None)

    @functools.cached_property
    def _sync_lock(self) -> asyncio.Lock:
        return asyncio.Lock()

    async def _sync(self, version: int | None, t0: float, weights_id: str | None) -> dict:
        # One fetch-load-release at a time: a retry after a reconnect can meet the heal's own
        # update of this replica, and a second fetch released the first's shm lease (or handed
        # its receive buffer back) while that one was still loading from it: torn weights.
        async with self._sync_lock:
            return await self._sync_once(version, t0, weights_id)

    async def _sync_once(self, version: int | None, t0: float, weights_id: str | None) -> dict:
        # The name goes with the bytes only where they are surely the ones it names: `version`
        # itself (not a newer one), just transferred from the trainer connected now (not what
        # the subscriber held: after a heal, a dead trainer's), and not read from files (a dead
        # trainer's, or an earlier run's, may be left in the directory).
        fresh = version is not None and self.subscriber.version < version and getattr(self.subscriber.spec, "transport", None) != "files"
        got, tensors = await self.subscriber.fetch(version=version)
        fetch_s = time.monotonic() - t0
        try:
            held_s = await self._gen().update_weights(got, tensors, weights_id=weights_id if fresh and got == version else None)
        finally:
            await self.subscriber.loaded()  # shm: the trainer's slot is free again
        return {"version": got, "fetch_s": fetch_s, "held_s": held_s}

    @concurrent_endpoint
    async def shutdown_engine(self) -> None:
        """End every request and shut the vLLM engine down (its processes exit)."""
        if self.generator is None:
            return
        try:
            await self.generator.stop(10.0)
            await self.generator.release_sigterm()
        finally:
            self.generator.shutdown()
            self.generator = None


def _process_tree() -> dict:
    """This proc and the engine processes vLLM started under it, as (pid, start time) on this
    host: if this proc is killed, its engine processes are orphaned, and the replica
    manager uses this list to stop them."""
    import socket

    import psutil

    me = psutil.Process()
    return {"host": socket.gethostname(), "pids": [(p.pid, started(p)) for p in [me, *me.children(recursive=True)]]}
