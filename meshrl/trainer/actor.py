"""The trainer mesh: one `TrainerActor` per Monarch proc, each one rank of an FSDP2/EP job.

The Monarch shell around `meshrl/trainer/policy.py`'s `PolicyTrainer` (the plain-PyTorch
rank):
- `TrainerActor`: inits torch.distributed from the elastic env, pins its cores, wraps a
  PolicyTrainer, pulls batches from the episode queue and publishes each new version.
- `TrainerMesh` / `spawn_trainer`: the controller's handle (spawn procs, elastic env,
  actors, setup; call endpoints with timeouts; stop everything on every exit path).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import secrets
import time

import torch
import torch.distributed as dist
from tensordict import TensorDict
from monarch.actor import Actor, endpoint, this_host

from meshrl.compat import tcp_store_listening_on
from meshrl.config import Config
from meshrl.episode import model_rows
from meshrl.errors import BatchTimeout, PolicyWentBack, QueueClosed, UserCodeError, find
from meshrl.futures import awaited, by_rank, stopped_on_failure
from meshrl.host import gloo_on_this_host, host_address
from meshrl.launch.allocation import with_env
from meshrl.launch.devices import DEVICE_ENV, PLAN_ENV, plan_devices
from meshrl.logs import capture_role_output
from meshrl.config.cpus import trainer_cpus
from meshrl.pinning import pin_this_process
from meshrl.trainer.policy import PolicyTrainer
from meshrl.trainer.snapshot import Snapshots, snapshot_budget, snapshot_inline, snapshot_root


class TrainerActor(Actor):
    """One trainer rank on a Monarch proc. Endpoints are async and run one at a time."""

    def __init__(self) -> None:
        self.trainer: PolicyTrainer | None = None
        self.publisher = None  # weight-sync Publisher, created on rank 0 when first asked
        self._objects = None  # the gloo group Python objects are broadcast over on GPUs (None: the default group)
        self.snapshots: Snapshots | None = None  # trainer.snapshot_every > 0: what a healed trainer restores
        self.durable = 0  # the newest version a healed trainer can restore (version 0: the seeded start)
        self.weights_id = secrets.token_hex(8)
        """Names the weights held now; a new one whenever they change (an update, a load). A version
        whose weights keep the last one's id (a step off trainer.pace) needs no load in an engine
        that holds them: it is relabelled (GeneratorActor.sync_weights)."""

    @endpoint
    async def setup(self, config_dict: dict) -> dict:
        """Init torch.distributed from the elastic env, build and shard the model."""
        config = Config.from_dict(config_dict)
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        capture_role_output(config, f"trainer-{rank}")
        use_cuda = config.trainer.device == "cuda" or (config.trainer.device == "auto" and torch.cuda.is_available())
        if use_cuda:
            # The device plan started this proc seeing its one GPU; without a plan (Monarch
            # never sets CUDA_VISIBLE_DEVICES) the local rank picks it.
            torch.cuda.set_device(0 if PLAN_ENV in os.environ else int(os.environ.get("LOCAL_RANK", 0)))
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
            # procs of one host share its cores: don't oversubscribe them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        cpus = trainer_cpus(config.trainer.cpus, config.launcher.kind, rank, int(os.environ.get("LOCAL_RANK", 0)))
        if cpus is not None:
            pin_this_process(cpus)  # also sizes torch's thread pool to the pinned cores
        # One trainer host: its groups listen on loopback, or on the address `meshrl worker`
        # named for this host (and set gloo's interface to). Across hosts: on MASTER_ADDR. The
        # process launcher's stand-in hosts are all this machine: loopback for them too.
        one_host = int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world or config.launcher.kind in ("local", "process", "torchx")
        with gloo_on_this_host() if one_host else contextlib.nullcontext():
            if world > 1 and not dist.is_initialized():
                init_process_group_listening_on(
                    (host_address() or "127.0.0.1") if one_host else os.environ["MASTER_ADDR"], rank, world, use_cuda, config.trainer.collective_timeout_s
                )
            self.trainer = PolicyTrainer(config, device, rank, world)
            # the batch travels to the other ranks pickled: through host memory, never the GPU
            # (NCCL's object broadcast would stage every step's batch in a CUDA tensor)
            # (a group's own timeout: torch's default for gloo is 30 minutes, whatever trainer.collective_timeout_s says)
            bound = datetime.timedelta(seconds=config.trainer.collective_timeout_s)
            self._objects = dist.new_group(backend="gloo", timeout=bound) if world > 1 and use_cuda else None
            if config.trainer.snapshot_every > 0:  # the background write's collectives on a group of their own
                group = dist.new_group(backend="gloo", timeout=bound) if world > 1 else None
                self.snapshots = Snapshots(
                    snapshot_root(config.logging.run_dir),
                    config.trainer.snapshot_every,
                    group,
                    blocking=not use_cuda,
                    budget=snapshot_budget(config),
                    inline=snapshot_inline(config),
                )
        if config.trainer.compile:
            self.trainer.warm_up()
        return self.trainer.shard_info()

    def _need(self) -> PolicyTrainer:
        if self.trainer is None:
            raise RuntimeError("TrainerActor.setup(config) must run first")
        return self.trainer

    # ---- the RL loop's step: pull a batch, train, publish the new version -------------------
    @endpoint
    async def weight_sync_key(self) -> str | None:
        """The publisher's key on the publishing rank (0), None elsewhere: the controller
        spawns its sidecar agent there and connects it to the generators."""
        trainer = self._need()
        if trainer.rank != 0:
            return None
        if self.publisher is None:
            from meshrl.weightsync.publisher import Publisher

            self.publisher = Publisher(trainer.config.weight_sync)
        return self.publisher.key

    @endpoint
    async def train_from_queue(self, queue, num_groups: int, timeout_s: float, critic=None, model: int = 0) -> dict:
        """Rank 0 samples a batch from the episode queue actor and, under PPO with a critic
        (`critic`: the CriticActor, trainer.loss.advantage=gae), has the critic write its
        per-token advantages into it, then shares it with the other ranks (the controller
        never touches the data); all ranks train; the new version is published into the
        weight-sync staging snapshot, then told to the queue (which admits new work for it).
        A trained model beside the policy (`model` > 0, a game's) takes the batch the policy's
        trainer took for the same version, and leaves the version to the policy's trainer;
        each trains on its own rows (`episode.model_rows`). Returns rank 0's metrics."""
        trainer = self._need()
        if trainer.config.trainer.loss.advantage == "gae" and critic is None:
            raise RuntimeError("trainer.loss.advantage=gae trains on a critic's advantages, and no critic was given")
        t0 = time.perf_counter()
        batch, critic_metrics, failed = None, {}, None
        if trainer.rank == 0:
            try:  # a failure here (no batch, the critic's) ends this step untrained on every rank: told them below
                if model:
                    batch = await queue.shared.call_one(trainer.step, timeout_s)
                else:
                    batch = await queue.sample.call_one(num_groups, trainer.step, timeout_s)
                groups = batch["group_id"].unique_consecutive().tolist()
                batch = model_rows(batch, model)
                if critic is not None:
                    critic_metrics = await self._critic_advantages(critic, batch, trainer)
            except Exception as e:  # noqa: BLE001 - raised below (the controller heals a dead critic)
                failed = e
        if trainer.world > 1:  # the other ranks raise rank 0's typed failure too, whichever the controller hears first
            told = next((e for kind in (BatchTimeout, PolicyWentBack, UserCodeError, QueueClosed) if (e := find(failed, kind))), None)
            box = [batch if failed is None else told]
            dist.broadcast_object_list(box, src=0, group=self._objects)
            batch = box[0]
        if failed is not None:
            raise failed
        if isinstance(batch, Exception):
            raise batch
        if batch is None:
            raise RuntimeError("rank 0 took no batch (its queue or critic call failed): this step is not trained")
        wait_s = time.perf_counter() - t0
        settled = self._settle_snapshot()  # the last step's, written while this batch was awaited
        out = self._train_step(batch, trainer.step)
        # never with held gradients (trainer.pace.accumulate), which no snapshot keeps: a heal retrains those steps,
        # from the last update's state (heal.replace_trainer), so nor on a held step that kept none (no rows of its own)
        pace = trainer.config.trainer.pace
        snapshot = self.snapshots is not None and self.snapshots.due(trainer.step) and not trainer.held and (not pace.accumulate or pace.updates(trainer.step))
        if snapshot:  # on GPUs staged to host memory here; written while the version is published and the next batch awaited
            self.snapshots.start(trainer.step, trainer.model, trainer.optimizer, trainer.scheduler)
            if self.snapshots.inline:  # written in this turn (colocated on CPU): complete before the version is announced
                settled = self._settle_snapshot() or settled
        t1 = time.perf_counter()
        copy_s = self._publish(trainer)
        publish_s = time.perf_counter() - t1
        durable = self.durable if self.snapshots is not None else trainer.step
        if trainer.rank == 0 and not model:  # the queue holds every batch taken since the newest complete snapshot
            await awaited(queue.set_version.call_one(trainer.step, durable))
        elif trainer.rank == 0:  # and, for a trained model beside the policy, each shared batch since its own
            await awaited(queue.set_partner_durable.call_one(model, durable))
        metrics = {f"trainer/{k}": v for k, v in out.items() if k != "version"}
        metrics.update(
            {
                "version": out["version"],
                "trainer/wait_s": wait_s,
                "trained_groups": groups if trainer.rank == 0 else [],
                "weights_id": self.weights_id,
                "sync/publish_s": publish_s,
                "sync/stage_copy_s": copy_s,
            }
        )
        if snapshot or settled:  # this step's staging; the wait for the last step's write, at this step's start
            metrics["trainer/snapshot_stage_s"] = self.snapshots.stage_s if snapshot else 0.0
            metrics["trainer/snapshot_wait_s"] = self.snapshots.wait_s if settled else 0.0
            metrics["trainer/snapshot_write_s"] = self.snapshots.write_s if settled else 0.0
            metrics["trainer/snapshot_spacing"] = self.snapshots.spacing
        metrics.update(critic_metrics)
        return metrics

    def _settle_snapshot(self) -> bool:
        """Complete the pending snapshot before anything changes the state it is written from
        (the next optimizer step, a restore, an offload); whether one was pending."""
        if self.snapshots is None or self.snapshots.finish() is None:
            return False
        self.durable = self.snapshots.complete
        return True

    @staticmethod
    async def _critic_advantages(critic, batch: TensorDict, trainer: PolicyTrainer) -> dict:
        """The critic's per-token advantages and loss mask written into `batch` (in place;
        during critic.policy_warmup only the mask: the policy trains on the group advantage);
        returns the critic's metrics, with `critic/gae_trained` saying which it was."""
        call = awaited(critic.advantages.call(batch, trainer.step))  # every critic rank values its share; rank 0 answers
        values = await asyncio.wait_for(call, trainer.config.critic.timeout_s)
        token_advantage, loss_mask, metrics = by_rank(values)[0]
        batch["loss_mask"] = loss_mask
        if token_advantage is not None:
            batch["token_advantage"] = token_advantage
        metrics["critic/gae_trained"] = float(token_advantage is not None)
        return metrics

    def _publish(self, trainer: PolicyTrainer) -> float:
        """The weights held now, under their version, to the publisher (rank 0); its staging copy's seconds.
        Gathering full tensors is collective: every rank walks the iterator to its end."""
        named = trainer.sync_state_dict(getattr(torch, trainer.config.model.dtype))
        if trainer.rank == 0 and self.publisher is not None:
            return self.publisher.publish(trainer.step, named, stream=True)  # the same names and shapes every version
        for _ in named:
            pass
        return 0.0

    @endpoint
    async def publish_current(self) -> int:
        """Publish the weights held now under their version (a healed trainer, restored, for
        the generators behind or ahead of it); returns the version."""
        trainer = self._need()
        self._publish(trainer)
        return trainer.step

    @endpoint
    async def set_lr(self, lr: float) -> None:
        """Change the learning rate from the next step on (the warm-up factor still applies)."""
        from meshrl.trainer.checkpoint import set_lr

        trainer = self._need()
        trainer.config.trainer.lr = lr
        set_lr(trainer.optimizer, trainer.scheduler, lr)

    @endpoint
    async def train_step(self, batch: TensorDict, current_version: int | None = None) -> dict:
        """One step on a batch the controller sends (benchmarks; the RL loop uses `train_from_queue`)."""
        return self._train_step(batch, current_version)

    def _train_step(self, batch: TensorDict, current_version: int | None) -> dict:
        """PolicyTrainer.train_step, with the weights renamed where it updated them."""
        out = self._need().train_step(batch, current_version)
        if out["updated"]:
            self.weights_id = secrets.token_hex(8)
        return out

    @endpoint
    async def export_hf(self, path: str, base_dir: str | None = None) -> str:
        return self._need().export_hf(path, base_dir=base_dir)

    @endpoint
    async def save_checkpoint(self, root: str) -> str:
        return self._need().save_checkpoint(root)

    @endpoint
    async def release_memory(self, offload_optimizer: bool) -> dict:
        self._settle_snapshot()
        return self._need().release_memory(offload_optimizer)

    @endpoint
    async def load_checkpoint(self, path: str) -> int:
        self._settle_snapshot()
        self.durable = self._need().load_checkpoint(path)
        self.weights_id = secrets.token_hex(8)
        return self.durable

    @endpoint
    async def shard_info(self) -> dict:
        """The rank's shard sizes, pid and host, and the devices it was started with (the plan's)."""
        import socket

        return {**self._need().shard_info(), "host": socket.gethostname(), "devices": [os.environ.get(DEVICE_ENV), os.environ.get(PLAN_ENV)]}

    @endpoint
    async def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerMesh:
    """The controller's handle on a trainer mesh. Every call has a timeout; `stop()` always."""

    def __init__(self, procs, actors, world: int, timeout_s: float = 600.0):
        self.procs, self.actors, self.world, self.timeout_s = procs, actors, world, timeout_s
        self.version = 0
        self._publisher = None

    async def _all(self, endpoint_, *args, timeout_s: float | None = None) -> list:
        values = await asyncio.wait_for(endpoint_.call(*args), timeout_s or self.timeout_s)
        return by_rank(values)

    async def train_step(self, batch: TensorDict, current_version: int | None = None) -> dict:
        out = (await self._all(self.actors.train_step, batch, current_version))[0]
        self.version = out["version"]
        return out

    async def train_from_queue(self, queue, num_groups: int, timeout_s: float, critic=None, model: int = 0) -> dict:
        """One step on a batch the trainer pulls from `queue` itself (and, with `critic`, has
        scored by that CriticActor; `model` > 0: a game's model beside the policy, on the
        policy's batch); returns rank 0's metrics."""
        out = (await self._all(self.actors.train_from_queue, queue, num_groups, timeout_s, critic, model, timeout_s=timeout_s + self.timeout_s))[0]
        self.version = out["version"]
        return out

    async def publisher_handle(self):
        """The weight-sync publisher's sidecar agent (rank 0's), spawned once from here."""
        if self._publisher is None:
            from meshrl.weightsync.connect import sidecars
            from meshrl.weightsync.publisher import publisher_agent

            keys = await asyncio.wait_for(self.actors.weight_sync_key.call(), self.timeout_s)
            (self._publisher,) = sidecars(self.procs, keys, publisher_agent)  # the one rank with a publisher
        return self._publisher

    async def set_lr(self, lr: float) -> None:
        await self._all(self.actors.set_lr, lr)

    async def export_hf(self, path: str, base_dir: str | None = None) -> str:
        return (await self._all(self.actors.export_hf, path, base_dir))[0]

    async def save_checkpoint(self, root: str) -> str:
        return (await self._all(self.actors.save_checkpoint, root))[0]

    async def release_memory(self, offload_optimizer: bool) -> dict:
        """Colocated on GPUs, before the engines wake: see PolicyTrainer.release_memory (rank 0's figures)."""
        return (await self._all(self.actors.release_memory, offload_optimizer))[0]

    async def load_checkpoint(self, path: str) -> int:
        self.version = (await self._all(self.actors.load_checkpoint, path))[0]
        return self.version

    async def publish_current(self) -> int:
        return (await self._all(self.actors.publish_current))[0]

    async def shard_info(self) -> list[dict]:
        return await self._all(self.actors.shard_info)

    async def answers(self, timeout_s: float = 10.0) -> bool:
        """Whether every rank answers a call within `timeout_s` (after a failed call, when its
        actors are idle): one that does not, on a host whose procs cannot be polled from
        here, is taken as lost."""
        try:
            await self._all(self.actors.shard_info, timeout_s=timeout_s)
            return True
        except Exception:  # noqa: BLE001 - dead, unreachable or wedged: all the same to a heal
            return False

    async def stop(self, teardown: bool = True) -> None:
        """Each rank's process group ended (`teardown`: not where a rank is known dead, whose share of the call
        Monarch may fail only at its delivery timeout), then the procs stopped."""
        try:
            if teardown:
                await asyncio.wait_for(self.actors.teardown.call(), 30)
        except Exception:
            pass  # the procs are stopped below either way
        await asyncio.wait_for(self.procs.stop(), 60)


def init_process_group_listening_on(host: str, rank: int, world: int, use_cuda: bool, timeout_s: float = 1800.0) -> None:
    """`init_process_group` from the elastic env, with rank 0's store listening on `host` only
    (`env://` would start a store that listens on every interface). `timeout_s`: the longest
    any collective waits (`trainer.collective_timeout_s`): NCCL's watchdog aborts past it."""
    from datetime import timedelta

    timeout, port = timedelta(seconds=timeout_s), int(os.environ["MASTER_PORT"])
    if rank == 0:
        store = tcp_store_listening_on(host, timeout, port)
    else:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout)


async def spawn_trainer(
    config: Config,
    timeout_s: float = 600.0,
    host_mesh=None,
    hosts: int = 1,
    *,
    plan=None,
    role: str = "trainer",
    actor_class: type[TrainerActor] = TrainerActor,
    mesh_class: type[TrainerMesh] = TrainerMesh,
) -> TrainerMesh:
    """Spawn the trainer procs, set up the elastic env, the actors and the sharded model.

    `host_mesh`: a Monarch host mesh from a launcher (default: this host) spanning `hosts`
    hosts; each gets `trainer.procs / hosts` procs, each started with its GPU from `plan` (the
    run's device plan; default: the config's, decided here; `role`: its slots there, `NAME/trainer`
    for a trained model beside the policy). The caller owns the returned mesh:
    `await mesh.stop()`. `actor_class` / `mesh_class`: subclasses to spawn and return
    instead (tests add inspection endpoints this way; the procs must be able to import
    `actor_class` by its module path).
    """
    from monarch.spmd import setup_torch_elastic_env_async

    n = config.trainer.procs
    if n % hosts:
        raise ValueError(f"trainer.procs={n} must be a multiple of the {hosts} trainer hosts")
    plan = plan or plan_devices(config)  # each rank starts seeing only its own GPU
    procs = (host_mesh or this_host()).spawn_procs(per_host={"procs": n // hosts}, bootstrap_command=with_env(plan.envs(role, list(range(n)))))
    async with stopped_on_failure(procs):
        await asyncio.wait_for(setup_torch_elastic_env_async(procs), 60)
        actors = procs.spawn("trainer", actor_class)
        mesh = mesh_class(procs, actors, n, timeout_s)
        await mesh._all(actors.setup, config.to_dict(), timeout_s=timeout_s)
        return mesh
