"""The models beside the policy (`config.models`, docs/coevolve.md): each its own stack.

    model NAME:  trainer mesh (its config view: config.for_model(NAME))  --publish v-->
                 weight sync --> its generator replicas <-- the rollout workers' turns of NAME

A game (meshrl/rollout/game.py) says which model speaks each turn; the rollout workers send
each turn to that model's replicas and pack every thread as a row tagged with its model.
Every step the policy's trainer samples the batch and each model here trains on the same
batch at once (colocated: in turn, controller/colocate.py), on its own rows, on its own procs
(trainer/actor.py `train_from_queue`; a step off its `trainer.pace` keeps its weights), so
all the models are at the same version after each step and the queue's admission and
staleness bound hold for each model's tokens against its own version.

Each model's generators are healed as the policy's are (`check`), and so is its trainer: a
dead trainer proc is replaced on the same slots and restored from its newest complete state
(its per-step snapshot under models/NAME/snapshots, or its last checkpoint), then retrains
the steps it lost from the batches the queue keeps for it (`EpisodeQueue.shared`: the last
two, and every one since its newest restorable version), so it rejoins the policy's version
within the step.
Its checkpoint is written and restored with the policy's (controller/checkpoint.py).

A frozen model (`served_pools`) is its generator replicas alone, on its own checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from meshrl.config import Config
from meshrl.controller import checkpoint as checkpoints, colocate
from meshrl.controller.heal import critic_healed, lost_a_proc, replace_trainer, restore_critic, trainer_pids
from meshrl.controller.replicas import GeneratorPool
from meshrl.errors import PolicyWentBack, TrainerFailed, find, first_line
from meshrl.futures import settled, unless_lost
from meshrl.host import proc_alive, procs_dead
from meshrl.logs import console
from meshrl.launch.devices import weights_on_gpu
from meshrl.trainer.actor import TrainerMesh, spawn_trainer
from meshrl.trainer.critic_actor import CriticMesh, spawn_critic
from meshrl.weightsync.connect import WeightSync

log = logging.getLogger("meshrl")


def served_pools(config: Config, alloc, rewire) -> dict[str, GeneratorPool]:
    """Each frozen model's generator replicas (`models[i].frozen`): its checkpoint at version 0,
    never updated, healed as any pool's (`check(0)`); `rewire(handles, model index)` tells the
    workers of a replacement."""
    pools = {}
    for index in sorted(config.frozen_models()):
        name = config.model_names()[index]
        view = config.for_model(name)
        pool = GeneratorPool(view, alloc, view.model.path, 0, None, model=name, frozen=True)
        pool.on_change = lambda pool=pool, index=index: rewire(pool.handles(), index)
        pools[name] = pool
    return pools


async def lost_partner(partners: list, error: BaseException):
    """The first of `partners` (TrainedModels) whose trainer on another host `error` lost (`lost_remote`), or None."""
    for p in partners:
        if await p.lost_remote(error):
            return p
    return None


class TrainedModel:
    """One trained model beside the policy: trainer mesh, generator pool and weight sync."""

    def __init__(self, config: Config, name: str, alloc, workers_changed, offload_optimizer: bool = False):
        self.run_config = config
        self.offload_optimizer = offload_optimizer  # colocated on GPUs: the run's (colocate.offloads_optimizer)
        self.name = name
        self.index = config.model_names().index(name)
        self.config = config.for_model(name)
        self.alloc = alloc
        self.workers_changed = workers_changed  # async (handles, model index): the workers follow a replacement
        self.trainer: TrainerMesh | None = None
        self.critic: CriticMesh | None = None  # PPO's critic of its own, where it trains by gae
        self.generators: GeneratorPool | None = None
        self.weight_sync: WeightSync | None = None
        self._update: asyncio.Task | None = None
        self.pids: list = []  # its trainer's (pid, start time) per rank, to tell a dead one
        self.restarts = 0
        self.critic_restarts = 0
        self.start_version = 0
        self.pending: dict[str, float] = {}  # a heal's metrics, for the next row
        self.weights: tuple[int, str | None] = (-1, None)  # (version, its trainer's weights_id) of its last step

    async def start(self, version: int, checkpoint_dir: str | None = None, critic_dir: str | None = None) -> None:
        """Its trainer (`start_trainer`), then its generators and weight sync between them (`start_generators`)."""
        await self.start_trainer(version, checkpoint_dir, critic_dir)
        await self.start_generators()

    async def start_trainer(self, version: int, checkpoint_dir: str | None = None, critic_dir: str | None = None) -> None:
        """Its trainer (from its model section, or from `checkpoint_dir`: a resumed run's
        checkpoint, at the policy's `version`), its critic where it trains by gae (from its
        weights, or `critic_dir` beside `checkpoint_dir`), and an export for its generators to
        start from; their procs spawned meanwhile (they import vLLM)."""
        c = self.config
        os.makedirs(c.logging.run_dir, exist_ok=True)
        # its generators' procs now: they import vLLM while its trainer starts, set up once it has exported
        self.generators = GeneratorPool(c, self.alloc, None, version, self._rewire, model=self.name)
        self.generators.warm(c.generator.replicas)
        self.trainer = await spawn_trainer(
            c,
            c.trainer.collective_timeout_s,
            host_mesh=self.alloc.host_mesh("trainer"),
            hosts=self.alloc.hosts("trainer"),
            plan=self.alloc.plan,
            role=f"{self.name}/trainer",
        )
        if checkpoint_dir is not None:
            restored = await self.trainer.load_checkpoint(checkpoint_dir)
            if restored != version:
                raise RuntimeError(f"trained model {self.name}'s checkpoint is at version {restored}, the policy's at {version}")
        self.pids, self.start_version = await trainer_pids(self.trainer), version
        if c.trainer.loss.advantage == "gae":  # its critic, on its trainer's first host, from its own weights or its checkpoint
            self.critic = await spawn_critic(c, self.alloc.host("trainer", 0), self.alloc.bootstrap(f"{self.name}/critic", list(range(c.critic.procs))))
            if checkpoint_dir is not None:
                if critic_dir is None:
                    raise RuntimeError(f"trained model {self.name} trains by gae, and the checkpoint holds no critic of its own")
                await self.critic.load_checkpoint(critic_dir)
        await self.trainer.publisher_handle()  # created before its first step, as the policy's
        # under LoRA its adapters' frozen base goes to its own models/NAME/hf/base
        initial = await self.trainer.export_hf(checkpoints.start_export(c.logging.run_dir, version), checkpoints.lora_base_dir(c.logging.run_dir))
        await colocate.release(self.alloc.plan, self.trainer, self.offload_optimizer)  # before its engines start
        self.generators.checkpoint_dir = initial
        self.generators.source_lost = self.trainer_dead  # an update cut off by its dead trainer keeps the replica

    async def start_generators(self) -> None:
        """Its generators, from its trainer's export, and weight sync from its trainer to them."""
        c = self.config
        await self.generators.start(c.generator.replicas)
        on_gpu = weights_on_gpu(self.alloc.plan.view(self.name), c.weight_sync.transport)
        publisher = await self.trainer.publisher_handle()
        self.weight_sync = await WeightSync(c.weight_sync, self.alloc.controller_address(), on_gpu).connect(publisher, self.generators.subscribers())

    def handles(self) -> list:
        return self.generators.handles()

    async def _rewire(self) -> None:
        """After one of its replicas was replaced: weight sync and the workers follow."""
        if self.weight_sync is not None:
            await self.weight_sync.reconnect(subscribers=self.generators.subscribers())
        await self.workers_changed(self.handles(), self.index)

    def trainer_dead(self) -> bool:
        return procs_dead(self.pids)

    async def train(self, queue, num_groups: int, timeout_s: float, version: int) -> dict:
        """Its step on the policy's batch of `version` (to version + 1), its own rows; metrics
        under `NAME/`. A dead trainer proc is healed, and the restored trainer retrains each
        step it lost on that step's batch until it is at version + 1. Where the policy's heal
        took it back to an older version, the model is ahead: it trained the batches the policy
        trains again already (the same batches: the queue keeps them), and waits
        (`NAME/trainer/ahead` 1, and no metric of a step of its own)."""
        if self.trainer.version > version:
            return self._waits(version)
        t0 = time.monotonic()
        while True:
            try:
                critic = self.critic.actor if self.critic is not None else None
                out = await unless_lost(self.trainer.train_from_queue(queue, num_groups, timeout_s, critic, self.index), self.trainer_dead)
            except Exception as e:  # noqa: BLE001 - a dead proc is healed; anything else ends the run resumably
                if find(e, PolicyWentBack) is not None and self.trainer.version >= version:  # (split: it waited at once)
                    return self._waits(version)
                await self.heal(e, version)
                continue
            if out["version"] > version:
                break
            self.weights = (out["version"], out.get("weights_id"))
            self._follow(out["version"])  # a lost step trained again: the next batch's turns may wait for its version
        out.update(self.pending)
        self.pending = {}
        out["trainer/restarts"] = float(self.restarts)
        if self.critic is not None:
            out["critic/restarts"] = float(self.critic_restarts)
        out["time/trainer_call_s"] = time.monotonic() - t0
        out["generator/replicas_replaced"] = float(self.generators.replaced)
        version = out.pop("version")
        out.pop("trained_groups", None)
        self.weights = (version, out.pop("weights_id", None))
        return {"version": version, **{f"{self.name}/{k}": v for k, v in out.items()}}

    def _follow(self, version: int) -> None:
        """Its generators to `version`, made by a step it trained again after a heal (split;
        colocated, its engines sleep through the heal and load its trainer's version as they wake)."""
        if self.config.placement != "colocate":
            self.update(version)

    def _waits(self, version: int) -> dict:
        """Its row of a step it waits through, ahead of the policy (`train`)."""
        ahead, self.pending = {**self.pending, "trainer/ahead": 1.0, "trainer/restarts": float(self.restarts)}, {}
        return {"version": version + 1, **{f"{self.name}/{k}": v for k, v in ahead.items()}}

    async def heal_outside_step(self, error: BaseException, queue, num_groups: int, timeout_s: float, version: int) -> None:
        """Its trainer died in a call outside the step (a checkpoint, an export) while the
        policy is at `version`: heal it, then train it back up to `version` on the batches it
        lost (the queue keeps them), so that what is saved or exported next is at the policy's."""
        restored = await self.heal(error, version)
        if restored < version:
            healed = self.pending  # the heal's metrics, for the next step's row (train would take them)
            await self.train(queue, num_groups, timeout_s, version - 1)
            self._follow(version)
            self.pending = healed

    async def heal(self, error: BaseException, version: int) -> int:
        """Replace its dead trainer mesh and restore it (controller/heal.py's `replace_trainer`),
        bounded by its trainer.max_restarts and restart_timeout_s; TrainerFailed with one line
        when it may not or cannot. Returns the version it was restored at."""
        c, run_dir = self.config, self.run_config.logging.run_dir
        first = first_line(str(error)) or type(error).__name__
        dead = [rank for rank, (pid, started) in enumerate(self.pids) if not proc_alive(pid, started)]
        failed = f"trained model {self.name}'s trainer failed at version {version}"
        if not dead and self.critic is not None and not await self.critic.answers():  # its critic's proc died
            return await self._heal_critic(error, version)
        if not dead and await self.lost_remote(error):  # on another host: Monarch reports a proc lost, and it does not answer
            dead = [rank for rank, (_, started) in enumerate(self.pids) if started is None]
        who = ", ".join(f"rank {r} (pid {self.pids[r][0]})" for r in dead)
        if not dead:  # it raised, alive: a new mesh would raise again
            raise TrainerFailed(f"{failed} ({type(error).__name__}: {first}); {checkpoints.how_to_resume(run_dir)}") from error
        if self.restarts >= c.trainer.max_restarts:
            raise TrainerFailed(
                f"{failed} ({first}); not healed: trainer.max_restarts={c.trainer.max_restarts} used; {checkpoints.how_to_resume(run_dir)}"
            ) from error
        self.restarts += 1
        self.weights = (-1, None)  # a new trainer's weights: loaded in full
        t0 = time.monotonic()
        if self._update is not None:  # reading from the dead publisher
            self._update.cancel()
            await asyncio.gather(self._update, return_exceptions=True)
            self._update = None
        saved = os.path.join(run_dir, "checkpoints", "models", self.name)
        try:
            self.trainer, restored = await asyncio.wait_for(
                replace_trainer(
                    c, self.alloc, self.trainer, self.pids, c.logging.run_dir, self.start_version, saved, at_most=version, role=f"{self.name}/trainer"
                ),
                c.trainer.restart_timeout_s,
            )
            self.pids = await trainer_pids(self.trainer)
            if self.critic is not None:  # back to the trainer's version with it: no batch trains it twice
                critic_at = await self._restore_critic(restored, respawn=not await self.critic.answers())
                self.pending["critic/steps_lost"] = float(max(0, restored - critic_at))  # steps behind its model it came back
            # connected first: configuring a publisher for GPU staging drops what host memory held
            self.weight_sync = await self.weight_sync.reconnect(publisher=await self.trainer.publisher_handle())
            await self.trainer.publish_current()
        except Exception as e:  # noqa: BLE001 - the heal itself failed: stop, resumably
            raise TrainerFailed(
                f"{failed} ({first}) and could not be restarted ({type(e).__name__}: {first_line(str(e), 200)}); {checkpoints.how_to_resume(run_dir)}"
            ) from e
        if c.placement != "colocate":  # colocated, its engines sleep: loaded once the step is done (colocate.load_models)
            self.update(restored)  # a generator behind it (its update cut off) catches up
        took, lost = time.monotonic() - t0, max(0, version - restored)
        self.pending.update({"trainer/restart_s": took, "trainer/steps_lost": float(lost)})
        print(
            f"meshrl: trained model {self.name}'s trainer {who} died at version {version} ({first_line(first, 160)}); "
            f"healed in {took:.1f}s from version {restored} ({lost} step(s) to train again; restart {self.restarts} of {c.trainer.max_restarts})",
            file=console(),
        )
        return restored

    async def _restore_critic(self, version: int, respawn: bool) -> int:
        saved = os.path.join(self.run_config.logging.run_dir, "checkpoints", "models", f"{self.name}-critic")
        self.critic, restored = await restore_critic(self.config, self.alloc, self.critic, saved, version, self.start_version, respawn, f"{self.name}/critic")
        return restored

    async def _heal_critic(self, error: BaseException, version: int) -> int:
        """Its critic's proc died at `version`: new procs, restored to the critic's newest
        state at or below it (heal.py's `critic_healed`, bounded as its trainer's heal); a
        failed step is then trained again on the same batch (the queue keeps it). Returns
        its trainer's version."""
        c, run_dir = self.config, self.run_config.logging.run_dir
        first = first_line(str(error)) or type(error).__name__
        what = f"trained model {self.name}'s critic (pid {self.critic.pid}) stopped answering at version {version} ({first})"
        restored, took = await critic_healed(c, run_dir, what, self.critic_restarts, lambda: self._restore_critic(version, respawn=True), error)
        self.critic_restarts += 1
        lost = max(0, version - restored)
        self.pending.update({"critic/restart_s": took, "critic/steps_lost": float(lost)})
        print(
            f"meshrl: {first_line(what, 200)}; healed in {took:.1f}s from critic version {restored} "
            f"({lost} critic step(s) lost; restart {self.critic_restarts} of {c.trainer.max_restarts})",
            file=console(),
        )
        return version

    def dead(self) -> bool:
        """Whether a proc of its trainer or of its critic on this host is gone."""
        return self.trainer_dead() or (self.critic is not None and procs_dead(self.critic.proc_ids))

    async def lost_remote(self, error: BaseException) -> bool:
        """Whether its trainer, with procs on another host, is what `error` lost: Monarch
        reports a proc lost (`heal.lost_a_proc`), and the trainer does not answer. (The policy's
        trainer, or the queue, may be the one lost.)"""
        return not procs_dead(self.pids) and lost_a_proc(self.pids, error) and not await self.trainer.answers()

    def export_dir(self, run_dir: str) -> str:
        """Where its final export goes: RUN_DIR/hf/final-NAME."""
        return os.path.join(run_dir, "hf", f"final-{self.name}")

    async def export(self, run_dir: str, tokenizer_dir: str) -> None:
        """hf/final-NAME, and its critic's hf/final-NAME-critic where it has one."""
        await checkpoints.export_hf(self.trainer, self.export_dir(run_dir), self.config.logging.run_dir, tokenizer_dir)
        if self.critic is not None:
            await checkpoints.export_critic(self.critic, run_dir, tokenizer_dir, f"final-{self.name}-critic")

    def update(self, version: int) -> None:
        """Move its generators to `version` in the background (after the previous move):
        relabelled where `version`'s weights are those they hold (its trainer's step held them)."""
        previous = self._update
        weights_id = self.weights[1] if self.weights[0] == version else None

        async def move() -> float:
            if previous is not None:
                await previous
            t0 = time.monotonic()
            await self.generators.update(version, weights_id)
            return time.monotonic() - t0

        self._update = asyncio.create_task(move())

    @property
    def pending_update(self) -> asyncio.Task | None:
        """Its generators' move to its newest version (`update`), until awaited or forgotten."""
        return self._update

    def forget_update(self) -> None:
        """Its move ended and its outcome was said by whoever awaited it (`control.wait_for_generators`)."""
        self._update = None

    async def finish_update(self) -> float:
        task, self._update = self._update, None
        return await task if task is not None else 0.0

    async def check(self, version: int) -> None:
        await self.generators.check(version)

    async def save_checkpoint(self, root: str) -> str:
        return await self.trainer.save_checkpoint(os.path.join(root, self.name))

    def cancel_update(self) -> None:
        if self._update is not None:
            self._update.cancel()

    async def shutdown(self, stop_s: float = 60.0, engines: bool = True) -> None:
        self.cancel_update()
        if self.generators is not None:
            await self.generators.shutdown(stop_s, engines)
        if self.trainer is not None:  # best effort on every exit path, bounded as the policy's; no teardown call to a dead proc
            await settled(self.trainer.stop(teardown=not self.trainer_dead()), 120)
        if self.critic is not None:
            await settled(self.critic.stop(), 120)
        if self.weight_sync is not None:
            self.weight_sync.close()
