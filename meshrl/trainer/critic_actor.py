"""PPO's critic on a proc mesh of its own: `CriticActor`, the Monarch shell around
`meshrl/trainer/critic.py`'s `CriticTrainer` (one rank per proc; `critic.procs` > 1: FSDP2
over them), and `CriticMesh` / `spawn_critic`, the controller's handle on it. Every call
goes to every rank, whose collectives run in step; rank 0 answers.

The trainer's rank 0 calls `advantages` with each batch it samples from the episode queue
(trainer/actor.py `train_from_queue`; the controller never touches the data):

    advantages(batch s):  finish the critic's train step on batch s-1 (usually done already)
                          values of batch s under that critic (version v = s-1 batches trained)
                          GAE -> per-token advantages, the loss mask   --> back to the trainer
                          start the critic's train step on batch s, on its own thread

so the critic trains on batch s while the policy does, each on its own proc, and the
critic's step is off the policy's path unless it takes longer than the policy's step plus
the wait for the next batch. A batch is always scored by the critic that trained on every
batch before it: `critic/version_lag` (policy steps taken - the scoring critic's version)
is 0 unless the critic fell behind. The finished step's metrics (value loss, value clip
fraction, grad norm) come back with the next call, under `critic/`.

With trainer.snapshot_every, the same thread then writes the critic's snapshot
(RUN_DIR/critic/snapshots/), which a healed critic, or the critic of a healed policy,
restores (controller/heal.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import socket
import time

import torch
import torch.distributed as dist
from monarch.actor import Actor, concurrent_endpoint, endpoint
from tensordict import TensorDict

from meshrl.config import Config
from meshrl.config.cpus import cpus_for
from meshrl.futures import awaited, by_rank, settled, stopped_on_failure
from meshrl.host import gloo_on_this_host, host_address, procs_dead, started
from meshrl.launch.devices import planned_gpu
from meshrl.launch.holdings import critic_checkpointing
from meshrl.logs import capture_role_output
from meshrl.pinning import pin_this_process
from meshrl.trainer.actor import init_process_group_listening_on
from meshrl.trainer.critic import CriticTrainer
from meshrl.trainer.snapshot import Snapshots, snapshot_budget, snapshot_root
from meshrl.trainer.values import reduce_value_metrics, value_metric_sums

SNAPSHOTS_KEPT = 3
"""A policy healed to version v' needs the critic's snapshot of v'; when the critic has
already trained on the next batch or two, that is the third newest."""


def snapshots_kept(pace) -> int:
    """The critic's snapshots kept under its model's `trainer.pace`: with `accumulate`, a heal
    takes the model back to its last update, up to `every - steps` steps before its newest,
    while the critic trains (and snapshots) on every step's batch."""
    return SNAPSHOTS_KEPT + (pace.every - pace.steps if pace.accumulate else 0)


def critic_root(run_dir: str) -> str:
    """Where the critic's snapshots live (RUN_DIR/critic/snapshots)."""
    return os.path.join(run_dir, "critic")


TRAIN_METRICS = ("value_loss", "value_clip_frac", "value_abs_max", "grad_norm", "lr", "value_nonfinite", "step_time_s")
"""A finished critic step's metrics reported (as `critic/NAME`) with the next batch; its
explained variance and means are those of the batch it scored, reported when it scored it."""


def build_critic(config: Config, device: str = "cpu") -> CriticTrainer:
    """The CriticTrainer `config.critic` describes, on `device` (`critic.path`: that
    checkpoint; else `critic.init`: the policy's starting weights, or the policy's shapes from
    seed + 1)."""
    from meshrl.trainer.parallelize import compute_dtype

    cc, model, overrides, seed = config.critic, config.model, None, config.seed
    if cc.path is not None:
        model = dataclasses.replace(model, path=cc.path)
    elif cc.init == "scratch":
        seed = config.seed + 1
        if model.path is not None:  # the checkpoint's shapes, none of its weights
            from meshrl.config.hf import model_args_from_hf

            model, overrides = model_args_from_hf(model.path)
            model = dataclasses.replace(model, path=None)
    return CriticTrainer(
        model,
        lr=cc.lr,
        weight_decay=cc.weight_decay,
        warmup_steps=cc.warmup_steps,
        grad_clip=cc.grad_clip,
        value_clip=cc.value_clip,
        gamma=cc.gamma,
        lam=cc.lam,
        value_lam=cc.value_lam,
        adaptive_lam=cc.adaptive_lam,
        aggregation=config.trainer.loss.aggregation,
        micro_batch_size=cc.micro_batch_size,
        micro_batch_tokens=config.trainer.micro_batch_tokens,
        epochs=cc.epochs,
        seed=seed,
        device=device,
        compute_dtype=compute_dtype(config.trainer, device),
        hf_overrides=overrides,
        activation_checkpoint=critic_checkpointing(config),
    )


class CriticActor(Actor):
    """One rank of the critic. Endpoints run one at a time; its train step runs in a thread."""

    def __init__(self) -> None:
        self.critic: CriticTrainer | None = None
        self.config: Config | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="critic-train")
        self._training: concurrent.futures.Future | None = None
        self._finished: dict[str, float] = {}
        self.snapshots: Snapshots | None = None

    @endpoint
    async def setup(self, config_dict: dict) -> dict:
        """Build the value model and its optimizer: on the GPU the device plan started this proc
        seeing (beside a GPU trainer), else pinned to the cores of the trainer's proc of the
        same local rank. With several procs: torch.distributed from the elastic env (rank 0's
        store on this host's address only), then the model sharded over them."""
        config = Config.from_dict(config_dict)
        world = config.critic.procs
        rank = int(os.environ["RANK"]) if world > 1 else 0
        capture_role_output(config, "critic" if world == 1 else f"critic-{rank}")
        device = "cuda" if planned_gpu() else "cpu"
        if device == "cuda":
            torch.cuda.set_device(0)  # its one GPU
        cpus = cpus_for(config.trainer.cpus, rank)
        if cpus is not None and device == "cpu":
            pin_this_process(cpus)  # also sizes torch's thread pool to them
        elif device == "cpu" and world > 1:  # the critic's procs share the host's cores: don't oversubscribe them
            await self._run(torch.set_num_threads, max(1, (os.cpu_count() or 1) // world))  # on the thread its tensor work runs on
        group = None  # several procs: the snapshots' collectives on a gloo group of their own
        with gloo_on_this_host() if world > 1 else contextlib.nullcontext():
            if world > 1:
                timeout_s = config.trainer.collective_timeout_s
                await self._run(init_process_group_listening_on, host_address() or "127.0.0.1", rank, world, device == "cuda", timeout_s)
                group = await self._run(dist.new_group, None, None, "gloo") if config.trainer.snapshot_every else None
            self.config, self.critic = config, await self._run(build_critic, config, device)
        if config.trainer.snapshot_every:
            root = snapshot_root(critic_root(config.logging.run_dir))
            self.snapshots = Snapshots(
                root, config.trainer.snapshot_every, group, blocking=True, keep=snapshots_kept(config.trainer.pace), budget=snapshot_budget(config)
            )
        return self._info()

    def _train(self, batch: TensorDict, returns: torch.Tensor, old: torch.Tensor) -> dict[str, float]:
        """The critic's step on one batch, then its snapshot when due (in the training thread)."""
        critic = self._need()
        out = critic.train_step(batch, returns, old)
        if self.snapshots is not None and self.snapshots.due(critic.version):
            self.snapshots.start(critic.version, critic.model, critic.optimizer, critic.scheduler)
            self.snapshots.finish()
        return out

    def _need(self) -> CriticTrainer:
        if self.critic is None:
            raise RuntimeError("CriticActor.setup(config) must run first")
        return self.critic

    def _info(self) -> dict:
        critic = self._need()
        return {
            "rank": critic.dp_rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": started(),
            "version": critic.version,
            "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in critic.model.parameters()),
            "cpus": sorted(os.sched_getaffinity(0)),
            "device": str(critic.device),
        }

    async def _run(self, fn, *args):
        """`fn(*args)` on the critic's one thread. All of its tensor work runs there: ATen
        parallel regions entered from a second thread of the proc start an OpenMP team of
        their own, and with two the critic's values took 1.42 times as long and its steps 1.31
        times (benchmarks/README.md, section 19)."""
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    async def _finish(self) -> float:
        """Wait for the train step in flight, if any (its metrics are kept for the next
        answer; its error is raised here). Returns the seconds waited."""
        t0 = time.perf_counter()
        if self._training is not None:
            future, self._training = self._training, None
            self._finished = await asyncio.wrap_future(future)
        return time.perf_counter() - t0

    @endpoint
    async def advantages(self, batch: TensorDict, policy_step: int) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
        """(token_advantage [B, T] or None, loss_mask [B, T], metrics) for the batch the policy
        trains next as version `policy_step` + 1, then this batch's critic step in the background.

        token_advantage is None while `critic.policy_warmup` lasts (the policy trains on the
        group advantage the workers wrote); the loss mask has failed episodes off either way.
        Every rank gets the batch and values its share of the rows; rank 0 answers, the
        others give (None, None, {}).
        """
        critic, cc = self._need(), self.config.critic
        wait_s = await self._finish()
        finished, self._finished = self._finished, {}
        t0 = time.perf_counter()
        version = critic.version
        returns, old, scored = await self._run(self._score, batch, cc.whiten)  # writes batch["token_advantage"], drops failed rows from the mask
        mask = batch["loss_mask"]
        score_s = time.perf_counter() - t0
        self._training = self._pool.submit(self._train, batch, returns, old)
        if critic.dp_rank != 0:
            return None, None, {}
        warm = policy_step < cc.policy_warmup
        metrics = {
            "critic/version": float(version),
            "critic/version_lag": float(policy_step - version),
            "critic/explained_variance": scored.get("explained_variance", 0.0),
            "critic/value_mean": scored.get("value_mean", 0.0),
            "critic/return_mean": scored.get("return_mean", 0.0),
            "critic/score_s": score_s,
            "critic/wait_s": wait_s,
            **{f"critic/{k}": float(finished[k]) for k in TRAIN_METRICS if k in finished},
        }
        return (None if warm else batch["token_advantage"]), mask, metrics

    def _score(self, batch: TensorDict, whiten: bool):
        critic = self._need()
        returns, old = critic.advantages(batch, whiten=whiten)
        return returns, old, reduce_value_metrics([value_metric_sums(old, returns, batch["loss_mask"])])

    @endpoint
    async def save_checkpoint(self, root: str) -> str:
        """The critic after its last batch's step (waited for), as a DCP checkpoint under `root`."""
        await self._finish()
        return await self._run(self._need().save_checkpoint, root)

    @endpoint
    async def load_checkpoint(self, path: str) -> int:
        await self._finish()
        return await self._run(self._need().load_checkpoint, path)

    @endpoint
    async def export_hf(self, path: str) -> str:
        """The critic after its last batch's step, as a HF token-classification checkpoint in the policy's dtype."""
        await self._finish()
        return await self._run(self._need().export_hf, path, getattr(torch, self.config.model.dtype))

    @endpoint
    async def info(self) -> dict:
        """pid, version (after the step in flight), threads, parameters, cores."""
        await self._finish()
        return self._info()

    @concurrent_endpoint
    async def ping(self) -> int:
        """Its pid, at once: a liveness probe that waits neither for the train step in flight
        nor for a call under way."""
        return os.getpid()

    @endpoint
    async def teardown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if dist.is_initialized():
            dist.destroy_process_group()


async def rank0(endpoint_, *args):
    """`endpoint_` called on every critic rank (their collectives run in step); rank 0's answer."""
    values = await awaited(endpoint_.call(*args))
    return by_rank(values)[0]


class CriticMesh:
    """The controller's handle on the critic's procs. Every call has a timeout; `stop()` always."""

    def __init__(self, procs, actor, timeout_s: float):
        self.procs, self.actor, self.timeout_s = procs, actor, timeout_s
        self.pid: int | None = None  # rank 0's proc's, once set up
        self.proc_ids: list[tuple[int, float | None]] = []  # each rank's (pid, start time on this host; None elsewhere), for a heal's kill

    async def _call(self, endpoint_, *args):
        return await asyncio.wait_for(rank0(endpoint_, *args), self.timeout_s)

    async def save_checkpoint(self, root: str) -> str:
        return await self._call(self.actor.save_checkpoint, root)

    async def load_checkpoint(self, path: str) -> int:
        return await self._call(self.actor.load_checkpoint, path)

    async def export_hf(self, path: str, base_dir: str | None = None) -> str:
        """`base_dir`: unused (no LoRA critic); the policy's trainer takes it."""
        return await self._call(self.actor.export_hf, path)

    async def info(self) -> dict:
        return await self._call(self.actor.info)

    async def answers(self, timeout_s: float = 10.0) -> bool:
        """Whether every critic proc still answers (after a failed step: whose fault it was); one
        seen gone on this host does not (it is not asked, whose answer could take Monarch's delivery timeout)."""
        if procs_dead(self.proc_ids):
            return False
        return await settled(self.actor.ping.call(), timeout_s) is None  # dead or unreachable: all the same

    async def stop(self) -> None:
        """Its process group ended (no teardown call to a proc seen gone on this host), then its proc stopped."""
        try:
            if not procs_dead(self.proc_ids):
                await asyncio.wait_for(awaited(self.actor.teardown.call_one()), 30)
        except Exception:  # noqa: BLE001 - the proc is stopped below either way
            pass
        await asyncio.wait_for(self.procs.stop(), 60)


async def spawn_critic(config: Config, host_mesh, bootstrap_command=None) -> CriticMesh:
    """`critic.procs` procs on `host_mesh` (the trainer's first host), each started by
    `bootstrap_command` (the device plan's, for its slots), their actors set up from
    `config`. The caller owns the returned mesh: `await mesh.stop()`."""
    from monarch.spmd import setup_torch_elastic_env_async

    timeout_s, n = config.critic.timeout_s, config.critic.procs
    procs = host_mesh.spawn_procs(per_host={"procs": n}, bootstrap_command=bootstrap_command)
    async with stopped_on_failure(procs):
        if n > 1:
            await asyncio.wait_for(setup_torch_elastic_env_async(procs), 60)
        actor = procs.spawn("critic", CriticActor)
        mesh = CriticMesh(procs, actor, timeout_s)
        values = await asyncio.wait_for(awaited(actor.setup.call(config.to_dict())), timeout_s)
        infos = by_rank(values)
        mesh.pid = infos[0]["pid"]
        mesh.proc_ids = [(i["pid"], i["started"] if i["host"] == socket.gethostname() else None) for i in infos]
        return mesh
